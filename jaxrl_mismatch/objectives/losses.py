"""Per-token policy objectives (to be *maximised*), before correction weights and aggregation.

Each function returns ``(objective [B, T], indicators)`` where ``indicators`` maps a name to a bool
``[B, T]`` array of tokens where a clip was active (exposed by ``policy.clip_indicators``). The loss is
``−aggregate(weight · objective)`` (see ``policy.py``). Sequence-level objectives (GSPO, GMPO) are written in
their token form — every token of sequence i carries the sequence value, and the gradient of the
``seq-mean-token-mean`` aggregate equals the gradient of the sequence objective exactly.

* ``ppo``  — ``min(r_t A_t, clip(r_t, 1−ε_low, 1+ε_high) A_t)``, decoupled ε (DAPO clip-higher), optional
  dual-clip ``max(·, c·A_t)`` for A_t < 0 (Ye et al. 2020). The clipped surrogate inside FP16 paper eqs. 8–10
  (which are Dr.GRPO; eqs. 9 / 10 add the token-TIS / seq-MIS weight) and OLH eq. 2.
* ``gspo`` — sequence ratio ``s_i = exp((1/|y_i|) Σ_t log r_t)`` clipped at [1−ε_low, 1+ε_high]
  (Zheng et al. 2025; objective-hacking eq. 16), GSPO-token form ``s_it = sg(s_i) · π_t/sg(π_t)``.
* ``gmpo`` — geometric-mean ratio: ``A_i · exp((1/|y_i|) Σ_t clip_A(log r_t))`` where the log-ratio is clipped
  to [−ε, ε] on the side that would increase ``A · log r`` (Zhao et al. 2025b, GMPO).
* ``pg``   — vanilla policy gradient ``A_t · π_t/sg(π_t)`` (value A_t, gradient A_t ∇log π_t); with the
  sequence IS weight ``π(y|θ)/μ(y|θ_old)`` it is PG-seq-IS (FP16 paper eq. 5) and TIS/MIS (eqs. 6–7).

``ref_kl_k3`` is the per-token KL penalty towards a reference policy (k3 estimator, GRPO eq. 4).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_mismatch.objectives._types import TokenFloat, TokenMask
from jaxrl_mismatch.objectives.ratios import (
    as_bool_mask,
    broadcast_seq,
    log_ratio_ppo,
    masked_log_diff,
    score,
    seq_log_ratio,
)

sg = jax.lax.stop_gradient
Surrogate = tuple[TokenFloat, dict[str, jax.Array]]


def _adv(advantages: TokenFloat, mask: TokenMask) -> TokenFloat:
    return jnp.where(as_bool_mask(mask), advantages.astype(jnp.float32), 0.0)


def ppo_clip_surrogate(logp: TokenFloat, old_logp: TokenFloat, advantages: TokenFloat, mask: TokenMask, *,
                       eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None) -> Surrogate:
    """Token PPO-clip objective with decoupled ε and optional dual-clip c (FP16 paper eq. 8's surrogate; DAPO).

    Indicators: ``clip_low`` (A<0 and r<1−ε_low: the clipped branch is taken, gradient 0), ``clip_high``
    (A>0 and r>1+ε_high), ``dual_clip`` (A<0 and r>c: bounded at c·A, gradient 0).
    """
    m = as_bool_mask(mask)
    a = _adv(advantages, m)
    r = jnp.exp(log_ratio_ppo(logp, old_logp, m))
    obj = jnp.minimum(r * a, jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high) * a)
    ind = {"clip_low": m & (a < 0) & (r < 1.0 - eps_low), "clip_high": m & (a > 0) & (r > 1.0 + eps_high)}
    if dual_clip is not None:
        obj = jnp.where(a < 0, jnp.maximum(obj, dual_clip * a), obj)
        ind["dual_clip"] = m & (a < 0) & (r > dual_clip)
    return obj, ind


def gspo_surrogate(logp: TokenFloat, old_logp: TokenFloat, advantages: TokenFloat, mask: TokenMask, *,
                   eps_low: float = 3e-4, eps_high: float = 4e-4) -> Surrogate:
    """GSPO(-token) objective with the length-normalised sequence ratio (objective-hacking eq. 16)."""
    m = as_bool_mask(mask)
    a = _adv(advantages, m)
    # the geometric mean of the unclamped token ratios; the clamp acts on the mean (ratios.py)
    log_s = broadcast_seq(seq_log_ratio(masked_log_diff(logp, old_logp, m, clamp=False), m, "seq_mean"), m)
    s_tok = jnp.exp(sg(log_s)) * score(logp, m)
    obj = jnp.minimum(s_tok * a, jnp.clip(s_tok, 1.0 - eps_low, 1.0 + eps_high) * a)
    s = jnp.exp(log_s)
    ind = {"clip_low": m & (a < 0) & (s < 1.0 - eps_low), "clip_high": m & (a > 0) & (s > 1.0 + eps_high)}
    return obj, ind


def gmpo_surrogate(logp: TokenFloat, old_logp: TokenFloat, advantages: TokenFloat, mask: TokenMask, *,
                   eps: float = 0.4) -> Surrogate:
    """GMPO objective: ``A · geometric mean of token ratios``, token log-ratios clipped to [−ε, ε] (GMPO eq. 1)."""
    m = as_bool_mask(mask)
    a = _adv(advantages, m)
    # Unclamped: GMPO's pessimistic side is not clipped and its gradient (A·g·∇log r_t / |y|) is not scaled by
    # r_t, so a clamp at ±20 would drop a token's gradient; only the sequence mean is clamped before exp.
    lr = masked_log_diff(logp, old_logp, m, clamp=False)
    sgn = jnp.sign(a)
    # min over (unclipped, clipped) of sgn·log r, i.e. PPO's pessimistic choice applied in log space.
    lr_c = sgn * jnp.minimum(sgn * lr, sgn * jnp.clip(lr, -eps, eps))
    log_g = broadcast_seq(seq_log_ratio(jnp.where(m, lr_c, 0.0), m, "seq_mean"), m)
    obj = a * jnp.exp(sg(log_g)) * jnp.exp(lr_c - sg(lr_c))
    ind = {"clip_low": m & (a < 0) & (lr < -eps), "clip_high": m & (a > 0) & (lr > eps)}
    return obj, ind


def pg_surrogate(logp: TokenFloat, old_logp: TokenFloat, advantages: TokenFloat, mask: TokenMask) -> Surrogate:
    """Vanilla PG surrogate ``A_t · π_t/sg(π_t)``: value A_t, gradient ``A_t ∇log π_t`` (FP16 paper eqs. 3, 5)."""
    del old_logp
    m = as_bool_mask(mask)
    return _adv(advantages, m) * score(logp, m), {}


def ref_kl_k3(logp: TokenFloat, ref_logp: TokenFloat, mask: TokenMask) -> TokenFloat:
    """Per-token k3 estimate of KL(π‖π_ref): ``exp(q) − q − 1``, ``q = log π_ref − log π`` (GRPO eq. 4, Schulman's k3).

    ``q`` is a clamped, masked log-difference (``ratios.LOG_RATIO_CLAMP``), so padding (even non-finite) gives
    exactly 0 and the value stays finite; ≥ 0 everywhere. Differentiable in ``logp``. The clamp is two-sided, as
    verl's ``low_var_kl`` (which also caps the value at 10): a token whose π exceeds π_ref by more than e^20 (a
    reference log-prob of −inf included) gives 19 and no gradient, so the penalty holds no token past 20 nats.
    """
    q = masked_log_diff(ref_logp, logp, mask)
    return jnp.where(as_bool_mask(mask), jnp.expm1(q) - q, 0.0)


LOSSES: dict[str, Callable[..., Surrogate]] = {
    "ppo": ppo_clip_surrogate,
    "gspo": gspo_surrogate,
    "gmpo": gmpo_surrogate,
    "pg": pg_surrogate,
}
