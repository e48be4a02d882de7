"""Diagnostic interventions for mismatch experiments: remove it, re-inject it, distort the objective.

* ``zero_mismatch`` — the VeXact setting (vexact-diagnosing-mismatch review): use the trainer's own
  ``π(θ_old)`` as the behaviour log-probs, ``μ := π(θ_old)``, so ρ ≡ 1 exactly and every correction is the
  identity; isolates training–inference mismatch from everything else.
* ``inject_mismatch`` — mismatch re-introduced at a controlled scale and seed (the review's requested
  "controlled re-introduction at varying scales"): ``log μ' = log μ + σ·ε``, ε ~ N(0, 1) per token, capped at
  0 so μ' stays a probability. Then ``log ρ`` shifts by ``−σ·ε``; ``std(log ρ)`` grows as σ.
* ``weight_distortion`` — φ of objective-hacking eq. 18: δ for tokens with ``π(θ_old) < π_low``, else 1.
* ``variance_weights`` — ξ ~ N(1, σ²) per token, objective-hacking eq. 21 (unbiased: E ξ = 1, eq. 22).
* ``surrogate_j`` — ``J = Σ_{i,t} Â_it (φ_it − 1)``, objective-hacking eq. 23 (a metric).

φ and ξ are passed to ``policy_loss(..., token_weight=…)``; all are returned under stop_gradient. ξ must be
drawn once for the whole batch (a deterministic function of (key, shape)), never per microbatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_mismatch.objectives._types import Scalar, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.ratios import as_bool_mask

sg = jax.lax.stop_gradient


def _key(seed_or_key) -> jax.Array:
    if isinstance(seed_or_key, int):
        return jax.random.key(seed_or_key)
    return seed_or_key


def zero_mismatch(old_logp: TokenFloat, rollout_logp: TokenFloat | None = None) -> TokenFloat:
    """VeXact zero-mismatch mode: the behaviour log-probs become ``π(θ_old)`` (ρ ≡ 1). ``rollout_logp`` is ignored."""
    del rollout_logp
    return sg(old_logp.astype(jnp.float32))


def inject_mismatch(rollout_logp: TokenFloat, mask: TokenMask, *, scale: float, seed: int | jax.Array) -> TokenFloat:
    """Controlled mismatch: ``log μ + scale·N(0, 1)`` on response tokens (capped at 0), padding unchanged."""
    m = as_bool_mask(mask)
    noise = jax.random.normal(_key(seed), rollout_logp.shape, jnp.float32)
    lp = rollout_logp.astype(jnp.float32)
    return sg(jnp.where(m, jnp.minimum(lp + scale * noise, 0.0), lp))


def weight_distortion(old_logp: TokenFloat, mask: TokenMask, *, delta: float, pi_low: float = 0.1) -> TokenFloat:
    """φ_t = δ if ``π(y_t|θ_old) < π_low`` else 1 (objective-hacking eq. 18); 0 on padding."""
    m = as_bool_mask(mask)
    lp = jnp.where(m, old_logp.astype(jnp.float32), 0.0)
    phi = jnp.where(jnp.exp(lp) < pi_low, jnp.float32(delta), 1.0)
    return sg(jnp.where(m, phi, 0.0))


def variance_weights(mask: TokenMask, *, sigma: float, seed: int | jax.Array) -> TokenFloat:
    """ξ_t ~ N(1, σ²) i.i.d. per token (objective-hacking eq. 21); 0 on padding."""
    m = as_bool_mask(mask)
    xi = 1.0 + sigma * jax.random.normal(_key(seed), m.shape, jnp.float32)
    return sg(jnp.where(m, xi, 0.0))


def surrogate_j(advantages: TokenFloat, phi: TokenFloat, mask: TokenMask) -> Scalar:
    """``J = Σ_{i,t} Â_it (φ_it − 1)`` over response tokens (objective-hacking eq. 23)."""
    m = as_bool_mask(mask)
    return jnp.sum(jnp.where(m, advantages.astype(jnp.float32) * (phi - 1.0), 0.0))
