"""Config-driven policy loss: objective type × mismatch correction × aggregation, one uniform entry point.

``policy_loss(cfg, logp=…, old_logp=…, rollout_logp=…, advantages=…, mask=…, norm=…) -> (loss, aux)``
computes ``loss = −aggregate(w · objective)`` with ``w = is_weight · rejection_mask [/ global mean]
[· token_weight]`` (all under stop_gradient). ``norm`` holds the *global* normalisers, computed once from the
whole batch by ``normalizers(cfg, mask, old_logp, rollout_logp)``; a microbatch's ``(loss, aux)`` is then its
exact additive share: summing over microbatches (or ``psum`` over devices) gives the full-batch loss,
gradient and aux values.

Which ρ the weight uses: the PPO-family objectives (``ppo``, ``gspo``, ``gmpo``) correct with
``ρ_t = π(θ_old)/μ(θ_old)`` (FP16 paper eqs. 9–10). The ``pg`` objective follows eqs. 5–7 literally and uses
``π(y|θ)/μ(y|θ_old)`` (detached); it equals ρ on the first step of an iteration, where θ = θ_old.
Batch normalisation always uses the global mean of the weights at θ_old.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_mismatch.objectives._types import Scalar, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.aggregation import AGGREGATIONS, aggregate, global_normalizer, num_tokens
from jaxrl_mismatch.objectives.corrections import (
    IS_WEIGHTS,
    REJECTIONS,
    batch_normalize,
    is_weights,
    rejection_mask,
    weight_mean,
)
from jaxrl_mismatch.objectives.losses import LOSSES
from jaxrl_mismatch.objectives.ratios import as_bool_mask, ratio_ppo

sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """One policy-loss recipe. Hashable, so it can be a static argument of ``jax.jit``."""

    loss: str = "ppo"                      # objective: ppo | gspo | gmpo | pg  (losses.py)
    correction: str = "none"               # IS weight: none | token_tis | seq_sum_mis | icepop | …  (corrections.py)
    correction_cap: float = 3.0            # C: upper bound on ρ for TIS/MIS (FP16 paper uses 3), IcePop's hi
    correction_low: float = 0.5            # IcePop's lower bound on ρ
    rejection: str = "none"                # rejection mask: none | <ratio|k2|k3>_<token|seq_sum|seq_mean|seq_max>
    rejection_low: float | None = None     # ratio rejection: keep ρ ≥ low (None: no lower bound)
    rejection_high: float | None = None    # ratio: keep ρ ≤ high; k2/k3: keep stat ≤ high
    normalize_weights: bool = False        # divide IS weights by their global mean over response tokens
    agg: str = "token-mean"                # token-mean | seq-mean-token-sum | seq-mean-token-mean | …-sum-norm
    max_len: int | None = None             # Dr.GRPO constant L for seq-mean-token-sum-norm
    eps_low: float = 0.2                   # PPO/GSPO lower clip range (r ≥ 1 − eps_low)
    eps_high: float = 0.2                  # PPO/GSPO upper clip range (DAPO clip-higher: 0.28)
    dual_clip: float | None = None         # dual-clip c (> 1) for A < 0, e.g. 3.0 or 10.0; None: off
    gmpo_eps: float = 0.4                  # GMPO log-space clip range

    def __post_init__(self):
        _check("loss", self.loss, LOSSES)
        _check("correction", self.correction, IS_WEIGHTS)
        _check("rejection", self.rejection, REJECTIONS)
        _check("agg", self.agg, AGGREGATIONS)
        if not self.correction_cap > 0:
            raise ValueError(f"correction_cap must be > 0, got {self.correction_cap!r}")
        if not 0 <= self.correction_low <= self.correction_cap:
            raise ValueError(f"correction_low must be in [0, correction_cap], got {self.correction_low!r}")
        if self.rejection.startswith("k") and self.rejection_low is not None:
            raise ValueError(f"rejection_low must be None for {self.rejection!r} (KL estimators are bounded above)")
        if self.rejection != "none" and self.rejection_low is None and self.rejection_high is None:
            raise ValueError(f"rejection {self.rejection!r} needs rejection_high and/or rejection_low")
        if self.agg == "seq-mean-token-sum-norm" and (self.max_len is None or self.max_len <= 0):
            raise ValueError("agg 'seq-mean-token-sum-norm' needs max_len (Dr.GRPO's constant L)")
        if not (0 < self.eps_low < 1 and self.eps_high > 0):
            raise ValueError(f"need 0 < eps_low < 1 and eps_high > 0, got {self.eps_low!r}, {self.eps_high!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip!r}")


def _check(field: str, value: str, valid) -> None:
    if value not in valid:
        raise ValueError(f"unknown {field} {value!r}; valid: {', '.join(valid)}")


# Named recipes from the papers; values per FP16 paper §4 / Table 3 unless noted.
PRESETS: dict[str, dict] = {
    "grpo": dict(loss="ppo"),                                                     # FP16 eq. 8
    "dapo": dict(loss="ppo", eps_high=0.28),                                      # clip-higher
    "drgrpo": dict(loss="ppo", agg="seq-mean-token-sum-norm"),                    # needs max_len
    "grpo_token_tis": dict(loss="ppo", eps_high=0.28, correction="token_tis"),    # FP16 eq. 9
    "grpo_seq_mis": dict(loss="ppo", eps_high=0.28, correction="seq_sum_mis"),    # FP16 eq. 10
    "icepop": dict(loss="ppo", eps_high=0.28, correction="icepop", correction_low=0.5, correction_cap=5.0),
    "gspo": dict(loss="gspo", eps_low=3e-4, eps_high=4e-4, agg="seq-mean-token-mean"),
    "gmpo": dict(loss="gmpo", gmpo_eps=0.4, agg="seq-mean-token-mean"),
    "pg": dict(loss="pg", agg="seq-mean-token-sum"),                              # FP16 eq. 3 (biased)
    "pg_seq_is": dict(loss="pg", correction="seq_sum_is", agg="seq-mean-token-sum"),    # FP16 eq. 5
    "pg_seq_tis": dict(loss="pg", correction="seq_sum_tis", agg="seq-mean-token-sum"),  # FP16 eq. 6
    "pg_seq_mis": dict(loss="pg", correction="seq_sum_mis", agg="seq-mean-token-sum"),  # FP16 eq. 7
}


def objective_config(preset: str = "grpo", **overrides) -> ObjectiveConfig:
    """A preset recipe (``PRESETS``) with field overrides; unknown presets/fields raise naming the valid ones."""
    if preset not in PRESETS:
        raise ValueError(f"unknown objective preset {preset!r}; valid: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ObjectiveConfig)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"unknown ObjectiveConfig field(s) {bad}; valid: {', '.join(sorted(fields))}")
    return ObjectiveConfig(**{**PRESETS[preset], **overrides})


class Normalizers(NamedTuple):
    """Whole-batch constants every microbatch needs (see ``normalizers``)."""

    loss: Scalar         # the aggregation normaliser of cfg.agg
    tokens: Scalar       # number of response tokens (for aux fractions)
    weight_mean: Scalar  # global mean IS weight at θ_old (1 unless cfg.normalize_weights)


def normalizers(cfg: ObjectiveConfig, mask: TokenMask, old_logp: TokenFloat | None = None,
                rollout_logp: TokenFloat | None = None) -> Normalizers:
    """Compute the global normalisers from the *whole* batch (call before splitting into microbatches)."""
    wm = jnp.float32(1.0)
    if cfg.normalize_weights:
        if old_logp is None or rollout_logp is None:
            raise ValueError("normalize_weights=True needs old_logp and rollout_logp of the whole batch")
        w = _raw_weights(cfg, old_logp, rollout_logp, mask)
        wm = weight_mean(w, mask)
    return Normalizers(loss=global_normalizer(mask, cfg.agg, max_len=cfg.max_len),
                       tokens=jnp.maximum(num_tokens(mask), 1.0), weight_mean=wm)


def _raw_weights(cfg: ObjectiveConfig, num_logp, rollout_logp, mask) -> TokenFloat:
    w = is_weights(cfg.correction, num_logp, rollout_logp, mask, cap=cfg.correction_cap, low=cfg.correction_low)
    if cfg.rejection != "none":
        w = w * rejection_mask(cfg.rejection, num_logp, rollout_logp, mask,
                               low=cfg.rejection_low, high=cfg.rejection_high)
    return w


def correction_weights(cfg: ObjectiveConfig, num_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask,
                       weight_mean_: Scalar | None = None) -> TokenFloat:
    """IS weight × rejection mask (÷ global mean if ``cfg.normalize_weights``), no gradient, 0 on padding."""
    w = _raw_weights(cfg, num_logp, rollout_logp, mask)
    if cfg.normalize_weights:
        if weight_mean_ is None:
            raise ValueError("normalize_weights=True needs the global weight mean (Normalizers.weight_mean)")
        w = batch_normalize(w, mask, weight_mean_)
    return sg(w)


def policy_loss(cfg: ObjectiveConfig | str, *, logp: TokenFloat, old_logp: TokenFloat, rollout_logp: TokenFloat,
                advantages: TokenFloat, mask: TokenMask, norm: Normalizers,
                token_weight: TokenFloat | None = None) -> tuple[Scalar, dict[str, Scalar]]:
    """The policy loss to minimise and its additive aux scalars.

    Args:
      cfg: an ``ObjectiveConfig`` or a preset name (``PRESETS``).
      logp: ``log π(y_t|θ)``, differentiable. old_logp: ``log π(y_t|θ_old)``. rollout_logp: ``log μ(y_t|θ_old)``.
      advantages: per-token advantages ``[B, T]`` (``token_advantages`` broadcasts per-sequence ones).
      mask: response mask. norm: ``normalizers(cfg, full_mask, …)`` of the whole batch.
      token_weight: optional extra per-token weight (diagnostics: φ of objective-hacking eq. 18, ξ of eq. 21).

    Aux (names stable; each is a microbatch's additive share of the full-batch value):
      ``loss/policy``, ``loss/clip_frac_low``, ``loss/clip_frac_high``, ``loss/dual_clip_frac``
      (fractions of response tokens), ``loss/weight_mean`` (mean applied weight), ``loss/zero_weight_frac``
      (tokens whose weight is 0: masked by MIS/IcePop/rejection), ``loss/ratio_mean`` (mean r_t).
    """
    if isinstance(cfg, str):
        cfg = objective_config(cfg)
    m = as_bool_mask(mask)
    if cfg.loss == "ppo":
        obj, ind = LOSSES["ppo"](logp, old_logp, advantages, m, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                 dual_clip=cfg.dual_clip)
    elif cfg.loss == "gspo":
        obj, ind = LOSSES["gspo"](logp, old_logp, advantages, m, eps_low=cfg.eps_low, eps_high=cfg.eps_high)
    elif cfg.loss == "gmpo":
        obj, ind = LOSSES["gmpo"](logp, old_logp, advantages, m, eps=cfg.gmpo_eps)
    else:
        obj, ind = LOSSES["pg"](logp, old_logp, advantages, m)
    num_logp = sg(logp) if cfg.loss == "pg" else old_logp
    w = correction_weights(cfg, num_logp, rollout_logp, m, norm.weight_mean)
    if token_weight is not None:
        w = w * sg(token_weight.astype(jnp.float32))
    loss = -aggregate(w * obj, m, cfg.agg, norm.loss)

    def frac(x):
        return jnp.sum(x).astype(jnp.float32) / norm.tokens

    aux = {
        "loss/policy": loss,
        "loss/clip_frac_low": frac(ind.get("clip_low", jnp.zeros_like(m))),
        "loss/clip_frac_high": frac(ind.get("clip_high", jnp.zeros_like(m))),
        "loss/dual_clip_frac": frac(ind.get("dual_clip", jnp.zeros_like(m))),
        "loss/weight_mean": jnp.sum(jnp.where(m, w, 0.0)) / norm.tokens,
        "loss/zero_weight_frac": frac(m & (w == 0)),
        "loss/ratio_mean": jnp.sum(jnp.where(m, sg(ratio_ppo(logp, old_logp, m)), 0.0)) / norm.tokens,
    }
    return loss, aux
