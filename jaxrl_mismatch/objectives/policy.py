"""Config-driven policy loss: advantages × objective type × mismatch correction × aggregation, one entry point.

``policy_loss(cfg, logp=…, old_logp=…, rollout_logp=…, advantages=…, mask=…, norm=…) -> (loss, aux)``
computes ``loss = −aggregate(w · objective)`` with ``w = is_weight · rejection_mask [/ global mean]
[· token_weight]`` (all under stop_gradient). ``norm`` holds the *global* normalisers, computed once from the
whole batch by ``batch_constants(cfg, mask, old_logp, rollout_logp)``; a microbatch's ``(loss, aux)`` is then its
exact additive share: summing over microbatches (or ``psum`` over devices) gives the full-batch loss,
gradient and aux values. ``cfg.advantages`` names the estimator the recipe's advantages come from
(``compute_advantages(cfg.advantages, …)``, computed by the caller before the loss).

``clip_indicators(cfg, …)`` returns the tokens where the configured objective's clip is active, on the
ratio that objective clips (token r for PPO, the sequence ratio for GSPO, log r for GMPO) — the one
source of the ``ppo/clip_frac_*`` metrics.

Which ρ the weight uses: the PPO-family objectives (``ppo``, ``gspo``, ``gmpo``) correct with
``ρ_t = π(θ_old)/μ(θ_old)`` (FP16 paper eqs. 9–10). The ``pg`` objective follows eqs. 5–7 literally and uses
``π(y|θ)/μ(y|θ_old)`` (detached); it equals ρ on the first step of an iteration, where θ = θ_old.
Batch normalisation always uses the global mean of the weights at θ_old.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from jaxrl_mismatch.objectives._types import Scalar, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.advantages import ADVANTAGES
from jaxrl_mismatch.objectives.aggregation import AGGREGATIONS, aggregate, global_normalizer, num_tokens
from jaxrl_mismatch.objectives.corrections import (
    IS_WEIGHTS,
    REJECTIONS,
    batch_normalize,
    is_weights,
    rejection_mask,
    weight_mean,
)
from jaxrl_mismatch.objectives.decoupled import DECOUPLED_PRESETS, PROXIMALS, m2po_cut, m2po_mask, proximal_logp
from jaxrl_mismatch.objectives.losses import LOSSES
from jaxrl_mismatch.objectives.ratios import as_bool_mask

sg = jax.lax.stop_gradient


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """One policy-loss recipe. Hashable, so it can be a static argument of ``jax.jit``."""

    advantages: str = "grpo"               # estimator: grpo (std-normalised) | drgrpo | rloo  (advantages.py)
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
    proximal: str = "recompute"            # π_prox: recompute (θ_old forward) | bypass (μ; decoupled.py)
    m2po_threshold: float | None = None    # M2PO τ_M2: mask the largest (log ρ)² until their mean ≤ τ; None: off

    def __post_init__(self):
        _check("advantages", self.advantages, ADVANTAGES)
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
        if self.rejection != "none" and self.rejection_high is not None and not self.rejection_high > 0:
            # a bound on ρ (> 0) or on a KL estimator (≥ 0, and ≤ 0 would keep only tokens where π = μ exactly)
            raise ValueError(f"rejection_high must be > 0 for {self.rejection!r}, got {self.rejection_high!r}")
        if self.rejection_low is not None and not self.rejection_low >= 0:
            raise ValueError(f"rejection_low must be >= 0 (a bound on ρ), got {self.rejection_low!r}")
        if (self.rejection_low is not None and self.rejection_high is not None
                and self.rejection_low > self.rejection_high):
            raise ValueError(f"rejection_low {self.rejection_low!r} > rejection_high {self.rejection_high!r}: every "
                             "token would be rejected")
        if self.agg == "seq-mean-token-sum-norm" and (self.max_len is None or self.max_len <= 0):
            raise ValueError("agg 'seq-mean-token-sum-norm' needs max_len (Dr.GRPO's constant L)")
        if not (0 < self.eps_low < 1 and self.eps_high > 0):
            raise ValueError(f"need 0 < eps_low < 1 and eps_high > 0, got {self.eps_low!r}, {self.eps_high!r}")
        if not (isinstance(self.gmpo_eps, (int, float)) and math.isfinite(self.gmpo_eps) and self.gmpo_eps > 0):
            # ≤ 0 puts every positive-advantage token outside the log-space clip: no gradient from good answers
            raise ValueError(f"gmpo_eps must be a finite number > 0, got {self.gmpo_eps!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip!r}")
        if self.dual_clip is not None and self.loss != "ppo":
            raise ValueError(f"dual_clip is PPO's (a bound on r·A for A < 0); loss {self.loss!r} has none, "
                             "so it would be ignored: set dual_clip=None or loss='ppo'")
        _check("proximal", self.proximal, PROXIMALS)
        if self.m2po_threshold is not None and not self.m2po_threshold > 0:
            raise ValueError(f"m2po_threshold must be > 0 or None, got {self.m2po_threshold!r}")
        if self.proximal == "bypass" and self.loss != "pg":
            # The PPO family's weights, rejections and M2PO's cut act on ρ = π_prox/μ, which bypass makes 1
            inert = [f for f, on in (("correction", self.correction != "none"), ("rejection", self.rejection != "none"),
                                     ("normalize_weights", self.normalize_weights),
                                     ("m2po_threshold", self.m2po_threshold is not None)) if on]
            if inert:
                raise ValueError(f"{inert[0]} acts on ρ = π_prox/μ, which proximal='bypass' makes 1 for loss "
                                 f"{self.loss!r}: it would do nothing; use proximal='recompute' (the decoupled "
                                 "objective) or leave it out")
        if self.proximal == "bypass" and self.loss == "pg" and (self.normalize_weights or self.m2po_threshold):
            # pg's weight is π(θ)/μ; its batch mean and M2PO's cut are taken at θ_old, which bypass never scores
            # (with μ standing in, every ratio would be 1: no normalisation, and a cut of 0 masking every token)
            which = "normalize_weights" if self.normalize_weights else "m2po_threshold"
            raise ValueError(f"{which} needs π(θ_old) for loss 'pg', which proximal='bypass' skips: "
                             "use proximal='recompute'")


def _check(field: str, value: str, valid) -> None:
    if value not in valid:
        raise ValueError(f"unknown {field} {value!r}; valid: {', '.join(valid)}")


# Named recipes. Every preset names its advantage estimator. FP16 paper eqs. 8–10 are Dr.GRPO (footnote 1:
# "We use the Dr.GRPO variant"): a mean baseline without std division (eq. 8 writes the leave-one-out mean,
# = G/(G−1) × the Dr.GRPO advantage; `advantages="rloo"` for that literal form) and a per-sequence token
# *sum* with a constant normaliser (App. A.1: verl's corrected "seq-mean-token-sum-norm"); the FP16 runs
# use clip-higher 0.28 and C = 3 for the GRPO family (§4.1). Only the `drgrpo*` presets are those
# equations; the `grpo*` ones are std-normalised, token-mean recipes that borrow the eq. 9 / 10 *weight*.
PRESETS: dict[str, dict] = {
    # GRPO advantages (Shao et al. 2024; OLH eq. 3) with DAPO's token-mean aggregation, symmetric ε = 0.2.
    "grpo": dict(advantages="grpo", loss="ppo"),
    # DAPO (Yu et al. 2025): the same with clip-higher ε_high = 0.28.
    "dapo": dict(advantages="grpo", loss="ppo", eps_high=0.28),
    # FP16 eq. 8 + footnote 1: Dr.GRPO (Liu et al. 2025c), clip-higher 0.28 as the paper ran the GRPO family (§4.1)
    # and as its eq. 9 / 10 arms below, so baseline vs correction changes the correction only. Needs max_len.
    "drgrpo": dict(advantages="drgrpo", loss="ppo", eps_high=0.28, agg="seq-mean-token-sum-norm"),
    # FP16 eq. 9: Dr.GRPO with token TIS min(ρ_t, C) (Yao et al.), clip-higher 0.28, C = 3 (§4.1). Needs max_len.
    "drgrpo_token_tis": dict(advantages="drgrpo", loss="ppo", eps_high=0.28, correction="token_tis",
                             agg="seq-mean-token-sum-norm"),
    # FP16 eq. 10: Dr.GRPO with sequence MIS ρ(y)·1{ρ(y) ≤ C} (Liu et al.), clip-higher 0.28, C = 3. Needs max_len.
    "drgrpo_seq_mis": dict(advantages="drgrpo", loss="ppo", eps_high=0.28, correction="seq_sum_mis",
                           agg="seq-mean-token-sum-norm"),
    # DAPO-style GRPO (std-normalised, token-mean, 0.28) with the token-TIS weight of FP16 eq. 9 (Yao et al.).
    "grpo_token_tis": dict(advantages="grpo", loss="ppo", eps_high=0.28, correction="token_tis"),
    # DAPO-style GRPO with the sequence-MIS weight of FP16 eq. 10 (Liu et al.).
    "grpo_seq_mis": dict(advantages="grpo", loss="ppo", eps_high=0.28, correction="seq_sum_mis"),
    # IcePop (Ring-1T): two-sided token mask [0.5, 5] on DAPO-style GRPO.
    "icepop": dict(advantages="grpo", loss="ppo", eps_high=0.28, correction="icepop", correction_low=0.5,
                   correction_cap=5.0),
    # GSPO (Zheng et al. 2025; OLH eq. 16): sequence-ratio clipping, ε = (3e-4, 4e-4), per-sequence token mean.
    "gspo": dict(advantages="grpo", loss="gspo", eps_low=3e-4, eps_high=4e-4, agg="seq-mean-token-mean"),
    # GMPO (Zhao et al. 2025b): geometric-mean ratio, log-space clip ε = 0.4.
    "gmpo": dict(advantages="grpo", loss="gmpo", gmpo_eps=0.4, agg="seq-mean-token-mean"),
    # Vanilla PG, FP16 eq. 3 (biased under mismatch), and its sequence IS / TIS / MIS corrections, eqs. 5 / 6 / 7.
    # The equations leave the baseline B(x) open; these use GRPO's std-normalised group advantage.
    "pg": dict(advantages="grpo", loss="pg", agg="seq-mean-token-sum"),
    "pg_seq_is": dict(advantages="grpo", loss="pg", correction="seq_sum_is", agg="seq-mean-token-sum"),
    "pg_seq_tis": dict(advantages="grpo", loss="pg", correction="seq_sum_tis", agg="seq-mean-token-sum"),
    "pg_seq_mis": dict(advantages="grpo", loss="pg", correction="seq_sum_mis", agg="seq-mean-token-sum"),
    # Stale (asynchronous) data: naive PPO, AReaL's decoupled PPO, + TIS, + M2PO (objectives/decoupled.py).
    **DECOUPLED_PRESETS,
}


def objective_config(preset: str = "grpo", **overrides) -> ObjectiveConfig:
    """A preset recipe (``PRESETS``) with field overrides; unknown presets/fields raise naming the valid ones."""
    if preset not in PRESETS:
        raise ValueError(f"unknown objective preset {preset!r}; valid: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ObjectiveConfig)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ValueError(f"unknown ObjectiveConfig field(s) {bad}; valid: {', '.join(sorted(fields))}")
    for f in dataclasses.fields(ObjectiveConfig):  # the type first: a range check on 'abc' says nothing useful
        if f.name in overrides and not _has_type(overrides[f.name], str(f.type)):
            raise ValueError(f"{f.name} must be {str(f.type).replace(' | None', ' or None')}, "
                             f"got {overrides[f.name]!r}")
    return ObjectiveConfig(**{**PRESETS[preset], **overrides})


def check_overrides_act(preset: str, overrides: dict) -> None:
    """ValueError naming the first override of `preset` that the built recipe never reads (GMPO's `gmpo_eps` under
    PPO, a clip range under GMPO or PG, `max_len` without Dr.GRPO's aggregation, rejection bounds without a rule):
    the run would train as if it were not given. A preset's own unused values are not refused."""
    cfg = objective_config(preset, **overrides)
    for field, why in inert_fields(cfg):
        if field in overrides:
            raise InertOverrideError(field, f"{overrides[field]!r} does nothing here: {why}")


class InertOverrideError(ValueError):
    """An objective override the recipe never reads (`check_overrides_act`); `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def inert_fields(cfg: ObjectiveConfig):
    """(field, why) for the fields `cfg`'s loss, aggregation and rejection never read."""
    if cfg.loss in ("gmpo", "pg"):
        why = f"loss {cfg.loss!r} has no ratio clip range" + (" (its clip is gmpo_eps)" if cfg.loss == "gmpo" else "")
        yield from (("eps_low", why), ("eps_high", why))
    if cfg.loss != "gmpo":
        yield "gmpo_eps", f"it is GMPO's log-space clip, and loss is {cfg.loss!r}"
    if cfg.agg != "seq-mean-token-sum-norm":
        yield "max_len", f"it is Dr.GRPO's constant of agg 'seq-mean-token-sum-norm', and agg is {cfg.agg!r}"
    if cfg.rejection == "none":
        why = "rejection is 'none' (set objective.overrides.rejection to a rule, e.g. 'ratio_token')"
        yield from (("rejection_low", why), ("rejection_high", why))


def _has_type(value, annotation: str) -> bool:
    """`value` fits a field annotated `annotation` (one of str, bool, int, float, optionally `| None`)."""
    if value is None:
        return annotation.endswith("| None")
    kind = annotation.removesuffix(" | None")
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, {"str": str, "bool": bool}.get(kind, object))


class BatchConstants(NamedTuple):
    """Whole-batch constants every microbatch needs (see ``batch_constants``)."""

    loss: Scalar         # the aggregation normaliser of cfg.agg
    tokens: Scalar       # number of response tokens, ≥ 1 (token means of extra terms: KL, entropy)
    weight_mean: Scalar  # global mean IS weight at θ_old (1 unless cfg.normalize_weights)
    m2_cut: Scalar | float = float("inf")  # M2PO: the largest (log ρ)² kept (inf unless cfg.m2po_threshold)


def batch_constants(cfg: ObjectiveConfig, mask: TokenMask, old_logp: TokenFloat | None = None,
                rollout_logp: TokenFloat | None = None) -> BatchConstants:
    """Compute the global normalisers from the *whole* batch (call before splitting into microbatches)."""
    wm, cut = jnp.float32(1.0), jnp.float32(jnp.inf)
    if cfg.m2po_threshold is not None:
        if rollout_logp is None:
            raise ValueError("m2po_threshold needs rollout_logp of the whole batch")
        cut = m2po_cut(proximal_logp(cfg.proximal, old_logp, rollout_logp), rollout_logp, mask, cfg.m2po_threshold)
    if cfg.normalize_weights:
        if rollout_logp is None or (old_logp is None and cfg.proximal != "bypass"):
            raise ValueError("normalize_weights=True needs old_logp and rollout_logp of the whole batch")
        # The weights the loss applies: ρ of π_prox (μ itself under bypass, where they are all 1).
        w = _raw_weights(cfg, proximal_logp(cfg.proximal, old_logp, rollout_logp), rollout_logp, mask)
        wm = weight_mean(w, mask)
    return BatchConstants(loss=global_normalizer(mask, cfg.agg, max_len=cfg.max_len),
                       tokens=jnp.maximum(num_tokens(mask), 1.0), weight_mean=wm, m2_cut=cut)


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
            raise ValueError("normalize_weights=True needs the global weight mean (BatchConstants.weight_mean)")
        w = batch_normalize(w, mask, weight_mean_)
    return sg(w)


def _surrogate(cfg: ObjectiveConfig, logp, old_logp, advantages, mask):
    """The configured per-token objective and its clip indicators (``losses.py``), with cfg's bounds."""
    if cfg.loss == "ppo":
        return LOSSES["ppo"](logp, old_logp, advantages, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                             dual_clip=cfg.dual_clip)
    if cfg.loss == "gspo":
        return LOSSES["gspo"](logp, old_logp, advantages, mask, eps_low=cfg.eps_low, eps_high=cfg.eps_high)
    if cfg.loss == "gmpo":
        return LOSSES["gmpo"](logp, old_logp, advantages, mask, eps=cfg.gmpo_eps)
    return LOSSES["pg"](logp, old_logp, advantages, mask)


CLIP_KINDS = ("clip_low", "clip_high", "dual_clip")


def clip_indicators(cfg: ObjectiveConfig, logp: TokenFloat, old_logp: TokenFloat, advantages: TokenFloat,
                    mask: TokenMask) -> dict[str, Bool[Array, "batch seq"]]:
    """Where the objective's clip is active, on the ratio *this* objective clips, with cfg's bounds.

    Keys ``clip_low`` (A < 0, ratio below the lower bound), ``clip_high`` (A > 0, above the upper bound),
    ``dual_clip`` (A < 0, r > c); all three always present (all False where the objective has no such clip).
    The ratio: PPO — the token ratio r_t (FP16 eq. 8; DAPO's decoupled ε, dual-clip c); GSPO — the
    sequence ratio s_i = exp(mean_t log r_t) (OLH eq. 16), so every token of a clipped sequence is flagged;
    GMPO — the token log-ratio against ±ε (GMPO eq. 1); PG — never clipped.
    """
    m = as_bool_mask(mask)
    _, ind = _surrogate(cfg, sg(logp), old_logp, advantages, m)
    return {k: ind.get(k, jnp.zeros(m.shape, bool)) for k in CLIP_KINDS}


def policy_loss(cfg: ObjectiveConfig | str, *, logp: TokenFloat, old_logp: TokenFloat, rollout_logp: TokenFloat,
                advantages: TokenFloat, mask: TokenMask, norm: BatchConstants,
                token_weight: TokenFloat | None = None) -> tuple[Scalar, dict[str, Scalar]]:
    """The policy loss to minimise, ``−aggregate(w · objective)``, and its aux ``{"loss/policy": loss}``.

    Args:
      cfg: an ``ObjectiveConfig`` or a preset name (``PRESETS``).
      logp: ``log π(y_t|θ)``, differentiable. old_logp: ``log π(y_t|θ_old)``. rollout_logp: ``log μ(y_t|θ_old)``.
      advantages: per-token advantages ``[B, T]`` (``token_advantages`` broadcasts per-sequence ones).
      mask: response mask. norm: ``batch_constants(cfg, full_mask, …)`` of the whole batch.
      token_weight: optional extra per-token weight (diagnostics: φ of objective-hacking eq. 18, ξ of eq. 21).

    The loss (and so ``loss/policy``) of a microbatch is its additive share of the whole-batch loss. Clip
    fractions and weight statistics are metrics: ``metrics.update_stats`` (from ``clip_indicators``) and
    ``metrics.step_metrics`` (``correction/weight_mean``, ``correction/zero_weight_frac``).
    """
    if isinstance(cfg, str):
        cfg = objective_config(cfg)
    m = as_bool_mask(mask)
    old_logp = proximal_logp(cfg.proximal, old_logp, rollout_logp)  # π_prox (objectives/decoupled.py)
    obj, _ = _surrogate(cfg, logp, old_logp, advantages, m)
    w = applied_weights(cfg, weight_numerator(cfg, logp, old_logp), rollout_logp, m,
                        global_weight_mean=norm.weight_mean, token_weight=token_weight, m2_cut=norm.m2_cut)
    loss = -aggregate(w * obj, m, cfg.agg, norm.loss)
    return loss, {"loss/policy": loss}


def weight_numerator(cfg: ObjectiveConfig, logp: TokenFloat, prox_logp: TokenFloat) -> TokenFloat:
    """The numerator of the token weight's ratio over μ: ``sg(logp)`` for ``pg`` (π(θ)/μ, FP16 eqs. 5–7), else
    π_prox (the PPO family's ρ = π_prox/μ, FP16 eqs. 9–10)."""
    return sg(logp) if cfg.loss == "pg" else prox_logp


def applied_weights(cfg: ObjectiveConfig, num_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, *,
                    global_weight_mean: Scalar | None = None, token_weight: TokenFloat | None = None,
                    m2_cut: Scalar | None = None) -> TokenFloat:
    """The weight ``policy_loss`` multiplies each token's objective by: ``correction_weights × token_weight``
    (× M2PO's mask when ``cfg.m2po_threshold``: ``m2_cut`` is ``BatchConstants.m2_cut`` of the whole batch).

    ``num_logp`` is the ratio's numerator: ``old_logp`` for the PPO family (ρ = π(θ_old)/μ, FP16 eqs. 9–10),
    ``sg(logp)`` for ``pg`` (π(θ)/μ, FP16 eqs. 5–7). ``global_weight_mean``: ``BatchConstants.weight_mean`` of the
    whole batch (needed when ``cfg.normalize_weights``). No gradient; 0 on padding.
    """
    w = correction_weights(cfg, num_logp, rollout_logp, mask, global_weight_mean)
    if cfg.m2po_threshold is not None:
        if m2_cut is None:
            raise ValueError("m2po_threshold needs the batch's cut (BatchConstants.m2_cut)")
        w = w * m2po_mask(num_logp, rollout_logp, mask, m2_cut)
    if token_weight is not None:
        w = w * sg(jnp.where(as_bool_mask(mask), token_weight.astype(jnp.float32), 0.0))
    return w
