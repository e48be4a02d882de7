"""Mismatch and health metrics, computed inside jit, returned as a flat dict of float32 scalars.

Every name is stable and documented (with its formula) in ``docs/objectives.md``; families:
``mismatch/*`` (π(θ_old) vs μ), ``correction/*`` (what a correction with the configured bounds would touch),
``ppo/*`` (needs ``logp`` and ``advantages``), ``policy/*`` (needs ``entropy``), ``length/*``, ``diag/*``
(needs ``advantages``). Conventions as in ``objectives/ratios.py``: ``ρ_t = π(y_t|θ_old)/μ(y_t|θ_old)``
from clamped log-differences (±20), so every value is finite for finite inputs; everything is masked
(padding — along T or whole padded rows — changes nothing). Means over tokens weight every response token
equally; ``seq`` quantities average over sequences with at least one response token. Empty sets give the
neutral value (0 for spreads/fractions, 1 for ratio means), never NaN.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_mismatch.objectives._types import Scalar, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.diagnostics import surrogate_j, weight_distortion
from jaxrl_mismatch.objectives.ratios import as_bool_mask, clamp_log_ratio, log_ratio_ppo, log_rho, seq_lengths


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Bounds the ``correction/*`` and ``ppo/*`` fractions are measured against (hashable: jit-static)."""

    tis_cap: float = 3.0                       # C: "truncated" = ρ > C (FP16 paper's C = 3)
    mask_low: float = 0.5                      # "masked" = ρ outside [mask_low, mask_high] (IcePop's [0.5, 5])
    mask_high: float = 5.0
    eps_low: float = 0.2                       # "clipped low" = A < 0 and r < 1 − eps_low
    eps_high: float = 0.28                     # "clipped high" = A > 0 and r > 1 + eps_high
    prob_buckets: tuple[float, ...] = (0.0, 0.1, 0.5, 0.9, 1.0)  # π(θ_old) bucket edges; last bucket closed
    phi_delta: float = 2.0                     # δ of objective-hacking eq. 18 for diag/surrogate_j (paper: 2)
    phi_pi_low: float = 0.1                    # π_low of eq. 18 (paper: 0.1)


def bucket_names(cfg: MetricsConfig) -> list[tuple[str, float, float]]:
    """``(suffix, lo, hi)`` of each probability bucket, e.g. ``("pi_0.1-0.5", 0.1, 0.5)``."""
    e = cfg.prob_buckets
    return [(f"pi_{lo:g}-{hi:g}", lo, hi) for lo, hi in zip(e[:-1], e[1:])]


def _f32(x) -> Scalar:
    return jnp.asarray(x, jnp.float32)


class _Masked:
    """Reductions over the selected entries of an array (tokens or sequences); empty → ``empty`` value."""

    def __init__(self, sel):
        self.sel = sel
        self.n = jnp.sum(sel).astype(jnp.float32)
        self.nonempty = self.n > 0

    def sum(self, x):
        return jnp.sum(jnp.where(self.sel, x, 0.0))

    def mean(self, x, empty=0.0):
        return jnp.where(self.nonempty, self.sum(x) / jnp.maximum(self.n, 1.0), empty)

    def std(self, x):
        mu = self.mean(x)
        return jnp.sqrt(jnp.maximum(self.mean(jnp.square(x - mu)), 0.0))

    def max(self, x, empty=0.0):
        return jnp.where(self.nonempty, jnp.max(jnp.where(self.sel, x, -jnp.inf)), empty)

    def min(self, x, empty=0.0):
        return jnp.where(self.nonempty, jnp.min(jnp.where(self.sel, x, jnp.inf)), empty)

    def frac(self, cond):
        return self.mean(cond.astype(jnp.float32))


def _ess(sel: _Masked, w) -> Scalar:
    """Normalised effective sample size ``(Σw)² / (n Σw²)`` ∈ (0, 1]; 1 when empty."""
    s1, s2 = sel.sum(w), sel.sum(w * w)
    return jnp.where(sel.nonempty & (s2 > 0), s1 * s1 / (jnp.maximum(sel.n, 1.0) * jnp.maximum(s2, 1e-30)), 1.0)


def mismatch_metrics(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, *,
                     cfg: MetricsConfig = MetricsConfig()) -> dict[str, Scalar]:
    """``mismatch/*`` and ``correction/*`` metrics of π(θ_old) (``old_logp``) against μ (``rollout_logp``)."""
    m = as_bool_mask(mask)
    tok = _Masked(m)
    valid_seq = jnp.any(m, axis=-1)
    seq = _Masked(valid_seq)
    length = jnp.maximum(seq_lengths(m), 1.0)
    lp_tr = jnp.where(m, old_logp.astype(jnp.float32), 0.0)
    lp_ro = jnp.where(m, rollout_logp.astype(jnp.float32), 0.0)
    lr = log_rho(lp_tr, lp_ro, m)
    r = jnp.exp(lr)

    # LR-schedule paper: log-ppl of a trajectory = −(1/|y|) Σ_t log p; diff = train − rollout = −mean_t log ρ_t.
    sum_lr = jnp.sum(lr, axis=-1)
    log_ppl_diff = -sum_lr / length
    log_ppl_tr = clamp_log_ratio(-jnp.sum(lp_tr, axis=-1) / length)
    log_ppl_ro = clamp_log_ratio(-jnp.sum(lp_ro, axis=-1) / length)
    seq_sum_lr = clamp_log_ratio(sum_lr)
    seq_mean_lr = clamp_log_ratio(sum_lr / length)
    r_seq = jnp.exp(seq_sum_lr)

    p_tr, p_ro = jnp.exp(lp_tr), jnp.exp(lp_ro)
    dp = jnp.abs(p_tr - p_ro)
    cov = tok.mean((p_tr - tok.mean(p_tr)) * (p_ro - tok.mean(p_ro)))
    var_prod = jnp.square(tok.std(p_tr)) * jnp.square(tok.std(p_ro))
    identical = tok.max(dp) == 0
    pearson = jnp.where(var_prod > 1e-20, cov / jnp.sqrt(jnp.maximum(var_prod, 1e-20)), jnp.where(identical, 1.0, 0.0))

    out = {
        "mismatch/log_ppl_diff": seq.mean(log_ppl_diff),
        "mismatch/log_ppl_abs_diff": seq.mean(jnp.abs(log_ppl_diff)),
        "mismatch/log_ppl_diff_max": seq.max(log_ppl_diff),
        "mismatch/log_ppl_diff_min": seq.min(log_ppl_diff),
        "mismatch/ppl_train": seq.mean(jnp.exp(log_ppl_tr), empty=1.0),
        "mismatch/ppl_rollout": seq.mean(jnp.exp(log_ppl_ro), empty=1.0),
        "mismatch/rho_mean": tok.mean(r, empty=1.0),
        "mismatch/rho_std": tok.std(r),
        "mismatch/rho_min": tok.min(r, empty=1.0),
        "mismatch/rho_max": tok.max(r, empty=1.0),
        "mismatch/ess_token": _ess(tok, r),
        "mismatch/ess_seq": _ess(seq, r_seq),
        "mismatch/chi2_token": tok.mean(r * r - 1.0),
        "mismatch/chi2_seq": seq.mean(r_seq * r_seq - 1.0),
        "mismatch/kl_k1": tok.mean(-lr),
        "mismatch/kl_k2": tok.mean(0.5 * lr * lr),
        "mismatch/kl_k3": tok.mean(jnp.expm1(lr) - lr),
        "mismatch/prob_abs_diff_max": tok.max(dp),
        "mismatch/prob_abs_diff_mean": tok.mean(dp),
        "mismatch/prob_abs_diff_std": tok.std(dp),
        "mismatch/prob_pearson": jnp.where(tok.nonempty, pearson, 1.0),
    }
    last = len(cfg.prob_buckets) - 2
    for k, (suffix, lo, hi) in enumerate(bucket_names(cfg)):
        in_b = m & (p_tr >= lo) & ((p_tr <= hi) if k == last else (p_tr < hi))
        b = _Masked(in_b)
        out[f"mismatch/rho_mean_{suffix}"] = b.mean(r, empty=1.0)
        out[f"mismatch/token_frac_{suffix}"] = b.n / jnp.maximum(tok.n, 1.0)

    def outside(x):  # ρ outside [mask_low, mask_high]
        return (x < cfg.mask_low) | (x > cfg.mask_high)

    out.update({
        "correction/token_truncated_frac": tok.frac(r > cfg.tis_cap),
        "correction/token_masked_frac": tok.frac(outside(r)),
        "correction/seq_sum_truncated_frac": seq.frac(r_seq > cfg.tis_cap),
        "correction/seq_sum_masked_frac": seq.frac(outside(r_seq)),
        "correction/seq_mean_truncated_frac": seq.frac(jnp.exp(seq_mean_lr) > cfg.tis_cap),
        "correction/seq_mean_masked_frac": seq.frac(outside(jnp.exp(seq_mean_lr))),
        "correction/seq_any_token_masked_frac": seq.frac(jnp.any(m & outside(r), axis=-1)),
    })
    return {k: _f32(v) for k, v in out.items()}


def ppo_metrics(logp: TokenFloat, old_logp: TokenFloat, advantages: TokenFloat, mask: TokenMask, *,
                cfg: MetricsConfig = MetricsConfig()) -> dict[str, Scalar]:
    """PPO clip fractions at token and sequence level and ratio stats for ``r_t = π(θ)/π(θ_old)``."""
    m = as_bool_mask(mask)
    tok, seq = _Masked(m), _Masked(jnp.any(m, axis=-1))
    r = jnp.exp(log_ratio_ppo(logp, old_logp, m))
    a = jnp.where(m, advantages.astype(jnp.float32), 0.0)
    low = m & (a < 0) & (r < 1.0 - cfg.eps_low)
    high = m & (a > 0) & (r > 1.0 + cfg.eps_high)
    out = {
        "ppo/clip_frac_low": tok.frac(low),
        "ppo/clip_frac_high": tok.frac(high),
        "ppo/seq_clip_frac_low": seq.frac(jnp.any(low, axis=-1)),
        "ppo/seq_clip_frac_high": seq.frac(jnp.any(high, axis=-1)),
        "ppo/ratio_mean": tok.mean(r, empty=1.0),
        "ppo/ratio_max": tok.max(r, empty=1.0),
        "ppo/ratio_min": tok.min(r, empty=1.0),
    }
    return {k: _f32(v) for k, v in out.items()}


def length_metrics(mask: TokenMask) -> dict[str, Scalar]:
    """Response length mean / min / max over sequences with at least one response token."""
    m = as_bool_mask(mask)
    seq = _Masked(jnp.any(m, axis=-1))
    n = seq_lengths(m)
    return {"length/mean": _f32(seq.mean(n)), "length/min": _f32(seq.min(n)), "length/max": _f32(seq.max(n))}


def compute_metrics(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, *,
                    logp: TokenFloat | None = None, advantages: TokenFloat | None = None,
                    entropy: TokenFloat | None = None, cfg: MetricsConfig = MetricsConfig()) -> dict[str, Scalar]:
    """All metrics as one flat dict of float32 scalars (names: ``metric_names``; formulas: docs/objectives.md).

    ``ppo/*`` needs ``logp`` and ``advantages``; ``policy/entropy`` needs ``entropy`` (per-token entropy of π,
    as ``models.token_logprobs`` returns it); ``diag/surrogate_j`` needs ``advantages``.
    """
    out = mismatch_metrics(old_logp, rollout_logp, mask, cfg=cfg)
    out.update(length_metrics(mask))
    if logp is not None and advantages is not None:
        out.update(ppo_metrics(logp, old_logp, advantages, mask, cfg=cfg))
    if entropy is not None:
        tok = _Masked(as_bool_mask(mask))
        out["policy/entropy"] = _f32(tok.mean(entropy.astype(jnp.float32)))
    if advantages is not None:
        phi = weight_distortion(old_logp, mask, delta=cfg.phi_delta, pi_low=cfg.phi_pi_low)
        out["diag/surrogate_j"] = _f32(surrogate_j(advantages, phi, mask))
    return out


def metric_names(cfg: MetricsConfig = MetricsConfig(), *, with_ppo: bool = True, with_entropy: bool = True,
                 with_advantages: bool = True) -> list[str]:
    """The keys ``compute_metrics`` returns for these inputs, in order (stable; pinned by tests)."""
    names = [
        "mismatch/log_ppl_diff", "mismatch/log_ppl_abs_diff", "mismatch/log_ppl_diff_max",
        "mismatch/log_ppl_diff_min", "mismatch/ppl_train", "mismatch/ppl_rollout", "mismatch/rho_mean",
        "mismatch/rho_std", "mismatch/rho_min", "mismatch/rho_max", "mismatch/ess_token", "mismatch/ess_seq",
        "mismatch/chi2_token", "mismatch/chi2_seq", "mismatch/kl_k1", "mismatch/kl_k2", "mismatch/kl_k3",
        "mismatch/prob_abs_diff_max", "mismatch/prob_abs_diff_mean", "mismatch/prob_abs_diff_std",
        "mismatch/prob_pearson",
    ]
    for suffix, _, _ in bucket_names(cfg):
        names += [f"mismatch/rho_mean_{suffix}", f"mismatch/token_frac_{suffix}"]
    names += [
        "correction/token_truncated_frac", "correction/token_masked_frac", "correction/seq_sum_truncated_frac",
        "correction/seq_sum_masked_frac", "correction/seq_mean_truncated_frac", "correction/seq_mean_masked_frac",
        "correction/seq_any_token_masked_frac", "length/mean", "length/min", "length/max",
    ]
    if with_ppo and with_advantages:
        names += ["ppo/clip_frac_low", "ppo/clip_frac_high", "ppo/seq_clip_frac_low", "ppo/seq_clip_frac_high",
                  "ppo/ratio_mean", "ppo/ratio_max", "ppo/ratio_min"]
    if with_entropy:
        names.append("policy/entropy")
    if with_advantages:
        names.append("diag/surrogate_j")
    return names
