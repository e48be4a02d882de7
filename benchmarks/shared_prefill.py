"""Generation time of the built-in engine with each distinct prompt prefilled once and its KV cache copied to its n
samples (`JaxEngine(share_prefill=True)`, the default) against one prefill per row, in one run, in process.

    .venv/bin/python benchmarks/shared_prefill.py [--repeats 7] [--shapes demo,long]

Shapes (the demo policy's model, 2 layers, d 128, random weights, float32, no stop token):
- `demo`: the demo's rollout, 32 prompts × 8 samples, prompts of 25–35 tokens, 48 new tokens;
- `long`: a math-style request, 8 prompts × 8 samples, prompts of 400–500 tokens, 32 new tokens.
One warm-up call per setting pays the compilation; then `--repeats` rounds, each one call of both settings in
alternating order, so load drift hits both alike. Reports medians, the median of the per-round ratios, and
whether both settings sampled the same tokens (they should: only the prefill's batch differs). Records the load
average. Writes benchmarks/results/shared_prefill.json.
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

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks._args import ArgumentParser, description, positive_int, nonneg_int  # noqa: E402
from benchmarks._paths import check_out, repo_relative_args, write_json  # noqa: E402
from jaxrl_mismatch import precision  # noqa: E402
from jaxrl_mismatch.jobs.warmstart import tiny_config  # noqa: E402
from jaxrl_mismatch.models import Transformer, save_hf  # noqa: E402
from jaxrl_mismatch.rollout.engine import SamplingSpec  # noqa: E402
from jaxrl_mismatch.rollout.jax_engine import JaxEngine  # noqa: E402

SHAPES = {  # prompts, n, prompt length range, new tokens
    "demo": (32, 8, (25, 35), 48),
    "long": (8, 8, (400, 500), 32),
}
VOCAB = 64


def measure(model_dir: str, shape: str, repeats: int, seed: int) -> dict:
    n_prompts, n, (lo, hi), new = SHAPES[shape]
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, VOCAB, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n_prompts)]
    spec = SamplingSpec(n=n, max_tokens=new, temperature=1.0, seed=seed)
    engines = {share: JaxEngine(model_dir, share_prefill=share) for share in (True, False)}
    first = {share: e.generate(prompts, spec) for share, e in engines.items()}  # compiles
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(repeats):
        for share in ((True, False) if r % 2 == 0 else (False, True)):
            t0 = time.perf_counter()
            engines[share].generate(prompts, spec)
            times[share].append(time.perf_counter() - t0)
    tokens = lambda out: [c.token_ids for g in out for c in g]  # noqa: E731
    same = sum(a == b for a, b in zip(tokens(first[True]), tokens(first[False]), strict=True))
    return {"shape": shape, "prompts": n_prompts, "n": n, "prompt_len": [lo, hi], "new_tokens": new,
            "shared_s": times[True], "per_row_s": times[False],
            "shared_median_s": statistics.median(times[True]), "per_row_median_s": statistics.median(times[False]),
            "speedup_of_medians": statistics.median(times[False]) / statistics.median(times[True]),
            "median_round_speedup": statistics.median(b / a for a, b in zip(times[True], times[False], strict=True)),
            "rows_with_same_tokens": same, "rows": n_prompts * n}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--shapes", default="demo,long")
    ap.add_argument("--repeats", type=positive_int, default=7)
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "shared_prefill.json"))
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        ap.exit(2, f"error: --shapes: unknown {bad}; choose from {', '.join(SHAPES)}\n")
    if args.repeats < 1:
        ap.exit(2, f"error: --repeats must be >= 1, got {args.repeats}\n")
    check_out("--out", args.out, __file__)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="shared_prefill_") as d:
        cfg = tiny_config(VOCAB, layers=2, hidden=128, heads=4, kv_heads=2, intermediate=384, max_len=640)
        save_hf(Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(args.seed)), cfg, d)
        results = [measure(d, s, args.repeats, args.seed) for s in shapes]
    load_after = os.getloadavg()
    print(f"{'shape':<6}{'rows':>6}{'prompt':>10}{'new':>5}{'shared s':>10}{'per-row s':>11}{'speedup':>9}"
          f"{'per round':>11}{'same tokens':>13}")
    for r in results:
        print(f"{r['shape']:<6}{r['rows']:>6}{'%d-%d' % tuple(r['prompt_len']):>10}{r['new_tokens']:>5}"
              f"{r['shared_median_s']:>10.3f}{r['per_row_median_s']:>11.3f}{r['speedup_of_medians']:>8.2f}×"
              f"{r['median_round_speedup']:>10.2f}×{r['rows_with_same_tokens']:>7}/{r['rows']}")
    print(f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    write_json(args.out, {"config": repo_relative_args(vars(args)), "results": results,
                          "loadavg_before": load_before, "loadavg_after": load_after,
                          "machine": platform.machine(), "cpus": os.cpu_count()}, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
