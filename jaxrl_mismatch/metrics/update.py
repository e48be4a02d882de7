"""Update statistics: the θ-dependent metrics (``ppo/*``, ``policy/entropy``) as sufficient statistics.

``update_stats(logp, old_logp, advantages, mask, *, cfg, entropy=None)`` runs inside the jitted update on
whatever rows that update sees and returns ``<how>:<name>`` scalars (the convention of
``metrics/accumulator.py``): counts and sums for fractions and means, max/min for extremes. Summing them
over microbatches (``combine_stats``, inside jit) and over minibatches / PPO epochs (``StatsAccumulator``,
on the host) gives exactly the statistic over all the step's tokens, whatever the split.

Clip fractions are measured where the loss clips — ``objectives.clip_indicators`` with the objective's own
bounds: the token ratio r_t for PPO (FP16 eq. 8's surrogate; DAPO's decoupled ε), the sequence ratio
s_i = exp(mean_t log r_t) for GSPO (OLH eq. 16), the token log-ratio against ±ε for GMPO.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from jaxrl_mismatch.metrics._masked import Masked, f32
from jaxrl_mismatch.metrics.accumulator import split_key
from jaxrl_mismatch.metrics.config import MetricsConfig, as_metrics_config
from jaxrl_mismatch.objectives import ObjectiveConfig, clip_indicators
from jaxrl_mismatch.objectives._types import Scalar, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.ratios import as_bool_mask, log_ratio_ppo

_CLIPS = (("clip_frac_low", "clip_low"), ("clip_frac_high", "clip_high"), ("dual_clip_frac", "dual_clip"))


def update_stats(logp: TokenFloat, old_logp: TokenFloat, advantages: TokenFloat, mask: TokenMask, *,
                 cfg: MetricsConfig | ObjectiveConfig, entropy: TokenFloat | None = None) -> dict[str, Scalar]:
    """Sufficient statistics of the θ-dependent metrics of one update (names after combining: ``update_metric_names``).

    Args:
      logp: ``log π(y_t|θ)`` of this update's rows (no gradient is taken). old_logp: ``log π(y_t|θ_old)``.
      advantages: per-token advantages. mask: response mask.
      cfg: ``metrics_config(obj_cfg)`` or the ``ObjectiveConfig``: the loss type and its bounds.
      entropy: per-token entropy of π (``models.token_logprobs``), for ``policy/entropy``.

    Returned (float32 scalars; r_t = π(θ)/π(θ_old), FP16 eq. 8):
      ``num:/den:ppo/clip_frac_low|high`` — tokens where the objective's clip is active (A < 0 below /
      A > 0 above its bound; for GSPO every token of a clipped sequence) / response tokens;
      ``num:/den:ppo/dual_clip_frac`` — tokens held at the dual-clip bound c·A (A < 0, r > c) / tokens;
      ``num:/den:ppo/seq_clip_frac_low|high`` — sequences with a clipped token / sequences;
      ``num:/den:ppo/ratio_mean``, ``max:ppo/ratio_max``, ``min:ppo/ratio_min`` — token r_t;
      ``num:/den:policy/entropy`` — Σ H / tokens (only with ``entropy``).
    """
    cfg = as_metrics_config(cfg)
    m = as_bool_mask(mask)
    logp = jax.lax.stop_gradient(logp)
    tok = Masked(m)
    valid_seq = jnp.any(m, axis=-1)
    seq = Masked(valid_seq)
    ind = clip_indicators(cfg.objective, logp, old_logp, advantages, m)
    r = jnp.exp(log_ratio_ppo(logp, old_logp, m))
    out: dict[str, Scalar] = {}

    def mean(name: str, num, den) -> None:
        out[f"num:{name}"], out[f"den:{name}"] = num, den

    for metric, kind in _CLIPS:
        mean(f"ppo/{metric}", tok.count(ind[kind]), tok.n)
    for metric, kind in _CLIPS[:2]:
        mean(f"ppo/seq_{metric}", seq.count(jnp.any(m & ind[kind], axis=-1)), seq.n)
    mean("ppo/ratio_mean", tok.sum(r), tok.n)
    out["max:ppo/ratio_max"] = tok.max_or_identity(r)
    out["min:ppo/ratio_min"] = tok.min_or_identity(r)
    if entropy is not None:
        mean("policy/entropy", tok.sum(entropy.astype(jnp.float32)), tok.n)
    return {k: f32(v) for k, v in out.items()}


def update_metric_names(*, with_entropy: bool = True) -> list[str]:
    """The metric names ``StatsAccumulator.result()`` gives for ``update_stats`` outputs, in order (stable)."""
    names = ["ppo/clip_frac_low", "ppo/clip_frac_high", "ppo/dual_clip_frac", "ppo/seq_clip_frac_low",
             "ppo/seq_clip_frac_high", "ppo/ratio_mean", "ppo/ratio_max", "ppo/ratio_min"]
    return names + (["policy/entropy"] if with_entropy else [])


def combine_stats(a: Mapping[str, jax.Array], b: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Combine two ``<how>:<name>`` dicts inside jit (e.g. over the microbatches of one update).

    ``sum``/``num``/``den`` add, ``max``/``min`` take the extreme, ``last`` takes ``b``; a key present in one
    dict only is kept. ``mean`` keys are per-update values and are refused here (combine them on the host).
    """
    for key in (*a, *b):
        if split_key(key)[0] == "mean":
            raise ValueError(f"{key!r}: 'mean:' statistics are per-update values; combine them with StatsAccumulator")
    out = dict(a)
    for key, value in b.items():
        how, _ = split_key(key)
        if key not in out:
            out[key] = value
        elif how in ("sum", "num", "den"):
            out[key] = out[key] + value
        elif how == "max":
            out[key] = jnp.maximum(out[key], value)
        elif how == "min":
            out[key] = jnp.minimum(out[key], value)
        else:  # last
            out[key] = value
    return out
