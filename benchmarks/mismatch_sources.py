"""How large is each mismatch source? log_ppl_abs_diff, ρ mean and ρ std of every rollout source against
the fp32 trainer, on the experiment task (configs/arith_length_cpu.py: its warm-started policy, its
training prompts, group size, max_tokens and temperature), in one run.

    .venv/bin/python benchmarks/mismatch_sources.py [--model runs/arith_length_base] [--seeds 3]

Sources: the built-in engine in fp32 / fp16 / bf16; int8 and fp8 weight quantization (models/quantize.py) on
the fp32 and the bf16 engine; injected logit noise σ ∈ {0.01, …, 3} on the fp32 engine (as the experiments
inject it); exact mode (μ = π by construction) alone and with int8 / fp8 (the quantization's mismatch with
no other rounding). For each source and seed the engine samples `--prompts` training prompts × group_size
completions; the trainer scores the same tokens in fp32 exactly as a training step does (`models.scoring.score_tokens`,
or `score_exact` in exact mode) and `metrics.step.step_metrics` gives the `mismatch/*` values a run logs.
The table shows the mean over seeds; the JSON keeps every seed's values.

The model is warm-started first if `--model` does not hold one (the config's `model.warmstart_args`).
Writes docs/results/mismatch_sources.json and .md (through temporary siblings renamed into place).
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks._args import ArgumentParser, check_model, description, positive_int  # noqa: E402
from benchmarks._paths import check_out, repo_relative, repo_relative_args, write_json  # noqa: E402
from jaxrl_mismatch import precision  # noqa: E402
from jaxrl_mismatch.metrics import metrics_config  # noqa: E402
from jaxrl_mismatch.metrics.step import step_metrics  # noqa: E402
from jaxrl_mismatch.models import load_hf  # noqa: E402
from jaxrl_mismatch.models.exact import score_exact  # noqa: E402
from jaxrl_mismatch.objectives import objective_config  # noqa: E402
from jaxrl_mismatch.rollout.engine import SamplingSpec  # noqa: E402
from jaxrl_mismatch.rollout.jax_engine import JaxEngine  # noqa: E402
from jaxrl_mismatch.train.batch import from_completions  # noqa: E402
from jaxrl_mismatch.train.config_overrides import load_config  # noqa: E402
from jaxrl_mismatch.models.scoring import score_tokens  # noqa: E402
from jaxrl_mismatch.train.task_data import TaskData  # noqa: E402
from jaxrl_mismatch.usage import UsageError, listing  # noqa: E402

SIGMAS = (0.01, 0.02, 0.05, 0.1, 0.3, 1.0, 3.0)
KEYS = ("mismatch/log_ppl_abs_diff", "mismatch/log_ppl_diff", "mismatch/rho_mean", "mismatch/rho_std",
        "mismatch/kl_k3", "mismatch/ess_seq")


def sources() -> list[dict]:
    """(name, engine dtype, quantize, σ, exact) of every measured source, in table order."""
    out = [dict(name="exact (fp32)", dtype="float32", quantize="none", sigma=0.0, exact=True)]
    out += [dict(name=f"{d} engine", dtype=d, quantize="none", sigma=0.0, exact=False)
            for d in ("float32", "float16", "bfloat16")]
    out += [dict(name=f"{q} ({d} engine)", dtype=d, quantize=q, sigma=0.0, exact=False)
            for d in ("float32", "bfloat16") for q in ("int8", "fp8")]
    out += [dict(name=f"{q} + exact (fp32)", dtype="float32", quantize=q, sigma=0.0, exact=True) for q in ("int8", "fp8")]
    out += [dict(name=f"σ = {s:g} (fp32 engine)", dtype="float32", quantize="none", sigma=s, exact=False) for s in SIGMAS]
    return out


def _check_warmstart_target(path: str) -> None:
    """`--model` holds no config.json: it must be a folder the warm start may write (new or empty), else one line
    naming --model (the warm start's own check named its `--out` and a `--force` this script does not have)."""
    from jaxrl_mismatch.outputs import check_out_dir

    if os.path.lexists(path) and not os.path.islink(path) and not os.path.isdir(path):
        raise UsageError(f"--model {path}: is a file; expected a checkpoint directory, or a new or empty one to "
                         "warm-start into")
    if os.path.isdir(path) and not os.path.islink(path) and (entries := sorted(os.listdir(path))):
        raise UsageError(f"--model {path}: has no config.json and is not empty (holds {listing(entries)}); expected "
                         "a checkpoint directory, or a new or empty one to warm-start into (nothing was changed)")
    check_out_dir("--model", path, "warmstart", force=False)  # a symbolic link, a parent it cannot write in


def _warmstart(c) -> None:
    if os.path.isfile(os.path.join(c.model.path, "config.json")):
        return
    from jaxrl_mismatch.jobs import warmstart

    print(f"no checkpoint at {c.model.path}: warm-starting it ({c.model.warmstart_args})", flush=True)
    if warmstart.main(["--out", c.model.path, *shlex.split(c.model.warmstart_args)]):
        raise UsageError(f"--model {c.model.path}: the warm start failed")


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--config", default=str(REPO / "configs" / "arith_length_cpu.py"))
    ap.add_argument("--model", default=None, help="HF checkpoint (default: the config's model.path, under the repo)")
    ap.add_argument("--prompts", type=positive_int, default=32, help="training prompts per seed (× the config's group_size)")
    ap.add_argument("--seeds", type=positive_int, default=3)
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "mismatch_sources.json"))
    a = ap.parse_args(argv)
    check_out("--out", a.out, __file__, table=True)
    if a.prompts < 1 or a.seeds < 1:
        raise UsageError("--prompts / --seeds: must be >= 1")
    c = load_config(a.config)
    c.model.path = os.path.abspath(a.model) if a.model else str(REPO / c.model.path)
    if not os.path.isfile(os.path.join(c.model.path, "config.json")):
        _check_warmstart_target(c.model.path)
        _warmstart(c)
    check_model("--model", c.model.path, c)  # before anything is loaded or measured: one line, exit 2
    r = c.rollout

    _, model = load_hf(c.model.path, policy=precision.policy(c.trainer.precision, param_dtype="float32"))
    graphdef, params = nnx.split(model, nnx.Param)
    data = TaskData(c, model.cfg.vocab_size)
    mcfg = metrics_config(objective_config(c.objective.preset))
    metrics_fn = jax.jit(lambda lp, mu, m, adv: step_metrics(lp, mu, m, adv, cfg=mcfg))
    engines: dict[tuple[str, str], JaxEngine] = {}
    per_seed: dict[str, list[dict[str, float]]] = {s["name"]: [] for s in sources()}
    t0 = time.perf_counter()
    for seed in range(a.seeds):
        prompts: list[list[int]] = []
        while len(prompts) < a.prompts:
            prompts += data.next_prompts()[0]
        prompts = prompts[: a.prompts]
        for s in sources():
            key = (s["dtype"], s["quantize"])
            if key not in engines:
                engines[key] = JaxEngine(c.model.path, dtype=s["dtype"], quantize=s["quantize"])
            spec = SamplingSpec(n=r.group_size, max_tokens=r.max_tokens, temperature=r.temperature, seed=1000 + seed,
                                stop_token_ids=(data.eos_id,), exact=s["exact"], logit_noise_std=s["sigma"])
            out = engines[key].generate(prompts, spec)
            rows = [prompts[i] for i, g in enumerate(out) for _ in g]
            b = from_completions(rows, [x.token_ids for g in out for x in g], [x.logprobs for g in out for x in g],
                                 np.zeros(len(rows)), pad_id=data.pad_id)
            if s["exact"]:
                logp = score_exact(graphdef, params, b.tokens, b.attention_mask, b.response_mask,
                                   max_tokens=r.max_tokens, temperature=r.temperature)
            else:
                logp = score_tokens(graphdef, params, b.tokens, b.attention_mask, chunk_size=c.trainer.chunk_size,
                                    temperature=r.temperature).logp
            m = metrics_fn(logp, b.rollout_logp, b.response_mask, b.advantages)
            per_seed[s["name"]].append({k: float(m[k]) for k in KEYS})
            print(f"seed {seed} {s['name']:<24} " + " ".join(f"{k.split('/')[1]}={per_seed[s['name']][-1][k]:.3g}"
                                                            for k in KEYS[:4]), flush=True)
    mean = {name: {k: float(np.mean([v[k] for v in vals])) for k in KEYS} for name, vals in per_seed.items()}
    elapsed = time.perf_counter() - t0

    head = (f"| source | log_ppl_abs_diff | log_ppl_diff (signed) | ρ mean | ρ std | KL k3 | seq ESS |\n"
            f"| --- | --- | --- | --- | --- | --- | --- |\n")
    lines = [f"| {n} | {v[KEYS[0]]:.3g} | {v[KEYS[1]]:+.3g} | {v[KEYS[2]]:.4f} | {v[KEYS[3]]:.3g} | {v[KEYS[4]]:.3g} | "
             f"{v[KEYS[5]]:.3f} |" for n, v in mean.items()]
    table = head + "\n".join(lines) + "\n"
    print(table)
    setup = (f"{a.prompts} training prompts × {r.group_size} samples × ≤ {r.max_tokens} tokens per seed, T = "
             f"{r.temperature}, mean over {a.seeds} seeds; trainer fp32; model {os.path.relpath(c.model.path, REPO)}")
    result = {"device": str(jax.devices()[0]), "machine": platform.processor() or platform.machine(),
              "config": {**repo_relative_args(vars(a)), "model": repo_relative(c.model.path), "group_size": r.group_size, "max_tokens": r.max_tokens,
                         "temperature": r.temperature}, "sources": sources(), "mean": mean, "per_seed": per_seed,
              "seconds": elapsed}
    print(f"measured in {elapsed:.0f} s")
    write_json(a.out, result, __file__, table=f"# Mismatch sources vs the fp32 trainer ({Path(a.config).name})\n\n"
               f"Written by `benchmarks/mismatch_sources.py`: {setup}.\n\n{table}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
