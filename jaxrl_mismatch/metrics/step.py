"""Step metrics: everything that does not depend on θ, computed once per step on the whole step batch.

``step_metrics(old_logp, rollout_logp, mask, advantages, *, cfg)`` is called once per training step, jitted,
right after the θ_old forward, on *all* of the step's rows (before any minibatch split), so every value is a
statistic over all the step's tokens / sequences: ``mismatch/rho_std`` is the std of ρ over the step's tokens
(objective-hacking §2's "mismatch"), not a mean of per-minibatch stds, and ``diag/surrogate_j`` is OLH
eq. 23's sum over the step. Families: ``mismatch/*`` (π(θ_old) vs μ), ``correction/*`` (what the
objective's correction touches, with its bounds), ``length/*``, ``diag/*``. Names and formulas:
``docs/objectives.md``.

Conventions as in ``objectives/ratios.py``: ``ρ_t = π(y_t|θ_old)/μ(y_t|θ_old)`` from clamped log-differences
(±``LOG_RATIO_CLAMP``), so every value is finite for finite inputs; everything is masked (padding — along
T or whole padded rows — changes nothing). Means over tokens weight every response token equally; ``seq``
quantities average over sequences with at least one response token. Empty sets give the neutral value
(0 for spreads/fractions, 1 for ratio means), never NaN. A non-finite π(θ_old) on a response token makes every
``mismatch/*``, ``correction/*`` and ``diag/surrogate_j`` NaN for the step (``diag/nonfinite_logp_train``
counts such tokens).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_mismatch.metrics._masked import Masked, f32
from jaxrl_mismatch.metrics.config import MetricsConfig, as_metrics_config, bucket_names
from jaxrl_mismatch.objectives import ObjectiveConfig, applied_weights, batch_constants, surrogate_j, weight_distortion
from jaxrl_mismatch.objectives._types import Scalar, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.ratios import as_bool_mask, clamp_log_ratio, log_rho, masked_log_diff, seq_lengths


def _ess(sel: Masked, w) -> Scalar:
    """Normalised effective sample size ``(Σw)² / (n Σw²)`` ∈ (0, 1]; 1 when empty."""
    s1, s2 = sel.sum(w), sel.sum(w * w)
    return jnp.where(sel.nonempty & (s2 > 0), s1 * s1 / (jnp.maximum(sel.n, 1.0) * jnp.maximum(s2, 1e-30)), 1.0)


def _mismatch(old_logp: TokenFloat, rollout_logp: TokenFloat, m, cfg: MetricsConfig) -> dict[str, Scalar]:
    """``mismatch/*`` and ``correction/*`` fractions of π(θ_old) (``old_logp``) against μ (``rollout_logp``)."""
    tok = Masked(m)
    seq = Masked(jnp.any(m, axis=-1))
    length = jnp.maximum(seq_lengths(m), 1.0)
    lp_tr = jnp.where(m, old_logp.astype(jnp.float32), 0.0)
    lp_ro = jnp.where(m, rollout_logp.astype(jnp.float32), 0.0)
    lr = log_rho(lp_tr, lp_ro, m)
    r = jnp.exp(lr)

    # LR paper: log-ppl of a trajectory = −(1/|y|) Σ_t log p; diff = train − rollout = −mean_t log ρ_t. It is
    # never exponentiated, so it takes the unclamped log-ratios: a token past ±LOG_RATIO_CLAMP (the outlier the
    # LR paper's indicator is for) counts in full, and the diff is log ppl_train − log ppl_rollout.
    # Sequence ratios reduce the unclamped token log-ratios, as the objectives' sequence weights do (ratios.py):
    # a token beyond ±20 changes Π_t ρ_t; the clamp acts on the sequence value before exp.
    sum_lr = jnp.sum(masked_log_diff(lp_tr, lp_ro, m, clamp=False), axis=-1)
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
        # ρ² − 1 as expm1(2 log ρ): exact where ρ is within float32 rounding of 1 (an fp32 engine), where
        # r·r − 1 was off by ~1e-8 (10 % at a log-ratio spread of 1e-5).
        "mismatch/chi2_token": tok.mean(jnp.expm1(2.0 * lr)),
        "mismatch/chi2_seq": seq.mean(jnp.expm1(2.0 * seq_sum_lr)),
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
        b = Masked(in_b)
        out[f"mismatch/rho_mean_{suffix}"] = b.mean(r, empty=1.0)
        out[f"mismatch/token_frac_{suffix}"] = b.n / jnp.maximum(tok.n, 1.0)

    def outside(x):  # ρ outside the kept band [correction_low, correction_cap]
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
    return out


def step_metrics(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, advantages: TokenFloat, *,
                 cfg: MetricsConfig | ObjectiveConfig,
                 token_weight: TokenFloat | None = None) -> dict[str, Scalar]:
    """The θ-independent metrics of one training step, over all its tokens (names: ``step_metric_names``).

    Call once per step on the whole step batch (never per minibatch), jitted with ``cfg`` static.

    Args:
      old_logp: ``log π(y_t|θ_old)`` from the trainer's forward. rollout_logp: ``log μ(y_t|θ_old)``.
      mask: response mask. advantages: per-token advantages (for OLH eq. 23's ``diag/surrogate_j``).
      cfg: ``metrics_config(obj_cfg, …)`` (or the ``ObjectiveConfig``): every bound is the objective's.
      token_weight: the diagnostic per-token weight the loss applies (φ of OLH eq. 18 / ξ of eq. 21), if
        any; it enters ``correction/weight_mean`` and ``correction/zero_weight_frac`` like in the loss.

    ``correction/weight_mean`` and ``correction/zero_weight_frac`` describe the weight ``policy_loss``
    applies (``objectives.applied_weights``: correction × rejection [÷ global mean] × token weight); for the
    ``pg`` objective, whose weight uses π(θ)/μ, they are its value at θ = θ_old (the step's first update).
    M2PO's mask here is the whole step's cut; each update's loss cuts its own minibatch, and what it masked is
    the update statistic ``correction/m2po_masked_frac`` (the same with one minibatch per step).
    ``diag/surrogate_j`` is J = Σ_{i,t} Â_it (φ_it − 1) over the step (OLH eq. 23) with φ of eq. 18 at
    (``cfg.phi_delta``, ``cfg.phi_pi_low``) — the paper's monitor, independent of any injected distortion.
    """
    cfg = as_metrics_config(cfg)
    m = as_bool_mask(mask)
    out = _mismatch(old_logp, rollout_logp, m, cfg)
    tok = Masked(m)
    norm = batch_constants(cfg.objective, m, old_logp, rollout_logp)
    w = applied_weights(cfg.objective, old_logp, rollout_logp, m, global_weight_mean=norm.weight_mean,
                        token_weight=token_weight, m2_cut=norm.m2_cut)
    out["correction/weight_mean"] = tok.mean(w, empty=1.0)
    out["correction/zero_weight_frac"] = tok.frac(w == 0)
    seq = Masked(jnp.any(m, axis=-1))
    n = seq_lengths(m)
    out.update({"length/mean": seq.mean(n), "length/min": seq.min(n), "length/max": seq.max(n)})
    phi = weight_distortion(old_logp, m, delta=cfg.phi_delta, pi_low=cfg.phi_pi_low)
    out["diag/surrogate_j"] = surrogate_j(advantages, phi, m)
    # A non-finite π(θ_old) on a response token (an fp16 trainer that overflowed; μ is checked finite before it
    # arrives) is NaN in every ratio metric, never a believable number: compared with NaN, a bound or a bucket
    # is simply not hit, so the ESS, the Pearson and the fractions would come out finite. The count says why.
    bad = m & ~jnp.isfinite(old_logp)
    poisoned = jnp.any(bad)
    out = {k: jnp.where(poisoned, jnp.nan, v) if k.startswith(("mismatch/", "correction/", "diag/")) else v
           for k, v in out.items()}
    out["diag/nonfinite_logp_train"] = jnp.sum(bad)
    return {k: f32(v) for k, v in out.items()}


def step_metric_names(cfg: MetricsConfig | ObjectiveConfig = MetricsConfig()) -> list[str]:
    """The keys ``step_metrics`` returns, in order (stable; pinned by tests)."""
    cfg = as_metrics_config(cfg)
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
        "correction/seq_any_token_masked_frac", "correction/weight_mean", "correction/zero_weight_frac",
        "length/mean", "length/min", "length/max", "diag/surrogate_j", "diag/nonfinite_logp_train",
    ]
    return names
