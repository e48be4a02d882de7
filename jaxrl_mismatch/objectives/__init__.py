"""Objectives: advantages, policy losses, mismatch corrections, aggregation, diagnostics (pure, jit-able).

The loop computes ``compute_advantages(cfg.advantages, rewards, group_ids, num_groups)`` (each preset names
its estimator); the train step calls, once per batch, ``norm = batch_constants(cfg, mask, old_logp, rollout_logp)``
and then, per microbatch, ``loss, aux = policy_loss(cfg, logp=…, old_logp=…, rollout_logp=…, advantages=…,
mask=…, norm=norm)``. Conventions (ρ, bounds, clamping) are stated once in ``ratios.py``. Option names → paper and
equation: ``docs/objectives.md``.
"""

from jaxrl_mismatch.objectives.advantages import (
    ADVANTAGES,
    compute_advantages,
    drgrpo_advantages,
    grpo_advantages,
    rloo_advantages,
    token_advantages,
)
from jaxrl_mismatch.objectives.aggregation import AGGREGATIONS, aggregate, global_normalizer, num_seqs, num_tokens
from jaxrl_mismatch.objectives.corrections import (
    IS_WEIGHTS,
    REJECTIONS,
    batch_normalize,
    icepop,
    is_weights,
    rejection_mask,
    seq_is,
    seq_mis,
    seq_tis,
    token_is,
    token_mis,
    token_tis,
    weight_mean,
)
from jaxrl_mismatch.objectives.decoupled import DECOUPLED_PRESETS, PROXIMALS, m2po_cut, m2po_mask, proximal_logp
from jaxrl_mismatch.objectives.diagnostics import (
    surrogate_j,
    variance_weights,
    weight_distortion,
)
from jaxrl_mismatch.objectives.losses import (
    LOSSES,
    gmpo_surrogate,
    gspo_surrogate,
    pg_surrogate,
    ppo_clip_surrogate,
    ref_kl_k3,
)
from jaxrl_mismatch.objectives.policy import (
    CLIP_KINDS,
    PRESETS,
    BatchConstants,
    ObjectiveConfig,
    applied_weights,
    clip_indicators,
    correction_weights,
    batch_constants,
    objective_config,
    policy_loss,
    weight_numerator,
)
from jaxrl_mismatch.objectives.ratios import (
    LOG_RATIO_CLAMP,
    SEQ_LEVELS,
    log_ratio_ppo,
    log_rho,
    rho,
    seq_log_ratio,
)

REGISTRY = {
    "advantages": tuple(ADVANTAGES),
    "loss": tuple(LOSSES),
    "correction": tuple(IS_WEIGHTS),
    "rejection": tuple(REJECTIONS),
    "agg": tuple(AGGREGATIONS),
    "preset": tuple(PRESETS),
}

__all__ = [
    "DECOUPLED_PRESETS", "PROXIMALS", "m2po_cut", "m2po_mask", "proximal_logp",
    "ADVANTAGES", "AGGREGATIONS", "CLIP_KINDS", "IS_WEIGHTS", "LOG_RATIO_CLAMP", "LOSSES", "PRESETS", "REGISTRY", "REJECTIONS",
    "SEQ_LEVELS", "BatchConstants", "ObjectiveConfig", "aggregate", "applied_weights", "weight_numerator", "clip_indicators", "batch_normalize", "compute_advantages",
    "correction_weights", "drgrpo_advantages", "global_normalizer", "gmpo_surrogate", "grpo_advantages",
    "gspo_surrogate", "icepop", "is_weights", "log_ratio_ppo", "log_rho", "batch_constants",
    "num_seqs", "num_tokens", "objective_config", "pg_surrogate", "policy_loss", "ppo_clip_surrogate",
    "ref_kl_k3", "rejection_mask", "rho", "rloo_advantages", "seq_is", "seq_log_ratio", "seq_mis", "seq_tis", "surrogate_j",
    "token_advantages", "token_is", "token_mis", "token_tis", "variance_weights", "weight_distortion",
    "weight_mean",
]
