"""Exact mode's price: generation time of the built-in engine's normal KV-cache sampler, the reference exact
sampler (a full forward of the row per token) and the speculative exact sampler (KV-cache draft verified by
the exact forward, rollout/spec_exact.py), in one run, per dtype, on the demo policy's shape (2 layers,
d 128, vocab 32), in process (no gRPC).

    .venv/bin/python benchmarks/exact_engine.py [--prompts 32] [--n 8] [--max-tokens 48] [--dtypes float32,bfloat16]

All paths sample the same requests (prompts × n rows, no stop token, so every row produces max_tokens
tokens) after one warm-up call each that pays the compilation; the table reports the median of
`--repeats` timed calls, rotating which path goes first. It also reports the speculative sampler's
acceptance rate (draft tokens the exact sampler picked identically / draft tokens checked), its rounds and
exact row forwards, and the number of tokens and log-probs that differ from the reference exact sampler
(must be 0). Writes benchmarks/results/exact_engine.json.
"""

from __future__ import annotations

import argparse
import json
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

from benchmarks._paths import repo_relative_args  # noqa: E402
from jaxrl_mismatch import precision  # noqa: E402
from jaxrl_mismatch.models import ModelConfig, Transformer, save_hf  # noqa: E402
from jaxrl_mismatch.rollout.engine import SamplingSpec  # noqa: E402
from jaxrl_mismatch.rollout.jax_engine import JaxEngine  # noqa: E402

DEMO_SHAPE = dict(architecture="Qwen3ForCausalLM", vocab_size=32, hidden_size=128, intermediate_size=384,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  rope_theta=1e4, rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
                  max_position_embeddings=256)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "exact_engine.json"))
    a = ap.parse_args()
    dtypes = a.dtypes.split(",")
    if any(d not in ("float32", "bfloat16", "float16") for d in dtypes):
        print(f"error: --dtypes: each must be float32, bfloat16 or float16, got {a.dtypes!r}", file=sys.stderr)
        return 2

    cfg = ModelConfig(**DEMO_SHAPE)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, a.prompt_len).tolist() for _ in range(a.prompts)]
    tokens = a.prompts * a.n * a.max_tokens
    paths = ("normal", "exact_reference", "exact_speculative")
    results = {}
    with tempfile.TemporaryDirectory() as d:
        save_hf(Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(0)), cfg, d)
        for dtype in dtypes:
            engines = {"normal": JaxEngine(d, dtype=dtype), "exact_reference": JaxEngine(d, dtype=dtype, exact_sampler="reference"),
                       "exact_speculative": JaxEngine(d, dtype=dtype)}
            specs = {p: SamplingSpec(n=a.n, max_tokens=a.max_tokens, temperature=1.0, seed=1, exact=p != "normal") for p in paths}
            outs = {p: engines[p].generate(prompts, specs[p]) for p in paths}  # compile
            ref = [c for g in outs["exact_reference"] for c in g]
            spec_ = [c for g in outs["exact_speculative"] for c in g]
            bad_tokens = sum(int(np.sum(np.array(x.token_ids) != np.array(y.token_ids))) for x, y in zip(ref, spec_))
            bad_logps = sum(int(np.sum(np.array(x.logprobs, np.float32).view(np.int32) != np.array(y.logprobs, np.float32).view(np.int32)))
                            for x, y in zip(ref, spec_))
            engines["exact_speculative"].exact_stats = type(engines["exact_speculative"].exact_stats)()
            times: dict[str, list[float]] = {p: [] for p in paths}
            for i in range(a.repeats):
                for p in paths[i % 3:] + paths[: i % 3]:
                    t0 = time.perf_counter()
                    out = engines[p].generate(prompts, specs[p])
                    times[p].append(time.perf_counter() - t0)
                    assert sum(len(c.token_ids) for g in out for c in g) == tokens
            st = engines["exact_speculative"].exact_stats
            med = {p: statistics.median(ts) for p, ts in times.items()}
            results[dtype] = {"seconds": times, "median_s": med, "tokens_per_s": {p: tokens / med[p] for p in paths},
                              "time_over_normal": {p: med[p] / med["normal"] for p in paths},
                              "acceptance_rate": st.acceptance_rate, "rounds_per_call": st.rounds / a.repeats,
                              "exact_forwards_per_call": st.exact_forwards / a.repeats,
                              "mismatching_tokens": bad_tokens, "mismatching_logprobs": bad_logps}
    print(f"({a.prompts} prompts × {a.n} × {a.max_tokens} tokens = {tokens} tokens per call; median of {a.repeats})")
    print(f"{'dtype':<9} {'path':<18} {'median s':>9} {'tokens/s':>10} {'× normal':>9}")
    for dtype, r in results.items():
        for p in paths:
            print(f"{dtype:<9} {p:<18} {r['median_s'][p]:>9.3f} {r['tokens_per_s'][p]:>10.0f} {r['time_over_normal'][p]:>9.2f}")
        print(f"{dtype:<9} speculative: acceptance {r['acceptance_rate']:.4f}, {r['rounds_per_call']:.0f} rounds and "
              f"{r['exact_forwards_per_call']:.0f} exact row forwards per call; tokens differing from the reference "
              f"{r['mismatching_tokens']}, log-probs differing {r['mismatching_logprobs']}")
    result = {"device": str(jax.devices()[0]), "machine": platform.processor() or platform.machine(),
              "config": repo_relative_args(vars(a)), "results": results}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
