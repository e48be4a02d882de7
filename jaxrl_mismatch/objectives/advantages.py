"""Group-relative advantage estimators over sequence rewards.

Every response ``i`` carries a scalar reward ``R_i`` and a group id (the prompt it answers). Groups whose
rewards are all equal (zero variance, including groups of one) get advantage exactly 0 — decided by
comparing the group max with the group min, so rounding in the mean can never produce ``0/0`` or a
spurious ±1.

* ``grpo``   — ``(R_i − mean_g) / (std_g + eps)``, sample std (ddof = 1, as torch.std in TRL/verl)
  (Shao et al. 2024, GRPO; objective-hacking eq. 3, the Â of its eq. 24).
* ``drgrpo`` — ``R_i − mean_g`` (Dr.GRPO, Liu et al. 2025c: no std division) — the estimator of FP16 paper
  eqs. 8–10 (footnote 1: "We use the Dr.GRPO variant").
* ``rloo``   — ``R_i − mean_{j≠i} R_j = G/(G−1) · (R_i − mean_g)`` (leave-one-out baseline; FP16 paper
  eq. 8 writes A_t with this baseline — a constant multiple of ``drgrpo`` for a fixed group size G).

Each objective preset names its estimator (``ObjectiveConfig.advantages``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_mismatch.objectives._types import SeqFloat, SeqInt, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.ratios import as_bool_mask, broadcast_seq


def _group_stats(rewards: SeqFloat, group_ids: SeqInt, num_groups: int):
    r = rewards.astype(jnp.float32)
    group_count = jax.ops.segment_sum(jnp.ones_like(r), group_ids, num_segments=num_groups)
    count = group_count[group_ids]
    mean = (jax.ops.segment_sum(r, group_ids, num_segments=num_groups) / jnp.maximum(group_count, 1.0))[group_ids]
    gmax = jax.ops.segment_max(r, group_ids, num_segments=num_groups)[group_ids]
    gmin = jax.ops.segment_min(r, group_ids, num_segments=num_groups)[group_ids]
    constant = (gmax == gmin) | (count < 2)
    return r, count, mean, constant


def grpo_advantages(rewards: SeqFloat, group_ids: SeqInt, num_groups: int, *, eps: float = 1e-6) -> SeqFloat:
    """GRPO: ``(R_i − mean_g) / (std_g + eps)`` with the sample std (ddof = 1; OLH eq. 3); 0 for constant groups."""
    r, count, mean, constant = _group_stats(rewards, group_ids, num_groups)
    dev = r - mean
    var = jax.ops.segment_sum(dev * dev, group_ids, num_segments=num_groups)[group_ids] / jnp.maximum(count - 1.0, 1.0)
    adv = dev / (jnp.sqrt(var) + eps)
    return jnp.where(constant, 0.0, adv)


def drgrpo_advantages(rewards: SeqFloat, group_ids: SeqInt, num_groups: int) -> SeqFloat:
    """Dr.GRPO: ``R_i − mean_g`` (group mean only; FP16 paper eq. 8 + footnote 1); 0 for constant groups."""
    r, _, mean, constant = _group_stats(rewards, group_ids, num_groups)
    return jnp.where(constant, 0.0, r - mean)


def rloo_advantages(rewards: SeqFloat, group_ids: SeqInt, num_groups: int) -> SeqFloat:
    """RLOO: ``R_i − (1/(G−1)) Σ_{j≠i} R_j`` (FP16 paper eq. 8's A_t); 0 for constant groups and groups of one."""
    r, count, mean, constant = _group_stats(rewards, group_ids, num_groups)
    adv = count / jnp.maximum(count - 1.0, 1.0) * (r - mean)
    return jnp.where(constant, 0.0, adv)


ADVANTAGES: dict[str, Callable[..., jax.Array]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
}


def compute_advantages(name: str, rewards: SeqFloat, group_ids: SeqInt, num_groups: int, **kwargs) -> SeqFloat:
    """Advantage estimator by config name (``grpo`` | ``drgrpo`` | ``rloo``); ``num_groups`` must be static."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ADVANTAGES)}")
    return ADVANTAGES[name](rewards, group_ids, num_groups, **kwargs)


def token_advantages(seq_advantages: SeqFloat, mask: TokenMask) -> TokenFloat:
    """Broadcast per-sequence advantages to response tokens ``[B, T]`` (0 on padding)."""
    return jnp.where(as_bool_mask(mask), broadcast_seq(seq_advantages.astype(jnp.float32), mask), 0.0)
