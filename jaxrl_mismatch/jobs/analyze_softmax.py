"""`jaxrl-mismatch analyze bf16-softmax`: the objective-level hacking paper's App. C.1 simulation of BF16 softmax
discretisation (its eq. 45 and Table 2), next to the paper's numbers (measured tables in `docs/analysis.md`).

Logits z ~ N(0, scale²) over a virtual vocabulary; p = softmax(z) in float32 against p̃, the softmax with its
logits and outputs rounded to bfloat16 (or float16); tokens sampled from p̃; the ratio p/p̃ at those tokens
summarised per seed as Table 2 does, and compared with it.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxrl_mismatch import precision
from jaxrl_mismatch.outputs import staged_dir, write_json
from jaxrl_mismatch.usage import INT32_MAX, UsageError, int_list, physical_memory_bytes

KIND = "analyze bf16-softmax"  # --out's writer as typed; its marker: outputs.marker_name

# Objective-level hacking paper, App. C.1, Table 2 ("Ratio of token probability between float32 and bf16"):
# p_fp32 / p_bf16 at tokens sampled from the BF16 distribution, 5·10⁴ tokens, V = 2048, z ~ N(0, 1.5²).
# Columns: seed, mean, std, max, min, KL divergence. The paper does not say between which distributions its
# KL is taken (nor with which binning), so that column is quoted, not reproduced.
PAPER_TABLE2: tuple[tuple[int, float, float, float, float, float], ...] = (
    (1234, 1.0000, 0.0048, 1.0190, 0.9808, 0.046838),
    (1235, 1.0000, 0.0048, 1.0193, 0.9814, 0.019425),
    (1236, 1.0000, 0.0048, 1.0188, 0.9818, 0.015542),
    (1237, 1.0000, 0.0048, 1.0189, 0.9815, 0.014063),
    (1238, 1.0000, 0.0048, 1.0185, 0.9818, 0.025232),
)
PAPER_TABLE2_AVERAGE = (1.0000, 0.0048, 1.0189, 0.9815, 0.024220)
PAPER_SETTING = {"vocab": 2048, "scale": 1.5, "tokens": 50_000}
PAPER_PRINT_HALF_ULP = 0.5e-4  # Table 2 prints 4 decimals
SIM_STATS = ("mean", "std", "max", "min")
SIM_CHUNK = 1000  # logit rows per step of the simulation's lax.map (memory only: results do not depend on it)

_FP16_MIN_NORMAL = 2.0**-14
_FP16_SUBNORMAL_STEP = 2.0**-24


def quantize(x: Float[Array, "*shape"], dtype: str) -> Float[Array, "*shape"]:
    """Q_dtype of OLH eq. 45: float32 `x` rounded to the nearest `dtype` value (ties to even), kept as float32.

    Equal, value for value, to `x.astype(dtype).astype(float32)` evaluated on its own (its test checks it
    against ml_dtypes' casts, fp16 subnormals included). It is not written as that round trip because
    inside a larger jitted program XLA:CPU does not keep it: with its default excess-precision rewriting the
    f32→bf16→f32 pair vanished (measured: the simulation below gave ρ std 0.0017 instead of 0.0048, and exactly
    1 with another chunk size), and `lax.optimization_barrier` around the cast did not help. `lax.reduce_precision`
    is the rounding op itself and is never removed; it flushes subnormals, so fp16's subnormal grid (2^-24
    below 2^-14, where probabilities of sampled tokens do fall) is rounded explicitly. bfloat16 subnormals
    (< 1.2e-38) are never reached here.
    """
    dt = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    if dt == jnp.float32:
        return x
    if dt == jnp.bfloat16:
        return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
    if dt == jnp.float16:
        normal = jax.lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10)
        subnormal = jnp.round(x * jnp.float32(1.0 / _FP16_SUBNORMAL_STEP)) * jnp.float32(_FP16_SUBNORMAL_STEP)
        return jnp.where(jnp.abs(x) < _FP16_MIN_NORMAL, subnormal, normal)
    raise ValueError(f"quantize: dtype must be one of {', '.join(precision.DTYPES)}, got {dtype!r}")


def low_precision_softmax(z: Float[Array, "*rows vocab"], dtype: str) -> Float[Array, "*rows vocab"]:
    """p̃ = Q(exp(Q(z_i)) / Σ_j exp(Q(z_j))) — OLH eq. 45: the logits and the output probabilities are
    rounded to `dtype`; the exponentials, their sum and the division stay in float32 (where eq. 45 puts no Q)."""
    return quantize(jax.nn.softmax(quantize(z, dtype), axis=-1), dtype)


def _sample_index(p: Float[Array, "*rows vocab"], u: Float[Array, " draws"]) -> Int[Array, " draws"]:
    """Inverse-CDF draws from the (renormalised) distribution p: the first index whose cumulative mass exceeds
    u · Σp; never an index of zero probability (the clamp guards u · Σp rounding up to Σp). p is one row for
    all draws (`[vocab]`) or one row per draw (`[draws, vocab]`)."""
    cdf = jnp.cumsum(p, axis=-1)
    vocab = p.shape[-1]
    last_positive = vocab - 1 - jnp.argmax(jnp.flip(p > 0, axis=-1), axis=-1)
    if p.ndim == 1:
        idx = jnp.searchsorted(cdf, u * cdf[-1], side="right")
    else:
        idx = jnp.sum((cdf <= (u * cdf[:, -1])[:, None]).astype(jnp.int32), axis=-1)
    return jnp.minimum(idx, last_positive).astype(jnp.int32)


def _kl_low_vs_ref(p_low: Float[Array, "*rows vocab"], z: Float[Array, "*rows vocab"]) -> Float[Array, "*rows"]:
    """KL(p̃/Σp̃ ‖ p) over the vocabulary, float32 (0·log 0 = 0), with log p = log_softmax(z): log(softmax(z))
    was −inf where p underflowed in float32 while p̃ > 0 (large scales), an infinite KL for a finite one. Clamped at
    0: a KL is never negative, and the two logs' float32 rounding made p̃ = p (a float32 "low" dtype) read −4e-8."""
    q = p_low / jnp.sum(p_low, axis=-1, keepdims=True)
    safe = jnp.where(q > 0, q, 1.0)
    kl = jnp.sum(jnp.where(q > 0, q * (jnp.log(safe) - jax.nn.log_softmax(z, axis=-1)), 0.0), axis=-1)
    return jnp.maximum(kl, 0.0)


@functools.partial(jax.jit, static_argnames=("vocab", "tokens", "dtype", "shared_logits"))
def simulate_softmax(seed: Int[Array, ""], scale: Float[Array, ""], *, vocab: int, tokens: int, dtype: str,
                     shared_logits: bool = False
                     ) -> tuple[Float[Array, " tokens"], Float[Array, " tokens"], Float[Array, " rows"]]:
    """OLH App. C.1: (p_fp32, p_low, KL per logit row) at `tokens` tokens sampled from the low-precision softmax.

    Procedure (App. C.1): logits z ~ N(0, scale²) over a virtual vocabulary of `vocab`, generated in float32;
    p = softmax(z) in float32 (eq. 44) and p̃ = `low_precision_softmax(z, dtype)` (eq. 45); a token index is
    sampled from p̃; both probabilities at that index are returned. By default every sampled token gets its own
    logit row (as every position of a generation has its own logits) — the reading that reproduces Table 2's
    max/min; `shared_logits=True` draws all tokens from one row (max/min then fall well inside Table 2's: see
    docs/analysis.md). Randomness: token t's logits use key fold_in(fold_in(key(seed), 0), t) and its uniform
    fold_in(fold_in(key(seed), 1), t), so token t's values depend only on (seed, t, settings) — not on chunking
    nor on how many tokens are drawn.
    """
    key = jax.random.key(seed)
    k_logits, k_u = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    t_all = jnp.arange(tokens, dtype=jnp.int32)
    u = jax.vmap(lambda t: jax.random.uniform(jax.random.fold_in(k_u, t), (), jnp.float32))(t_all)
    scale = jnp.asarray(scale, jnp.float32)

    def logits(t):
        return scale * jax.random.normal(jax.random.fold_in(k_logits, t), (vocab,), jnp.float32)

    if shared_logits:
        z = logits(0)
        p_ref, p_low = jax.nn.softmax(z, axis=-1), low_precision_softmax(z, dtype)
        idx = _sample_index(p_low, u)
        return p_ref[idx], p_low[idx], _kl_low_vs_ref(p_low, z)[None]

    chunk = min(SIM_CHUNK, tokens)
    n_chunks = -(-tokens // chunk)
    t_idx = jnp.arange(n_chunks * chunk, dtype=jnp.int32).reshape(n_chunks, chunk)
    u_pad = jnp.pad(u, (0, n_chunks * chunk - tokens)).reshape(n_chunks, chunk)

    def one_chunk(args):
        ts, us = args
        z = jax.vmap(logits)(ts)
        p_ref, p_low = jax.nn.softmax(z, axis=-1), low_precision_softmax(z, dtype)
        idx = _sample_index(p_low, us)
        take = lambda p: jnp.take_along_axis(p, idx[:, None], axis=-1)[:, 0]  # noqa: E731
        return take(p_ref), take(p_low), _kl_low_vs_ref(p_low, z)

    p_ref, p_low, kl = jax.lax.map(one_chunk, (t_idx, u_pad))
    return p_ref.reshape(-1)[:tokens], p_low.reshape(-1)[:tokens], kl.reshape(-1)[:tokens]


def ratio_stats(p_ref: np.ndarray, p_low: np.ndarray) -> dict[str, float]:
    """mean / std / max / min of the ratio p_fp32 / p_low at the sampled tokens (Table 2's columns), float64."""
    r = np.asarray(p_ref, np.float64) / np.asarray(p_low, np.float64)
    return {"mean": float(r.mean()), "std": float(r.std()), "max": float(r.max()), "min": float(r.min())}


def compare_with_paper(rows: Sequence[dict]) -> dict[str, dict]:
    """Per statistic: does our seed average fall within the spread between seeds of the paper's Table 2?

    Criterion: |ours − paper| (averages over seeds) ≤ the larger of the two between-seed ranges (max − min
    over seeds) + half a unit of Table 2's last printed digit. (The paper's std is 0.0048 at every seed, so
    for that column the bar is our own seed range + 0.00005.)
    """
    out = {}
    for k, stat in enumerate(SIM_STATS, start=1):
        ours = np.array([r[stat] for r in rows])
        paper = np.array([row[k] for row in PAPER_TABLE2])
        diff = float(ours.mean() - PAPER_TABLE2_AVERAGE[k - 1])
        tol = float(max(np.ptp(ours), np.ptp(paper)) + PAPER_PRINT_HALF_ULP)
        out[stat] = {"ours": float(ours.mean()), "paper": PAPER_TABLE2_AVERAGE[k - 1], "diff": diff,
                     "tolerance": tol, "within": bool(abs(diff) <= tol)}
    return out


def run_softmax_simulation(*, vocab: int, scale: float, tokens: int, seeds: Sequence[int], dtype: str = "bfloat16",
                           shared_logits: bool = False) -> dict:
    """Every seed's Table-2 statistics (+ our vocabulary KL, + the sampled probabilities for the figure)."""
    rows, samples = [], []
    for seed in seeds:
        t0 = time.perf_counter()
        p_ref, p_low, kl = jax.device_get(simulate_softmax(
            jnp.asarray(seed, jnp.uint32), jnp.float32(scale), vocab=vocab, tokens=tokens, dtype=dtype,
            shared_logits=shared_logits))
        rows.append({"seed": int(seed), **ratio_stats(p_ref, p_low), "kl_vocab_mean": float(np.mean(kl)),
                     "seconds": round(time.perf_counter() - t0, 3)})
        samples.append((np.asarray(p_ref), np.asarray(p_low)))
    setting = {"vocab": vocab, "scale": scale, "tokens": tokens, "dtype": dtype,
               "logits": "shared" if shared_logits else "per-token"}
    paper_setting = (dtype == "bfloat16" and not shared_logits
                     and {k: setting[k] for k in PAPER_SETTING} == PAPER_SETTING)
    return {"setting": setting, "seeds": rows, "samples": samples,
            "comparison": compare_with_paper(rows) if paper_setting else None}


def softmax_tables(result: dict) -> tuple[str, str]:
    """(plain-text table for the terminal, Markdown) of a `run_softmax_simulation` result beside Table 2."""
    s, rows, cmp_ = result["setting"], result["seeds"], result["comparison"]
    head = (f"{s['dtype']} softmax discretisation (objective-level hacking App. C.1, eq. 45): V={s['vocab']}, "
            f"z~N(0,{s['scale']}²), {s['tokens']} tokens per seed, logits {s['logits']}; ratio p_fp32/p_{s['dtype']} "
            "at tokens sampled from the low-precision softmax")
    cols = ("seed",) + SIM_STATS
    ours = [[str(r["seed"])] + [f"{r[c]:.4f}" for c in SIM_STATS] for r in rows]
    ours.append(["avg"] + [f"{np.mean([r[c] for r in rows]):.4f}" for c in SIM_STATS])
    paper = [[str(p[0])] + [f"{v:.4f}" for v in p[1:5]] for p in PAPER_TABLE2]
    paper.append(["avg"] + [f"{v:.4f}" for v in PAPER_TABLE2_AVERAGE[:4]])
    show_paper = cmp_ is not None
    w = max(8, *(len(r[0]) + 2 for r in ours + paper))  # a seed of 8+ digits ran into the next column
    fmt_row = lambda row: "".join(f"{v:<{w}}" for v in row)  # noqa: E731
    text = [head, "", fmt_row(cols) + ("| paper " + fmt_row(cols) if show_paper else "")]
    blank = [""] * len(cols)
    n = max(len(ours), len(paper)) - 1 if show_paper else len(ours) - 1  # seed rows; the avg rows line up
    left = ours[:-1] + [blank] * (n - len(ours) + 1) + ours[-1:]
    right = paper[:-1] + [blank] * (n - len(paper) + 1) + paper[-1:]
    for k, row in enumerate(left):
        text.append(fmt_row(row) + ("|" + " " * (len("| paper ") - 1) + fmt_row(right[k]) if show_paper else ""))
    md = [f"{head}.", "", "| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    md += [f"| ours | " + " | ".join(r) + " |" for r in ours]
    if show_paper:
        md += [f"| paper | " + " | ".join(r) + " |" for r in paper]
        verdict = "; ".join(
            f"{k} {'within' if v['within'] else 'OUTSIDE'} (|Δ| {abs(v['diff']):.5f} {'≤' if v['within'] else '>'} "
            f"{v['tolerance']:.5f})" for k, v in cmp_.items())
        text += ["", "vs the paper's Table 2 (seed averages; bar = larger between-seed range + 0.00005): " + verdict]
        md += ["", "Against the paper's Table 2 (seed averages; bar = larger between-seed range + 0.00005): "
               + verdict + "."]
    else:
        text += ["", "(not the paper's setting — bfloat16, V=2048, scale 1.5, 50000 per-token draws — so no "
                     "comparison with Table 2)"]
    kl = np.mean([r["kl_vocab_mean"] for r in rows])
    text.append(f"our KL(p̃ ‖ p) over the vocabulary, mean over logit rows: {kl:.3g} (the paper's KL column "
                "does not say which distributions it compares)")
    md += ["", f"Our KL(p̃ ‖ p) over the vocabulary (mean over logit rows): {kl:.3g}; the paper's KL column "
               "(0.014–0.047) does not say which distributions or binning it uses, so it is not compared."]
    return "\n".join(text), "\n".join(md) + "\n"


# -- command line ----------------------------------------------------------------------------------------------


def add_parser(sub) -> None:
    s = sub.add_parser("bf16-softmax",
                       help="objective-level hacking App. C.1: BF16 softmax discretisation vs its Table 2")
    s.add_argument("--vocab", type=int, default=PAPER_SETTING["vocab"])
    s.add_argument("--scale", type=float, default=PAPER_SETTING["scale"], help="std of the logits")
    s.add_argument("--tokens", type=int, default=PAPER_SETTING["tokens"], help="sampled tokens per seed")
    s.add_argument("--seeds", default="0,1,2,3,4")
    s.add_argument("--dtype", choices=precision.DTYPES, default="bfloat16", help="precision of the rounded softmax")
    s.add_argument("--logits", choices=("per-token", "shared"), default="per-token",
                   help="a fresh logit vector per sampled token (reproduces Table 2), or one per seed")
    s.add_argument("--out", required=True, help="new or empty output directory")
    s.add_argument("--force", action="store_true", help="replace an earlier `analyze bf16-softmax` output in --out")


def _check_args(a: argparse.Namespace) -> None:
    a.seeds = int_list("--seeds", a.seeds)
    if bad := [s for s in a.seeds if not 0 <= s < 2**31]:
        raise UsageError(f"--seeds: each seed must be in [0, 2^31), got {bad[0]}")
    if dup := [s for k, s in enumerate(a.seeds) if s in a.seeds[:k]]:
        raise UsageError(f"--seeds: seed {dup[0]} is listed twice (each seed is one row of the table and its average)")
    if a.vocab < 2:
        raise UsageError(f"--vocab must be >= 2, got {a.vocab}")
    if a.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {a.tokens}")
    if not (math.isfinite(a.scale) and a.scale > 0):
        raise UsageError(f"--scale must be a positive number, got {a.scale}")
    limit = max_scale(a.dtype)
    if a.scale > limit:
        raise UsageError(f"--scale {a.scale:g}: logits z ~ N(0, scale²) reach {LOGIT_SIGMAS:g}·scale, which overflows "
                         f"{a.dtype} (largest {float(jnp.finfo(a.dtype).max):.4g}) into inf/NaN; use --scale <= "
                         f"{limit:.4g} with --dtype {a.dtype}")
    for flag, value in (("--vocab", a.vocab), ("--tokens", a.tokens)):
        if value > INT32_MAX:
            raise UsageError(f"{flag} must be <= 2^31 - 1 (JAX indexes it with int32), got {value}")
    need, mem = simulation_bytes(a.vocab, a.tokens, a.logits == "shared"), physical_memory_bytes()
    if mem and need > mem // 2:
        flag = "--vocab" if a.vocab * 4 * ARRAYS_PER_ROW >= a.tokens * 4 * ARRAYS_PER_TOKEN else "--tokens"
        raise UsageError(f"{flag} {getattr(a, flag[2:])}: the simulation would hold about {need / 2**30:.3g} GiB "
                         f"(--vocab {a.vocab}, --tokens {a.tokens}), more than half of this machine's "
                         f"{mem / 2**30:.3g} GiB")


LOGIT_SIGMAS = 10.0  # |z| of a standard normal draw stays below this many σ (float32 draws: ≈ 6 at most)
ARRAYS_PER_ROW = 12  # float32 arrays of [chunk, vocab] alive in one simulation step (z, p, p̃, cdf, temporaries)
ARRAYS_PER_TOKEN = 8  # float32 arrays of [tokens] (u, the sampled probabilities, KL, the padding copies)


def max_scale(dtype: str) -> float:
    """The largest --scale whose logits (|z| < LOGIT_SIGMAS·scale) the rounding dtype and float32 both hold."""
    return float(min(jnp.finfo(dtype).max, jnp.finfo(jnp.float32).max)) / LOGIT_SIGMAS


def simulation_bytes(vocab: int, tokens: int, shared: bool) -> int:
    """A generous estimate of the simulation's peak memory in bytes (`simulate_softmax`)."""
    rows = 1 if shared else min(SIM_CHUNK, tokens)
    return 4 * (rows * vocab * ARRAYS_PER_ROW + tokens * ARRAYS_PER_TOKEN)


def run(a: argparse.Namespace) -> int:
    """The subcommand: simulate every seed, print the table beside Table 2, write JSON, Markdown and a figure —
    into a temporary sibling of --out renamed into place (`outputs.staged_dir`; --out checked before simulating)."""
    _check_args(a)
    with staged_dir("--out", a.out, KIND, force=a.force) as tmp:
        result = run_softmax_simulation(vocab=a.vocab, scale=a.scale, tokens=a.tokens, seeds=a.seeds, dtype=a.dtype,
                                        shared_logits=a.logits == "shared")
        text, md = softmax_tables(result)
        print(text, flush=True)
        write_json(os.path.join(tmp, "bf16_softmax.json"),
                   {"setting": result["setting"], "seeds": result["seeds"], "comparison": result["comparison"],
                    "paper_table2": {"source": "objective-level hacking paper, App. C.1, Table 2",
                                     "columns": ["seed", *SIM_STATS, "kl"], "rows": [list(r) for r in PAPER_TABLE2],
                                     "average": list(PAPER_TABLE2_AVERAGE)}})
        with open(os.path.join(tmp, "bf16_softmax.md"), "w") as f:
            f.write(md)
        from jaxrl_mismatch.report.analysis import plot_softmax_simulation

        plot_softmax_simulation(result["samples"], [r["seed"] for r in result["seeds"]], result["setting"],
                                os.path.join(tmp, "bf16_softmax.png"))
    print(f"analyze: wrote bf16_softmax.json, bf16_softmax.md, bf16_softmax.png in {a.out}", flush=True)
    return 0
