"""Training–inference mismatch corrections: importance weights and rejection masks computed from ρ.

Convention (see ``ratios.py``): ``ρ_t = π(y_t|θ_old)/μ(y_t|θ_old)``; bounds act on ρ, so an upper cap C
touches the tokens (or sequences) with π ≫ μ. Every public function returns its weight / mask under
``jax.lax.stop_gradient``: a correction rescales the gradient, it is never differentiated. Weights are 0 on
padding, so ``weights == mask`` is the identity correction (what every function returns when μ = π and the
bounds contain 1).

IS weights (multiply each token's objective):

=================  ==========================================  =========================================
name               weight                                      source
=================  ==========================================  =========================================
``none``           1                                           uncorrected (FP16 eq. 3 / 8)
``token_is``       ρ_t                                         token IS
``token_tis``      min(ρ_t, C)                                 FP16 eqs. 6 and 9 (Yao et al. TIS)
``token_mis``      ρ_t · 1{ρ_t ≤ C}                            FP16 eq. 7, token level
``seq_sum_is``     ρ(y) = Π_t ρ_t                              FP16 eq. 5 (PG-seq-IS)
``seq_sum_tis``    min(ρ(y), C)                                FP16 eq. 6
``seq_sum_mis``    ρ(y) · 1{ρ(y) ≤ C}                          FP16 eqs. 7 and 10 (Liu et al. seq-MIS)
``seq_mean_*``     as ``seq_sum_*`` with ρ̄(y) = (Π_t ρ_t)^{1/|y|}   length-normalised (geometric-mean) variants
``icepop``         ρ_t · 1{lo ≤ ρ_t ≤ hi}                      IcePop (Ring-1T): two-sided token mask
=================  ==========================================  =========================================

Rejection masks (0/1, multiply the weights; verl's "rejection sampling"), ``<stat>_<level>``:
stat ``ratio`` keeps ``lo ≤ ρ ≤ hi``; stat ``k2`` (½ log²ρ) and ``k3`` (ρ − 1 − log ρ), both ≥ 0 estimators
of KL(μ‖π), keep ``stat ≤ hi``. Level ``token`` judges each token; ``seq_sum`` / ``seq_mean`` judge the
sequence by the sum / mean over its tokens (for ``ratio``: Π ρ_t and the geometric mean — Seq-MIS and Geo-RS);
``seq_max`` rejects the whole sequence if any token is rejected at token level.

Batch normalisation divides the weights by their mean over the response tokens of the *whole* batch
(``weight_mean``, computed once and passed in so microbatching does not change it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxrl_mismatch.objectives._types import Scalar, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.ratios import as_bool_mask, broadcast_seq, log_rho, masked_log_diff, seq_log_ratio

sg = jax.lax.stop_gradient


def _finish(w: jax.Array, mask: TokenMask) -> TokenFloat:
    return sg(jnp.where(as_bool_mask(mask), w, 0.0))


def _seq_rho(old_logp, rollout_logp, mask, level: str) -> jax.Array:
    """Sequence ratio (``seq_sum`` product or ``seq_mean`` geometric mean) broadcast to ``[B, T]``. The token
    log-ratios are summed unclamped (a token beyond ±20 would change Π_t ρ_t, FP16 eqs. 5, 10); the clamp acts on
    the sequence value, before ``exp``."""
    token = masked_log_diff(old_logp, rollout_logp, mask, clamp=False)
    return broadcast_seq(jnp.exp(seq_log_ratio(token, mask, level)), mask)


def no_correction(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, **_) -> TokenFloat:
    """Identity weights (1 on response tokens): the uncorrected estimator (FP16 paper eq. 3 / 8)."""
    return _finish(jnp.ones(mask.shape, jnp.float32), mask)


def token_is(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, **_) -> TokenFloat:
    """Untruncated token IS weight ``ρ_t``."""
    return _finish(jnp.exp(log_rho(old_logp, rollout_logp, mask)), mask)


def token_tis(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, *, cap: float, **_) -> TokenFloat:
    """Token TIS ``min(ρ_t, C)`` (FP16 paper eq. 9; eq. 6 at token level): truncates tokens with π ≫ μ."""
    return _finish(jnp.minimum(jnp.exp(log_rho(old_logp, rollout_logp, mask)), cap), mask)


def token_mis(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, *, cap: float, **_) -> TokenFloat:
    """Token MIS ``ρ_t · 1{ρ_t ≤ C}`` (FP16 paper eq. 7 at token level): drops tokens with ρ > C."""
    r = jnp.exp(log_rho(old_logp, rollout_logp, mask))
    return _finish(jnp.where(r <= cap, r, 0.0), mask)


def seq_is(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, *, level: str = "seq_sum",
           **_) -> TokenFloat:
    """Sequence IS weight ``ρ(y) = Π_t ρ_t`` (``seq_sum``; FP16 paper eq. 5) or its geometric mean (``seq_mean``)."""
    return _finish(_seq_rho(old_logp, rollout_logp, mask, level), mask)


def seq_tis(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, *, cap: float, level: str = "seq_sum",
            **_) -> TokenFloat:
    """Sequence TIS ``min(ρ(y), C)`` (FP16 paper eq. 6), ``level`` = ``seq_sum`` | ``seq_mean``."""
    return _finish(jnp.minimum(_seq_rho(old_logp, rollout_logp, mask, level), cap), mask)


def seq_mis(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, *, cap: float, level: str = "seq_sum",
            **_) -> TokenFloat:
    """Sequence MIS ``ρ(y) · 1{ρ(y) ≤ C}`` (FP16 paper eqs. 7 and 10), ``level`` = ``seq_sum`` | ``seq_mean``."""
    r = _seq_rho(old_logp, rollout_logp, mask, level)
    return _finish(jnp.where(r <= cap, r, 0.0), mask)


def icepop(old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, *, low: float, cap: float,
           **_) -> TokenFloat:
    """IcePop ``ρ_t · 1{lo ≤ ρ_t ≤ hi}`` (two-sided token mask; ``hi`` = ``cap``)."""
    r = jnp.exp(log_rho(old_logp, rollout_logp, mask))
    return _finish(jnp.where((r >= low) & (r <= cap), r, 0.0), mask)


IS_WEIGHTS: dict[str, Callable[..., jax.Array]] = {
    "none": no_correction,
    "token_is": token_is,
    "token_tis": token_tis,
    "token_mis": token_mis,
    "seq_sum_is": lambda *a, **k: seq_is(*a, **{**k, "level": "seq_sum"}),
    "seq_sum_tis": lambda *a, **k: seq_tis(*a, **{**k, "level": "seq_sum"}),
    "seq_sum_mis": lambda *a, **k: seq_mis(*a, **{**k, "level": "seq_sum"}),
    "seq_mean_is": lambda *a, **k: seq_is(*a, **{**k, "level": "seq_mean"}),
    "seq_mean_tis": lambda *a, **k: seq_tis(*a, **{**k, "level": "seq_mean"}),
    "seq_mean_mis": lambda *a, **k: seq_mis(*a, **{**k, "level": "seq_mean"}),
    "icepop": icepop,
}


def is_weights(name: str, old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, *,
               cap: float = 3.0, low: float = 0.5) -> TokenFloat:
    """IS weight by config name (table in the module docstring); ``cap`` = C (upper bound), ``low`` for IcePop."""
    if name not in IS_WEIGHTS:
        raise ValueError(f"unknown IS correction {name!r}; valid: {', '.join(IS_WEIGHTS)}")
    return IS_WEIGHTS[name](old_logp, rollout_logp, mask, cap=cap, low=low)


REJECTION_STATS = ("ratio", "k2", "k3")
REJECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
REJECTIONS = ("none",) + tuple(f"{s}_{lv}" for s in REJECTION_STATS for lv in REJECTION_LEVELS)


def rejection_mask(name: str, old_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, *,
                   low: float | None = None, high: float | None = None) -> TokenFloat:
    """Rejection ("masked") sampling mask in {0, 1}, 0 on padding; ``name`` = ``none`` or ``<stat>_<level>``.

    ``ratio``: keep ``low ≤ ρ ≤ high`` (defaults 0 and +inf); ``k2``/``k3``: keep ``stat ≤ high``
    (``low`` must be None). See the module docstring for the levels.
    """
    if name not in REJECTIONS:
        raise ValueError(f"unknown rejection mode {name!r}; valid: {', '.join(REJECTIONS)}")
    m = as_bool_mask(mask)
    if name == "none":
        return _finish(jnp.ones(mask.shape, jnp.float32), mask)
    stat, level = name.split("_", 1)
    # Unclamped: a comparison needs no exp, and the ±20 clamp of ratios.py would keep a ρ beyond e^±20
    # (a sequence's product of ratios reaches that) whatever bound was asked for.
    lr = masked_log_diff(old_logp, rollout_logp, m, clamp=False)
    if stat == "ratio":
        lo = -math.inf if low is None or low <= 0 else math.log(low)
        hi = math.inf if high is None else math.log(high)
        # Compare in log space: identical to lo ≤ ρ ≤ hi for any bounds, no exp needed.
        tok_val = lr
    else:
        if low is not None:
            raise ValueError(f"rejection {name!r} bounds a non-negative KL estimator from above only; "
                             f"got low={low!r}, pass rejection_low=None")
        lo, hi = -math.inf, (math.inf if high is None else high)
        tok_val = 0.5 * lr * lr if stat == "k2" else jnp.expm1(lr) - lr
    if level == "token":
        keep = (tok_val >= lo) & (tok_val <= hi)
    elif level == "seq_max":
        bad = m & ~((tok_val >= lo) & (tok_val <= hi))
        keep = broadcast_seq(~jnp.any(bad, axis=-1), m)
    else:  # log ρ(y) (Σ or mean of log ρ_t, unclamped) for ratio; the sum or mean of the token KL stat
        total = jnp.sum(jnp.where(m, tok_val, 0.0), axis=-1)
        s = total if level == "seq_sum" else total / jnp.maximum(jnp.sum(m, axis=-1), 1)
        keep = broadcast_seq((s >= lo) & (s <= hi), m)
    return _finish(keep.astype(jnp.float32), mask)


def weight_mean(weights: TokenFloat, mask: TokenMask) -> Scalar:
    """Mean weight over response tokens — call on the *whole* batch for ``batch_normalize``; 1 if empty."""
    m = as_bool_mask(mask)
    n = jnp.sum(m).astype(jnp.float32)
    mean = jnp.sum(jnp.where(m, weights, 0.0)) / jnp.maximum(n, 1.0)
    return sg(jnp.where(n > 0, mean, 1.0))


def batch_normalize(weights: TokenFloat, mask: TokenMask, mean: Scalar) -> TokenFloat:
    """Divide weights by the global mean weight (``weight_mean`` of the whole batch), so they average to 1."""
    safe = jnp.where(mean > 0, mean, 1.0)
    return _finish(weights / safe, mask)
