"""`jaxrl-mismatch analyze`: offline training–inference mismatch analysis.

Three subcommands (documented with measured tables in `docs/analysis.md`):

``analyze rollouts`` — the FP16 paper's §3.5 offline analysis (Fig. 2) and the objective-level hacking
paper's token-level views (Fig. 3: π_train vs π_infer with their PCC; Fig. 7: ρ by π probability range).
Rollouts are sampled through a real rollout server (`RolloutSession.launch`, the path the trainer uses) at
the engine precision; the trainer's scorer (`models.scoring`) scores the very same tokens at the trainer
precision (float32 master weights, computed in that precision: `precision.policy(p, param_dtype="float32")`,
as `train.Learner` builds it) and at the rollout temperature, so π and μ describe the same distribution.
Per (trainer, engine) pair it writes the per-token dump, a summary made by `metrics.step_metrics` itself,
and one figure for all pairs (report/analysis.py).

``analyze bf16-softmax`` — the objective-level hacking paper's App. C.1 simulation of BF16 softmax
discretisation (its eq. 45 and Table 2), next to the paper's numbers.

``analyze attribute`` — per-layer / per-op divergence of the engine's KV-cache path vs the trainer's forward and
the fp32 ablation matrix (`jobs/attribute.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxrl_mismatch import precision
from jaxrl_mismatch.metrics import MetricsConfig, bucket_names, step_metrics
from jaxrl_mismatch.models import ModelConfig, load_hf, make_scorer
from jaxrl_mismatch.objectives.ratios import LOG_RATIO_CLAMP
from jaxrl_mismatch.usage import ArgumentParser, UsageError, existing_dir, existing_file

PROG = "jaxrl-mismatch analyze"
ENGINE_DTYPES = ("float32", "bfloat16", "float16")
TRAINER_PRECISIONS = precision.PRESETS  # fp32, bf16, fp16

# ==========================================================================================================
# BF16 softmax discretisation (objective-level hacking paper, App. C.1)
# ==========================================================================================================

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

    Equal, value for value, to `x.astype(dtype).astype(float32)` evaluated on its own (tests/jobs/test_analyze.py
    checks it against ml_dtypes' casts, fp16 subnormals included). It is not written as that round trip because
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
    raise ValueError(f"quantize: dtype must be one of {', '.join(ENGINE_DTYPES)}, got {dtype!r}")


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


def _kl_low_vs_ref(p_low: Float[Array, "*rows vocab"], p_ref: Float[Array, "*rows vocab"]) -> Float[Array, "*rows"]:
    """KL(p̃/Σp̃ ‖ p) over the vocabulary, float32 (0·log 0 = 0)."""
    q = p_low / jnp.sum(p_low, axis=-1, keepdims=True)
    safe = jnp.where(q > 0, q, 1.0)
    return jnp.sum(jnp.where(q > 0, q * (jnp.log(safe) - jnp.log(p_ref)), 0.0), axis=-1)


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
        return p_ref[idx], p_low[idx], _kl_low_vs_ref(p_low, p_ref)[None]

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
        return take(p_ref), take(p_low), _kl_low_vs_ref(p_low, p_ref)

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
    w = 8
    fmt_row = lambda row: "".join(f"{v:<{w}}" for v in row)  # noqa: E731
    text = [head, "", fmt_row(cols) + ("| paper " + fmt_row(cols) if show_paper else "")]
    blank = [""] * len(cols)
    n = max(len(ours), len(paper)) - 1 if show_paper else len(ours) - 1  # seed rows; the avg rows line up
    left = ours[:-1] + [blank] * (n - len(ours) + 1) + ours[-1:]
    right = paper[:-1] + [blank] * (n - len(paper) + 1) + paper[-1:]
    for k, row in enumerate(left):
        text.append(fmt_row(row) + ("|       " + fmt_row(right[k]) if show_paper else ""))
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


# ==========================================================================================================
# Rollouts: sampled by the engine at one precision, scored by the trainer at another
# ==========================================================================================================

DUMP_FIELDS = ("prompt_id", "sample_id", "position", "token", "logp_train", "logp_rollout", "seq_len")


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """`fp32:float32,bf16:bfloat16` → [(trainer precision, engine dtype), ...]; UsageError naming --pairs."""
    pairs = []
    for item in (s.strip() for s in text.split(",")):
        trainer, sep, engine = item.partition(":")
        if not sep or trainer not in TRAINER_PRECISIONS or engine not in ENGINE_DTYPES:
            raise UsageError(f"--pairs: bad pair {item!r}; expected TRAINER:ENGINE with TRAINER in "
                             f"{{{','.join(TRAINER_PRECISIONS)}}} and ENGINE in {{{','.join(ENGINE_DTYPES)}}}, "
                             "e.g. fp32:float32,bf16:bfloat16,fp16:float16")
        if (trainer, engine) in pairs:
            raise UsageError(f"--pairs: {item} is listed twice")
        pairs.append((trainer, engine))
    return pairs


def pair_name(trainer: str, engine: str) -> str:
    return f"{trainer}:{engine}"


def score_rows(model_dir: str, trainer_precision: str, tokens: np.ndarray, attention_mask: np.ndarray, *,
               temperature: float, chunk_size: int = 256, fp32_lm_head: bool = False, block: int = 32) -> np.ndarray:
    """log π(tokens[:, t+1] | tokens[:, :t+1]) at temperature T, 0 where attention_mask[:, :-1] == 0: the
    checkpoint loaded as the trainer loads it (float32 master weights, compute in `trainer_precision`) and
    scored by the trainer's own scorer (`models.scoring.make_scorer`, the θ_old forward of `prepare`), softmax
    (logits / T) — the distribution an engine sampling at T reports (FP16 paper §3.5: "temperature 1.0 and no
    top-p … so that μ is directly comparable to π"). Rows go in fixed blocks of `block` (one compilation)."""
    pol = precision.policy(trainer_precision, fp32_lm_head=fp32_lm_head, param_dtype="float32")
    _, model = load_hf(model_dir, policy=pol)
    graphdef, state = nnx.split(model)
    score = make_scorer(graphdef, chunk_size=chunk_size, temperature=float(temperature))
    b, s = tokens.shape
    out = np.zeros((b, s - 1), np.float32)
    for start in range(0, b, block):
        ids = np.zeros((block, s), np.int32)
        mask = np.zeros((block, s), np.int32)
        mask[:, 0] = 1  # padding rows: one real token, so no row is empty
        k = min(block, b - start)
        ids[:k], mask[:k] = tokens[start:start + k], attention_mask[start:start + k]
        logp, _ = score(state, jnp.asarray(ids), jnp.asarray(mask))
        out[start:start + k] = np.asarray(logp)[:k]
    return out


def token_dump(response_mask: Float[np.ndarray, "batch seq"], targets: Int[np.ndarray, "batch seq"],
               logp_train: Float[np.ndarray, "batch seq"], logp_rollout: Float[np.ndarray, "batch seq"],
               prompt_id: Int[np.ndarray, " batch"], sample_id: Int[np.ndarray, " batch"]) -> dict[str, np.ndarray]:
    """Flat per-token arrays over the response tokens (`DUMP_FIELDS`); `position` counts from 0 within the
    response and `seq_len` is the response length of the token's sequence."""
    m = np.asarray(response_mask) > 0
    rows, cols = np.nonzero(m)
    position = (np.cumsum(m, axis=1) - 1)[rows, cols]
    return {
        "prompt_id": np.asarray(prompt_id, np.int32)[rows],
        "sample_id": np.asarray(sample_id, np.int32)[rows],
        "position": position.astype(np.int32),
        "token": np.asarray(targets, np.int32)[rows, cols],
        "logp_train": np.asarray(logp_train, np.float32)[rows, cols],
        "logp_rollout": np.asarray(logp_rollout, np.float32)[rows, cols],
        "seq_len": m.sum(axis=1).astype(np.int32)[rows],
    }


def response_arrays(dump: dict[str, np.ndarray]
                    ) -> tuple[Float[np.ndarray, "seqs length"], Float[np.ndarray, "seqs length"],
                               Float[np.ndarray, "seqs length"]]:
    """(logp_train, logp_rollout, mask) as `[sequences, longest response]`, responses left-aligned, one row per
    (prompt_id, sample_id) in sorted order — the layout `metrics.step_metrics` takes (padding is masked)."""
    keys = np.stack([dump["prompt_id"], dump["sample_id"]], axis=1)
    seqs, row = np.unique(keys, axis=0, return_inverse=True)
    row = row.reshape(-1)
    length = int(dump["position"].max()) + 1 if len(row) else 1
    shape = (max(len(seqs), 1), length)
    lp_tr, lp_ro, mask = np.zeros(shape, np.float32), np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    lp_tr[row, dump["position"]] = dump["logp_train"]
    lp_ro[row, dump["position"]] = dump["logp_rollout"]
    mask[row, dump["position"]] = 1.0
    return lp_tr, lp_ro, mask


_step_metrics = jax.jit(step_metrics, static_argnames=("cfg",))


def summarize(dump: dict[str, np.ndarray], cfg: MetricsConfig = MetricsConfig()) -> dict[str, float]:
    """`metrics.step_metrics` on the dump (advantages 0: no rewards here, so `diag/surrogate_j` is 0), plus
    `analysis/*`: max/mean |Δ log p|, ρ std per π bucket (OLH Fig. 7a's spread), the sequence log-ratio
    log π(y)/μ(y) = Σ_t log ρ_t (FP16 paper Fig. 2, right), token and sequence counts."""
    lp_tr, lp_ro, mask = response_arrays(dump)
    out = {k: float(v) for k, v in _step_metrics(jnp.asarray(lp_tr), jnp.asarray(lp_ro), jnp.asarray(mask),
                                                  jnp.zeros_like(jnp.asarray(mask)), cfg=cfg).items()}
    d = dump["logp_train"].astype(np.float64) - dump["logp_rollout"].astype(np.float64)
    out["analysis/tokens"] = float(d.size)
    out["analysis/sequences"] = float(lp_tr.shape[0])
    out["analysis/logp_abs_diff_max"] = float(np.max(np.abs(d))) if d.size else 0.0
    out["analysis/logp_abs_diff_mean"] = float(np.mean(np.abs(d))) if d.size else 0.0
    seq_lr = np.sum(np.clip(lp_tr.astype(np.float64) - lp_ro, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask, axis=1)
    out["analysis/seq_log_ratio_mean"] = float(seq_lr.mean())
    out["analysis/seq_log_ratio_std"] = float(seq_lr.std())
    out["analysis/seq_log_ratio_abs_max"] = float(np.max(np.abs(seq_lr)))
    p_tr = np.exp(dump["logp_train"].astype(np.float64))
    rho = np.exp(np.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    names = bucket_names(cfg)
    for k, (suffix, lo, hi) in enumerate(names):  # the bucket rule of step_metrics: last bucket closed
        sel = (p_tr >= lo) & ((p_tr <= hi) if k == len(names) - 1 else (p_tr < hi))
        out[f"analysis/rho_std_{suffix}"] = float(rho[sel].std()) if sel.any() else 0.0
    return out


def _seq_log_ratio(dump: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lp_tr, lp_ro, mask = response_arrays(dump)
    lr = np.sum(np.clip(lp_tr.astype(np.float64) - lp_ro, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask, axis=1)
    return mask.sum(axis=1), lr


# -- inputs --------------------------------------------------------------------------------------------------


def _read_prompt_ids(path: str, vocab_size: int, limit: int) -> list[list[int]]:
    """`--prompt-ids` JSONL: one prompt a line, a JSON list of token ids (or {"prompt_ids": [...]})."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"--prompt-ids {path}:{lineno}: not JSON ({e.msg})") from None
            ids = obj.get("prompt_ids") if isinstance(obj, dict) else obj
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)):
                raise UsageError(f"--prompt-ids {path}:{lineno}: expected a non-empty JSON list of token ids in "
                                 f"[0, {vocab_size})")
            prompts.append(ids)
            if len(prompts) == limit:
                break
    if not prompts:
        raise UsageError(f"--prompt-ids {path}: no prompts in the file")
    return prompts


def _task_prompts(a: argparse.Namespace) -> tuple[list[list[int]], tuple[int, ...], int]:
    """(prompt ids, stop ids, tokenizer vocab size) of `--num-prompts` prompts of `--task`, rendered through the
    task's template with the checkpoint's tokenizer (the path `perfectible` and the trainer take)."""
    from jaxrl_mismatch.data import TASKS, get_task
    from jaxrl_mismatch.data.batching import tokenize_prompts
    from jaxrl_mismatch.data.tokenizer import load_tokenizer

    if a.task not in TASKS:
        raise UsageError(f"--task {a.task}: unknown task; valid: {', '.join(sorted(TASKS))}")
    task = get_task(a.task)
    try:
        tok = load_tokenizer(a.model)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"--model {a.model}: {e} (a checkpoint without a tokenizer takes --prompt-ids)") from None
    if a.task == "arithmetic":
        spec = {}
        if os.path.exists(os.path.join(a.model, "task.json")):
            with open(os.path.join(a.model, "task.json")) as f:
                spec = json.load(f).get("spec", {})
        texts = [r["prompt_text"] for r in task.load(a.split, n=a.num_prompts, seed=a.seed, **spec)]
    else:
        from jaxrl_mismatch.jobs.perfectible import _file_records

        if not a.file:
            raise UsageError(f"--file: task {a.task!r} reads a local JSONL file; pass --file PATH")
        texts = [r["prompt_text"] for r in _file_records(a.task, existing_file("--file", a.file), a.num_prompts)[0]]
    if not texts:
        raise UsageError(f"--task {a.task}: no prompts")
    ids = tokenize_prompts(tok, texts, template=a.template or task.template)
    return ids, (tok.eos_id,), tok.vocab_size


def _default_max_tokens(model_dir: str) -> int:
    path = os.path.join(model_dir, "task.json")
    if os.path.exists(path):
        with open(path) as f:
            value = json.load(f).get("max_new_tokens")
        if isinstance(value, int) and value > 0:
            return value
    return 128


# -- the run ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PairResult:
    trainer: str
    engine: str
    dump: dict[str, np.ndarray]
    summary: dict[str, float]

    @property
    def name(self) -> str:
        return pair_name(self.trainer, self.engine)


TABLE_COLUMNS = (("log_ppl_abs_diff", "mismatch/log_ppl_abs_diff"), ("rho_std", "mismatch/rho_std"),
                 ("max_abs_dlogp", "analysis/logp_abs_diff_max"), ("pcc_pi_mu", "mismatch/prob_pearson"),
                 ("seq_log_ratio_abs_max", "analysis/seq_log_ratio_abs_max"))


def pairs_tables(results: Sequence[PairResult]) -> tuple[str, str]:
    """(terminal table, Markdown) of log_ppl_abs_diff, ρ std, max |Δ log p|, … per (trainer, engine) pair."""
    head = ["pair (trainer:engine)", "tokens"] + [c for c, _ in TABLE_COLUMNS]
    fmt = {"mismatch/prob_pearson": "{:.6f}"}
    rows = [[r.name, str(int(r.summary["analysis/tokens"]))]
            + [fmt.get(k, "{:.3g}").format(r.summary[k]) for _, k in TABLE_COLUMNS] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) + 2 for i, h in enumerate(head)]
    text = ["".join(h.ljust(w) for h, w in zip(head, widths))]
    text += ["".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(row) + " |" for row in rows]
    by_name = {r.name: r.summary for r in results}
    bf16, fp16 = by_name.get("bf16:bfloat16"), by_name.get("fp16:float16")
    if bf16 is not None and fp16 is not None:  # the FP16 paper's claim (§3.5, Fig. 2), measured
        ratios = ", ".join(f"{c} ×{bf16[k] / fp16[k]:.1f}" for c, k in TABLE_COLUMNS[:3] if fp16[k] > 0)
        line = f"bf16:bfloat16 over fp16:float16 — {ratios}"
        text.append(line)
        md += ["", line + "."]
    return "\n".join(text), "\n".join(md) + "\n"


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def run_rollouts(a: argparse.Namespace) -> list[PairResult]:
    """Sample once per engine dtype through a launched rollout server, score with every trainer precision
    paired with it, write each pair's `tokens.npz` + `summary.json`; results in the order of `a.pairs`."""
    from jaxrl_mismatch.data.batching import pad_rows
    from jaxrl_mismatch.rollout import SamplingSpec
    from jaxrl_mismatch.rollout.engine import check_finite_logprobs
    from jaxrl_mismatch.rollout.session import RolloutSession

    cfg = ModelConfig.from_hf(a.model)
    if a.prompt_ids:
        prompts = _read_prompt_ids(a.prompt_ids, cfg.vocab_size, a.num_prompts)
        stop_ids, tok_vocab = tuple(a.stop_ids), None
    else:
        prompts, stop_ids, tok_vocab = _task_prompts(a)
    longest = max(len(p) for p in prompts)
    limit = cfg.max_position_embeddings
    if limit is not None and longest + a.max_tokens > limit:
        raise UsageError(f"--max-tokens {a.max_tokens}: the longest prompt ({longest} tokens) + max_tokens exceeds "
                         f"the model's max_position_embeddings {limit}")
    spec = SamplingSpec(n=a.n, max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed,
                        stop_token_ids=tuple(stop_ids))
    prompt_id = np.repeat(np.arange(len(prompts)), a.n)
    sample_id = np.tile(np.arange(a.n), len(prompts))
    row_prompts = [prompts[i] for i in prompt_id]
    results: list[PairResult] = []
    for engine in dict.fromkeys(e for _, e in a.pairs):  # one server per engine dtype, in the order given
        t0 = time.perf_counter()
        print(f"analyze: sampling {len(prompts)} prompts × {a.n} (max {a.max_tokens} tokens, T={a.temperature}) "
              f"with the {a.engine} engine in {engine}", flush=True)
        with RolloutSession.launch(work_dir=os.path.join(a.out, f"server_{engine}"), engine=a.engine, model=a.model,
                                   dtype=engine) as session:
            session.check_compatible(architecture=cfg.architecture, vocab_size=cfg.vocab_size,
                                     tokenizer_vocab_size=tok_vocab)
            groups = session.generate(prompts, spec)
        check_finite_logprobs(groups)
        comps = [groups[i][j] for i, j in zip(prompt_id, sample_id)]
        rows = pad_rows(row_prompts, [c.token_ids for c in comps], [c.logprobs for c in comps], pad_id=0)
        t_sample = time.perf_counter() - t0
        for trainer in (t for t, e in a.pairs if e == engine):
            t1 = time.perf_counter()
            logp_train = score_rows(a.model, trainer, rows.tokens, rows.attention_mask, temperature=a.temperature,
                                    chunk_size=a.chunk_size, fp32_lm_head=a.fp32_lm_head) * rows.response_mask
            bad = (~np.isfinite(logp_train)) & (rows.response_mask > 0)
            if bad.any():
                raise RuntimeError(f"trainer {trainer} produced {int(bad.sum())} non-finite log-probs on the "
                                   f"{engine} rollouts (overflow in {trainer}?)")
            dump = token_dump(rows.response_mask, rows.tokens[:, 1:], logp_train, rows.rollout_logp,
                              prompt_id, sample_id)
            summary = summarize(dump)
            summary["analysis/sample_seconds"] = round(t_sample, 2)
            summary["analysis/score_seconds"] = round(time.perf_counter() - t1, 2)
            res = PairResult(trainer, engine, dump, summary)
            pair_dir = os.path.join(a.out, f"{trainer}-{engine}")
            os.makedirs(pair_dir, exist_ok=True)
            np.savez(os.path.join(pair_dir, "tokens.npz"), **dump)
            _write_json(os.path.join(pair_dir, "summary.json"), {"trainer": trainer, "engine": engine, **summary})
            print(f"analyze: {res.name}: {int(summary['analysis/tokens'])} tokens, log_ppl_abs_diff "
                  f"{summary['mismatch/log_ppl_abs_diff']:.3g}, ρ std {summary['mismatch/rho_std']:.3g}, "
                  f"max |Δlog p| {summary['analysis/logp_abs_diff_max']:.3g}", flush=True)
            results.append(res)
    order = {p: k for k, p in enumerate(a.pairs)}
    return sorted(results, key=lambda r: order[(r.trainer, r.engine)])


# -- command line ----------------------------------------------------------------------------------------------


def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise UsageError(f"{flag}: expected at least one integer")
    return values


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True, metavar="{rollouts,bf16-softmax,attribute}")

    r = sub.add_parser("rollouts", prog=f"{PROG} rollouts",
                       help="score engine rollouts with the trainer at chosen precisions (FP16 paper Fig. 2)")
    r.add_argument("--model", required=True, help="local HF checkpoint (config.json + safetensors [+ tokenizer])")
    r.add_argument("--task", default="arithmetic", help="prompt source (data.TASKS) read with the model's tokenizer")
    r.add_argument("--file", default=None, help="JSONL of a file-backed task")
    r.add_argument("--split", default="train", help="split of --task (default train)")
    r.add_argument("--template", default=None, help="prompt template (default: the task's)")
    r.add_argument("--prompt-ids", default=None,
                   help="JSONL of token-id prompts (one JSON list a line) instead of --task: no tokenizer needed")
    r.add_argument("--stop-ids", default="", help="with --prompt-ids: comma-separated stop token ids")
    r.add_argument("--engine", choices=("jax", "vllm"), default="jax")
    r.add_argument("--engine-dtype", default=None, help=f"one of {', '.join(ENGINE_DTYPES)} (default float32)")
    r.add_argument("--trainer-precision", default=None, help=f"one of {', '.join(TRAINER_PRECISIONS)} (default fp32)")
    r.add_argument("--pairs", default=None,
                   help="several TRAINER:ENGINE pairs, e.g. fp32:float32,bf16:bfloat16,fp16:float16 (instead of "
                        "--trainer-precision/--engine-dtype)")
    r.add_argument("--fp32-lm-head", action="store_true", help="trainer: LM head and softmax in float32")
    r.add_argument("--num-prompts", type=int, default=64)
    r.add_argument("--n", type=int, default=4, help="samples per prompt")
    r.add_argument("--max-tokens", type=int, default=None, help="response limit (default: task.json's, else 128)")
    r.add_argument("--temperature", type=float, default=1.0, help="> 0; the trainer scores π at the same T")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--chunk-size", type=int, default=256, help="trainer log-prob chunk (sequence positions)")
    r.add_argument("--axes", choices=("prob", "log"), default="prob", help="scatter axes: probabilities or log-probs")
    r.add_argument("--out", required=True, help="output directory")

    s = sub.add_parser("bf16-softmax", prog=f"{PROG} bf16-softmax",
                       help="objective-level hacking App. C.1: BF16 softmax discretisation vs its Table 2")
    s.add_argument("--vocab", type=int, default=PAPER_SETTING["vocab"])
    s.add_argument("--scale", type=float, default=PAPER_SETTING["scale"], help="std of the logits")
    s.add_argument("--tokens", type=int, default=PAPER_SETTING["tokens"], help="sampled tokens per seed")
    s.add_argument("--seeds", default="0,1,2,3,4")
    s.add_argument("--dtype", choices=ENGINE_DTYPES, default="bfloat16", help="precision of the rounded softmax")
    s.add_argument("--logits", choices=("per-token", "shared"), default="per-token",
                   help="a fresh logit vector per sampled token (reproduces Table 2), or one per seed")
    s.add_argument("--out", required=True, help="output directory")
    from jaxrl_mismatch.jobs import attribute

    attribute.add_parser(sub)
    return p


def _check_rollout_args(a) -> None:
    if a.pairs is not None:
        if a.engine_dtype is not None or a.trainer_precision is not None:
            raise UsageError("--pairs replaces --trainer-precision/--engine-dtype; give one or the other")
        a.pairs = parse_pairs(a.pairs)
    else:
        trainer, engine = a.trainer_precision or "fp32", a.engine_dtype or "float32"
        if trainer not in TRAINER_PRECISIONS:
            raise UsageError(f"--trainer-precision {trainer}: valid: {', '.join(TRAINER_PRECISIONS)}")
        if engine not in ENGINE_DTYPES:
            raise UsageError(f"--engine-dtype {engine}: valid: {', '.join(ENGINE_DTYPES)}")
        a.pairs = [(trainer, engine)]
    existing_dir("--model", a.model)
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        raise UsageError(f"--model {a.model}: no config.json; expected a Hugging Face checkpoint directory")
    if a.prompt_ids is not None:
        existing_file("--prompt-ids", a.prompt_ids)
    elif a.stop_ids:
        raise UsageError("--stop-ids goes with --prompt-ids (a --task stops at its tokenizer's EOS)")
    a.stop_ids = _int_list("--stop-ids", a.stop_ids) if a.stop_ids else []
    if a.max_tokens is None:
        a.max_tokens = _default_max_tokens(a.model)
    for flag, value in (("--num-prompts", a.num_prompts), ("--n", a.n), ("--max-tokens", a.max_tokens),
                        ("--chunk-size", a.chunk_size)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if not (math.isfinite(a.temperature) and a.temperature > 0):
        raise UsageError(f"--temperature must be > 0 (π and μ are compared as sampled distributions), got "
                         f"{a.temperature}")


def _check_softmax_args(a) -> None:
    a.seeds = _int_list("--seeds", a.seeds)
    if any(s < 0 or s >= 2**32 for s in a.seeds):
        raise UsageError(f"--seeds: each seed must be in [0, 2^32), got {a.seeds}")
    if a.vocab < 2:
        raise UsageError(f"--vocab must be >= 2, got {a.vocab}")
    if a.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {a.tokens}")
    if not (math.isfinite(a.scale) and a.scale > 0):
        raise UsageError(f"--scale must be a positive number, got {a.scale}")


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.what == "attribute":  # per-layer / per-op attribution (jobs/attribute.py)
        from jaxrl_mismatch.jobs import attribute

        return attribute.run(a)
    if a.what == "bf16-softmax":
        _check_softmax_args(a)
        os.makedirs(a.out, exist_ok=True)
        result = run_softmax_simulation(vocab=a.vocab, scale=a.scale, tokens=a.tokens, seeds=a.seeds, dtype=a.dtype,
                                        shared_logits=a.logits == "shared")
        text, md = softmax_tables(result)
        print(text, flush=True)
        _write_json(os.path.join(a.out, "bf16_softmax.json"),
                    {"setting": result["setting"], "seeds": result["seeds"], "comparison": result["comparison"],
                     "paper_table2": {"source": "objective-level hacking paper, App. C.1, Table 2",
                                      "columns": ["seed", *SIM_STATS, "kl"], "rows": [list(r) for r in PAPER_TABLE2],
                                      "average": list(PAPER_TABLE2_AVERAGE)}})
        with open(os.path.join(a.out, "bf16_softmax.md"), "w") as f:
            f.write(md)
        from jaxrl_mismatch.report.analysis import plot_softmax_simulation

        png = plot_softmax_simulation(result["samples"], [r["seed"] for r in result["seeds"]], result["setting"],
                                      os.path.join(a.out, "bf16_softmax.png"))
        print(f"analyze: wrote bf16_softmax.json, bf16_softmax.md, {os.path.basename(png)} in {a.out}", flush=True)
        return 0

    _check_rollout_args(a)
    os.makedirs(a.out, exist_ok=True)
    results = run_rollouts(a)
    text, md = pairs_tables(results)
    print(text, flush=True)
    settings = {k: getattr(a, k) for k in ("model", "task", "split", "prompt_ids", "engine", "num_prompts", "n",
                                            "max_tokens", "temperature", "seed", "fp32_lm_head")}
    _write_json(os.path.join(a.out, "summary.json"),
                {"settings": settings, "pairs": {r.name: r.summary for r in results}})
    with open(os.path.join(a.out, "pairs.md"), "w") as f:
        f.write(md)
    from jaxrl_mismatch.report.analysis import plot_pairs

    png = plot_pairs([(r.name, r.dump, r.summary, *_seq_log_ratio(r.dump)) for r in results],
                     [s for s, _, _ in bucket_names(MetricsConfig())], os.path.join(a.out, "analysis.png"),
                     axes=a.axes)
    print(f"analyze: wrote summary.json, pairs.md, {os.path.basename(png)} and <trainer>-<engine>/tokens.npz in "
          f"{a.out}", flush=True)
    return 0
