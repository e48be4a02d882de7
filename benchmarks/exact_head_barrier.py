"""Cost of the exact head's optimization barrier (`models.exact.chunk_logprobs`), beside the head it slows.

    .venv/bin/python benchmarks/exact_head_barrier.py [--vocab 151936] [--hidden 1024] [--rounds 30]

Every exact program (scorer, exact samplers, the update's exact forward) computes log softmax(logits / T) on one
`EXACT_CHUNK` of 16 positions. Since bea0b32 the division is by a full [16, vocab] array held behind
`jax.lax.optimization_barrier`, so XLA cannot turn it into x·(1/T) in some programs and not others (which broke
the bit-for-bit claim at T = 0.7 / 0.8). This times one chunk's LM head (a [16, hidden] × [hidden, vocab] matmul)
plus the log-softmax both ways — the barrier (now) and the scalar division (before) — compiled once each, then
`--rounds` interleaved rounds; reports medians and their ratio. Float32 on this machine's CPU; Qwen3's vocabulary
by default. Writes benchmarks/results/exact_head_barrier.json.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._args import ArgumentParser, check_fits, description, positive_int, positive_float  # noqa: E402
from benchmarks._paths import check_out, repo_relative_args, write_json  # noqa: E402
from jaxrl_mismatch.models.exact import EXACT_CHUNK  # noqa: E402


@jax.jit
def scalar_division(h, w, t):
    logits = h @ w
    return jax.nn.log_softmax(logits / jnp.asarray(t, logits.dtype), axis=-1)


@jax.jit
def barrier_division(h, w, t):  # as models.exact.chunk_logprobs does it
    logits = h @ w
    held = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(t, logits.dtype), logits.shape))
    return jax.nn.log_softmax(logits / held, axis=-1)


def main() -> int:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--vocab", type=positive_int, default=151936)
    ap.add_argument("--hidden", type=positive_int, default=1024)
    ap.add_argument("--rounds", type=positive_int, default=30)
    ap.add_argument("--temperature", type=positive_float, default=0.7)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "exact_head_barrier.json"))
    args = ap.parse_args()
    check_fits(ap, "--vocab × --hidden", 4 * args.vocab * args.hidden, "the float32 [--hidden, --vocab] LM head")
    check_out("--out", args.out, __file__)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(args.hidden, args.vocab)).astype(np.float32) * 0.02)
    h = jnp.asarray(rng.normal(size=(EXACT_CHUNK, args.hidden)).astype(np.float32))
    t = np.float32(args.temperature)
    fns = {"scalar_division": scalar_division, "barrier_division": barrier_division}
    for f in fns.values():
        f(h, w, t).block_until_ready()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f(h, w, t).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["barrier_division"] / med["scalar_division"]
    print("| head of one 16-position chunk | median ms |\n| --- | --- |")
    for k, v in med.items():
        print(f"| {k} | {1e3 * v:.2f} |")
    print(f"barrier / scalar: {ratio:.3f}×  (vocab {args.vocab}, hidden {args.hidden}, {args.rounds} rounds)")
    write_json(args.out, {"config": repo_relative_args(vars(args)), "median_s": med, "ratio": ratio,
                          "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "load_avg": os.getloadavg()}, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
