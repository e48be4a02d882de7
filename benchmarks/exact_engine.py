"""Exact mode's price: generation time of the built-in engine's normal KV-cache sampler, the reference exact
sampler (a full forward of the row per token) and the speculative exact sampler (KV-cache draft verified by
the exact forward, rollout/spec_exact.py), in one run, per dtype, on the demo policy's shape (2 layers,
d 128, vocab 32), in process (no gRPC).

    .venv/bin/python benchmarks/exact_engine.py [--prompts 32] [--n 8] [--max-tokens 48] [--dtypes float32,bfloat16]
        [--repeats 7] [--reference-repeats 2]

All paths sample the same requests (prompts × n rows, no stop token, so every row produces max_tokens
tokens) after one warm-up call each that pays the compilation. Then `--repeats` rounds each time one call of
every path, rotating which goes first, so load drift from other work hits all paths alike; the reference
exact sampler (20–60× slower) is timed in the first `--reference-repeats` rounds only. The table reports
medians, the speculative/normal ratio both as a ratio of medians and as the median of the per-round ratios
(the two calls of a round ran back to back), the speculative call's split into draft program, exact verify
program and host work (`SpecStats`), its acceptance rate (draft tokens the exact sampler picked identically
/ draft tokens checked), rounds and exact row forwards, the canonical length the rows were verified at, and
the number of tokens and log-probs that differ from the reference exact sampler (must be 0). Records the
load average. Writes benchmarks/results/exact_engine.json.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks._args import ArgumentParser, description, positive_int  # noqa: E402
from benchmarks._paths import check_out, repo_relative_args, write_json  # noqa: E402
from jaxrl_mismatch import precision  # noqa: E402
from jaxrl_mismatch.models import ModelConfig, Transformer, save_hf  # noqa: E402
from jaxrl_mismatch.models.exact import canonical_length  # noqa: E402
from jaxrl_mismatch.rollout.engine import SamplingSpec  # noqa: E402
from jaxrl_mismatch.rollout.jax_engine import JaxEngine  # noqa: E402

DEMO_SHAPE = dict(architecture="Qwen3ForCausalLM", vocab_size=32, hidden_size=128, intermediate_size=384,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  rope_theta=1e4, rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
                  max_position_embeddings=256)


def main() -> int:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--prompts", type=positive_int, default=32)
    ap.add_argument("--n", type=positive_int, default=8)
    ap.add_argument("--prompt-len", type=positive_int, default=30)
    ap.add_argument("--max-tokens", type=positive_int, default=48)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=positive_int, default=7)
    ap.add_argument("--reference-repeats", type=positive_int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "exact_engine.json"))
    a = ap.parse_args()
    check_out("--out", a.out, __file__)
    dtypes = a.dtypes.split(",")
    if any(d not in ("float32", "bfloat16", "float16") for d in dtypes):
        print(f"error: --dtypes: each must be float32, bfloat16 or float16, got {a.dtypes!r}", file=sys.stderr)
        return 2
    if a.repeats < 1 or not 1 <= a.reference_repeats <= a.repeats:
        print(f"error: --repeats must be ≥ 1 and --reference-repeats in 1..--repeats, got {a.repeats}, "
              f"{a.reference_repeats}", file=sys.stderr)
        return 2

    cfg = ModelConfig(**DEMO_SHAPE)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, a.prompt_len).tolist() for _ in range(a.prompts)]
    tokens = a.prompts * a.n * a.max_tokens
    paths = ("normal", "exact_reference", "exact_speculative")
    results = {}
    load = {"start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as d:
        save_hf(Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(0)), cfg, d)
        for dtype in dtypes:
            engines = {"normal": JaxEngine(d, dtype=dtype), "exact_reference": JaxEngine(d, dtype=dtype, exact_sampler="reference"),
                       "exact_speculative": JaxEngine(d, dtype=dtype)}
            specs = {p: SamplingSpec(n=a.n, max_tokens=a.max_tokens, temperature=1.0, seed=1, exact=p != "normal") for p in paths}
            outs = {p: engines[p].generate(prompts, specs[p]) for p in paths}  # warm-up: compiles every program
            ref = [c for g in outs["exact_reference"] for c in g]
            spec_ = [c for g in outs["exact_speculative"] for c in g]
            bad_tokens = sum(int(np.sum(np.array(x.token_ids) != np.array(y.token_ids))) for x, y in zip(ref, spec_))
            bad_logps = sum(int(np.sum(np.array(x.logprobs, np.float32).view(np.int32) != np.array(y.logprobs, np.float32).view(np.int32)))
                            for x, y in zip(ref, spec_))
            times: dict[str, list[float]] = {p: [] for p in paths}
            stats = []
            for i in range(a.repeats):
                order = [p for p in paths[i % 3:] + paths[: i % 3] if p != "exact_reference" or i < a.reference_repeats]
                for p in order:
                    engines[p].exact_stats = type(engines[p].exact_stats)()
                    t0 = time.perf_counter()
                    out = engines[p].generate(prompts, specs[p])
                    times[p].append(time.perf_counter() - t0)
                    assert sum(len(c.token_ids) for g in out for c in g) == tokens
                    if p == "exact_speculative":
                        stats.append(engines[p].exact_stats)
            med = {p: statistics.median(ts) for p, ts in times.items()}
            split = {k: statistics.median(getattr(st, k) for st in stats) for k in ("draft_s", "verify_s")}
            split["host_s"] = statistics.median(st.total_s - st.draft_s - st.verify_s for st in stats)
            st = stats[0]
            for other in stats[1:]:
                st.add(other)
            results[dtype] = {"seconds": times, "median_s": med, "tokens_per_s": {p: tokens / med[p] for p in paths},
                              "time_over_normal": {p: med[p] / med["normal"] for p in paths},
                              "speculative_over_normal_paired_median": statistics.median(
                                  s_ / n_ for s_, n_ in zip(times["exact_speculative"], times["normal"])),
                              "speculative_split_median_s": split,
                              "acceptance_rate": st.acceptance_rate, "rounds_per_call": st.rounds / a.repeats,
                              "exact_forwards_per_call": st.exact_forwards / a.repeats,
                              "mismatching_tokens": bad_tokens, "mismatching_logprobs": bad_logps}
    load["end"] = os.getloadavg()[0]
    length = canonical_length(a.prompt_len, a.max_tokens)
    print(f"({a.prompts} prompts × {a.n} × {a.max_tokens} tokens = {tokens} tokens per call; median of {a.repeats} "
          f"interleaved calls ({a.reference_repeats} for the reference); rows verified at canonical length {length} "
          f"for {a.prompt_len + a.max_tokens} tokens; load average {load['start']:.1f} → {load['end']:.1f})")
    print(f"{'dtype':<9} {'path':<18} {'median s':>9} {'tokens/s':>10} {'× normal':>9}")
    for dtype, r in results.items():
        for p in paths:
            print(f"{dtype:<9} {p:<18} {r['median_s'][p]:>9.3f} {r['tokens_per_s'][p]:>10.0f} {r['time_over_normal'][p]:>9.2f}")
        sp = r["speculative_split_median_s"]
        print(f"{dtype:<9} speculative: {r['speculative_over_normal_paired_median']:.2f}× normal (median of per-round "
              f"ratios); draft {sp['draft_s']:.3f} s, verify {sp['verify_s']:.3f} s, host {sp['host_s']:.3f} s; "
              f"acceptance {r['acceptance_rate']:.4f}, {r['rounds_per_call']:.0f} rounds and "
              f"{r['exact_forwards_per_call']:.0f} exact row forwards per call; tokens differing from the reference "
              f"{r['mismatching_tokens']}, log-probs differing {r['mismatching_logprobs']}")
    result = {"device": str(jax.devices()[0]), "machine": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count(), "load_average_1min": load, "canonical_length": length,
              "config": repo_relative_args(vars(a)), "results": results}
    write_json(a.out, result, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
