"""Exact mode's price: generation tokens/s of the built-in engine in exact mode vs its normal KV-cache path,
in one run, on the demo policy's shape (2 layers, d 128, vocab 32), in process (no gRPC).

    .venv/bin/python benchmarks/exact_engine.py [--prompts 32] [--n 8] [--max-tokens 48] [--dtype float32]

Both paths sample the same requests (prompts × n rows, no stop token, so every row produces max_tokens
tokens) after one warm-up call each that pays the compilation; the table reports the median of
`--repeats` timed calls, alternating which path goes first. Exact mode runs a full forward of the row per
sampled token (no KV cache, one row at a time), which is what makes μ equal the trainer's π bit for bit.
Writes benchmarks/results/exact_engine.json.
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
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "exact_engine.json"))
    a = ap.parse_args()

    cfg = ModelConfig(**DEMO_SHAPE)
    with tempfile.TemporaryDirectory() as d:
        save_hf(Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(0)), cfg, d)
        engine = JaxEngine(d, dtype=a.dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, a.prompt_len).tolist() for _ in range(a.prompts)]
    specs = {mode: SamplingSpec(n=a.n, max_tokens=a.max_tokens, temperature=1.0, seed=1, exact=mode == "exact")
             for mode in ("normal", "exact")}
    tokens = a.prompts * a.n * a.max_tokens
    times: dict[str, list[float]] = {"normal": [], "exact": []}
    for mode in times:
        engine.generate(prompts, specs[mode])  # compile
    for i in range(a.repeats):
        for mode in (("normal", "exact") if i % 2 == 0 else ("exact", "normal")):
            t0 = time.perf_counter()
            out = engine.generate(prompts, specs[mode])
            times[mode].append(time.perf_counter() - t0)
            assert sum(len(c.token_ids) for g in out for c in g) == tokens
    rate = {m: tokens / statistics.median(ts) for m, ts in times.items()}
    print(f"{'path':<8} {'median s':>9} {'tokens/s':>10}   ({a.prompts} prompts × {a.n} × {a.max_tokens} tokens, {a.dtype})")
    for m in ("normal", "exact"):
        print(f"{m:<8} {statistics.median(times[m]):>9.3f} {rate[m]:>10.0f}")
    print(f"exact / normal tokens/s: {rate['exact'] / rate['normal']:.3f}  ({rate['normal'] / rate['exact']:.1f}x slower)")
    result = {"device": str(jax.devices()[0]), "machine": platform.processor() or platform.machine(),
              "config": vars(a), "seconds": times, "tokens_per_s": rate, "ratio_exact_over_normal": rate["exact"] / rate["normal"]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
