"""Log-space ratios: the single convention for ρ, r and their sequence-level forms.

Convention (pinned by ``tests/objectives/test_obj_corrections.py::test_convention_*``):

* ``ρ_t = π(y_t|θ_old) / μ(y_t|θ_old) = exp(old_logp − rollout_logp)`` — the mismatch ratio
  (objective-hacking eq. 5 / 25; FP16 paper eq. 9). ``ρ > 1`` ⇔ the trainer gives the sampled token more
  probability than the engine that sampled it (π > μ).
* ``r_t = π(y_t|θ) / π(y_t|θ_old) = exp(logp − old_logp)`` — the PPO ratio (FP16 paper eq. 8).
* Every bound acts on ρ itself, never on −log ρ: an upper bound C truncates, ``min(ρ, C)``, or masks,
  ``1{ρ ≤ C}``, exactly the tokens with π ≫ μ (FP16 eqs. 6–7); a lower bound acts on tokens with π ≪ μ.
  (verl's ``token_k1`` applies bounds to k1 = −log ρ, which swaps asymmetric bounds; we do not.)
* Two sequence-level reductions, named distinctly and both offered everywhere:
  ``seq_sum``  — ``log ρ(y) = Σ_t log ρ_t``: the product of token ratios, the unbiased sequence IS weight
  (FP16 eqs. 5, 10); it drifts far from 1 on long responses.
  ``seq_mean`` — ``(1/|y|) Σ_t log ρ_t``: the length-normalised geometric mean (GSPO, Geo-RS); stays O(1).

Numerical safety: every log-ratio is clamped to ±``LOG_RATIO_CLAMP`` (= 20, e^20 ≈ 4.9e8) before ``exp``, so
ratios and their squares (e^40 ≈ 2.4e17) stay finite in float32 for any finite inputs: a token ratio at the token
level, a sequence ratio after its reduction — which sums the *unclamped* token log-ratios (sequence IS weights,
GSPO's and GMPO's geometric means), since a token beyond ±20 changes Π_t ρ_t (+25 and −24 are ρ(y) = e, not 1).
Inside the clamp the values are exact; outside, the gradient of the clamped quantity is zero. Mostly a clip or a
truncation would zero it there anyway, but not for PPO's A < 0 branch without a dual clip, where r·A is
unclipped: there the clamp acts as a dual clip at r = e^20 (a gradient of ≈ 4.9e8·|A| per token would be a
blow-up in any case). GSPO and PG take their gradient through ``score`` (exp(logp − sg(logp)), unclamped), and
GMPO through exp(lr − sg(lr)), which keep it beyond the clamp (GMPO's token gradient is not scaled by r_t). The
rejection masks compare unclamped log-ratios (``corrections.rejection_mask``), so their bounds hold beyond e^±20.
Padding positions are replaced with 0 (log-ratio) by ``jnp.where`` before any arithmetic, so garbage,
huge or infinite values in padding never reach a loss or a metric.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_mismatch.objectives._types import SeqFloat, TokenFloat, TokenMask

LOG_RATIO_CLAMP = 20.0
SEQ_LEVELS = ("seq_sum", "seq_mean")


def as_bool_mask(mask: TokenMask) -> jax.Array:
    """Response mask as bool (accepts bool or 0/1 numbers)."""
    return mask if mask.dtype == jnp.bool_ else mask != 0


def clamp_log_ratio(x: jax.Array) -> jax.Array:
    """Clamp a log-ratio to ±LOG_RATIO_CLAMP (see module docstring)."""
    return jnp.clip(x, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_log_diff(logp_num: TokenFloat, logp_den: TokenFloat, mask: TokenMask, *, clamp: bool = True) -> TokenFloat:
    """Clamped ``logp_num − logp_den`` on response tokens, 0 on padding (float32). ``clamp=False`` for a
    value that is only compared, never exponentiated (the rejection masks' bounds)."""
    m = as_bool_mask(mask)
    num = jnp.where(m, logp_num.astype(jnp.float32), 0.0)
    den = jnp.where(m, logp_den.astype(jnp.float32), 0.0)
    return jnp.where(m, clamp_log_ratio(num - den) if clamp else num - den, 0.0)


def log_rho(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask) -> TokenFloat:
    """``log ρ_t = log π(y_t|θ_old) − log μ(y_t|θ_old)``, clamped; 0 on padding (objective-hacking eq. 25)."""
    return masked_log_diff(old_logp, rollout_logp, mask)


def rho(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask) -> TokenFloat:
    """Token mismatch ratio ``ρ_t = π(θ_old)/μ(θ_old)``; 1 on padding (objective-hacking eq. 5)."""
    return jnp.exp(log_rho(old_logp, rollout_logp, mask))


def log_ratio_ppo(logp: TokenFloat, old_logp: TokenFloat, mask: TokenMask) -> TokenFloat:
    """``log r_t = log π(y_t|θ) − log π(y_t|θ_old)``, clamped; 0 on padding (FP16 paper eq. 8)."""
    return masked_log_diff(logp, old_logp, mask)


def seq_lengths(mask: TokenMask) -> SeqFloat:
    """Number of response tokens of each sequence, float32 ``[B]``."""
    return jnp.sum(as_bool_mask(mask), axis=-1).astype(jnp.float32)


def seq_log_ratio(token_log_ratio: TokenFloat, mask: TokenMask, level: str) -> SeqFloat:
    """Sequence log-ratio from (already masked) token log-ratios, clamped.

    ``seq_sum``: ``Σ_t log ρ_t`` (log of the product of token ratios, FP16 eq. 5/10).
    ``seq_mean``: ``(1/|y|) Σ_t log ρ_t`` (geometric mean; GSPO eq. for s_i). Empty sequences give 0.
    """
    m = as_bool_mask(mask)
    total = jnp.sum(jnp.where(m, token_log_ratio, 0.0), axis=-1)
    if level == "seq_sum":
        return clamp_log_ratio(total)
    if level == "seq_mean":
        return clamp_log_ratio(total / jnp.maximum(seq_lengths(m), 1.0))
    raise ValueError(f"unknown sequence level {level!r}; valid: {', '.join(SEQ_LEVELS)}")


def broadcast_seq(x: SeqFloat, mask: TokenMask) -> TokenFloat:
    """Broadcast a per-sequence ``[B]`` value over the sequence's tokens ``[B, T]`` (explicitly)."""
    return jnp.broadcast_to(x[:, None], mask.shape)


def score(logp: TokenFloat, mask: TokenMask) -> TokenFloat:
    """``exp(logp − stop_gradient(logp))``: value 1, gradient ∇logp — the score-function (REINFORCE) factor.

    Lets a surrogate report a meaningful value (e.g. ``w · A``) while its gradient is ``w · A · ∇ log π``.
    Padding is zeroed first so a non-finite padded logp cannot poison the gradient.
    """
    lp = jnp.where(as_bool_mask(mask), logp.astype(jnp.float32), 0.0)
    return jnp.exp(lp - jax.lax.stop_gradient(lp))
