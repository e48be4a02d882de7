"""Diagnostic interventions on the objective (objective-level-hacking paper).

Removing the training–inference mismatch and re-introducing it at a controlled scale (the VeXact review's
diagnostic) happen where the tokens are sampled, not here: the built-in engine's exact mode and its
sampling-logit noise (`rollout/exact_sampler.py`, `config.rollout.exact` / `rollout.logit_noise_std`).
Overwriting or perturbing only the recorded μ would leave the sampled tokens unchanged, i.e. train the
uncorrected estimator with the mismatch metrics forced to a chosen value.

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
