"""Mixture-of-experts step metrics (issue 11), computed inside the jitted `prepare` from the θ_old forward.

Inputs are aligned with the step's targets: position t of a `[B, T]` array is the input token whose hidden
state scores target t (T = S − 1), so `mask` is the response mask and ρ_t = π(y_t|θ_old)/μ(y_t|θ_old)
(objective-level hacking eq. 5).

- ``moe/router_entropy``: mean over response positions and sparse layers of H(softmax(router logits)) (nats).
- ``moe/load_max_over_mean``, ``moe/load_cv``: per sparse layer, the expert load L_e = assignments of the
  step's valid tokens to expert e (Switch Transformer §2.2's f_e before normalising); max_e L_e / mean_e L_e
  (1 = perfectly balanced, E/k = everything on k experts) and the coefficient of variation std_e / mean_e,
  both averaged over layers; ``moe/load_max_over_mean_max`` is the worst layer.
- With the engine's routing (``rollout_ids``: the experts the inference engine used, `Completion.routing`):
  ``moe/router_disagree_frac`` = mean over sparse layers of the share of response positions whose top-k *set*
  of experts differs between the engine and the trainer's own router at θ_old (``router_ids``: its free
  choice, also when a replay forced other experts), ``moe/router_disagree_frac_layer{i}`` per model layer i,
  ``moe/router_disagree_token_frac`` = share of response positions where any layer differs (the "disagreed"
  set; the rest is "agreed"), and the std of ρ over each set (``moe/rho_std_routing_agreed`` /
  ``moe/rho_std_routing_disagreed``: the paper's §2 "mismatch", the std of eq. 5's ρ, restricted to the set).
  A position's own routing is the one compared; earlier positions reach it only through attention.
- With asynchronous rollouts (``version_lag``, ``behav_ids``: the router's free top-k at each lagged row's sample
  version, π_behav's routing, `train/behaviour.py`) the disagreement splits like `metrics/staleness.py` splits
  log ρ: ``moe/router_disagree_staleness_frac`` compares θ_old's top-k with θ_behav's (what the policy's change
  over the lag moved; 0 on rows with lag 0, where θ_behav = θ_old) and ``moe/router_disagree_precision_frac``
  compares θ_behav's with the engine's (the engine's own routing mismatch at the weights it served), each the
  mean over sparse layers of the share of response positions, with ``_token_frac`` for "any layer". Sets do not
  subtract: at a position, disagree(engine, θ_old) ≤ disagree(engine, θ_behav) + disagree(θ_behav, θ_old), with
  equality unless both differ (then the engine may still match θ_old).

Empty sets give 0 (spreads, fractions), never NaN; padding changes nothing.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrl_mismatch.metrics._masked import Masked, f32
from jaxrl_mismatch.objectives._types import Scalar, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.ratios import as_bool_mask, rho


def routing_disagrees(a: Int[Array, "b t layers k"], b: Int[Array, "b t layers k"]) -> Array:
    """`[b, t, layers]` bool: the two top-k expert *sets* differ (order within the k slots is ignored)."""
    return jnp.any(jnp.sort(a, axis=-1) != jnp.sort(b, axis=-1), axis=-1)


def moe_step_metrics(
    router_ids: Int[Array, "b t layers k"],
    entropy: Float[Array, "b t layers"],
    load: Float[Array, "layers experts"],
    old_logp: TokenFloat,
    rollout_logp: TokenFloat,
    mask: TokenMask,
    *,
    layer_ids: tuple[int, ...],
    rollout_ids: Int[Array, "b t layers k"] | None = None,
    behav_ids: Int[Array, "b t layers k"] | None = None,
    version_lag: Int[Array, "b"] | None = None,
) -> dict[str, Scalar]:
    """The ``moe/*`` metrics of one step (module docstring); ``layer_ids`` names the sparse layers (static).

    ``version_lag`` adds the staleness/precision split, with ``behav_ids`` read on the rows with lag > 0 (None:
    no row is lagged, θ_behav = θ_old everywhere)."""
    m = as_bool_mask(mask)
    tok = Masked(m)
    layers = entropy.shape[-1]
    if len(layer_ids) != layers:
        raise ValueError(f"layer_ids has {len(layer_ids)} entries for {layers} sparse layers")
    per_layer = Masked(jnp.broadcast_to(m[..., None], entropy.shape))
    load = load.astype(jnp.float32)
    mean = jnp.mean(load, axis=-1)
    safe = jnp.maximum(mean, 1e-30)
    max_over_mean = jnp.where(mean > 0, jnp.max(load, axis=-1) / safe, 0.0)
    cv = jnp.where(mean > 0, jnp.std(load, axis=-1) / safe, 0.0)
    out = {
        "moe/router_entropy": per_layer.mean(entropy),
        "moe/load_max_over_mean": jnp.mean(max_over_mean),
        "moe/load_max_over_mean_max": jnp.max(max_over_mean),
        "moe/load_cv": jnp.mean(cv),
    }

    def layer_frac(differs):  # [b, t, layers] → [layers]: the share of response positions
        return jnp.sum(jnp.where(m[..., None], differs, False), axis=(0, 1)) / jnp.maximum(tok.n, 1.0)

    if behav_ids is not None and version_lag is None:
        raise ValueError("behav_ids needs version_lag (which rows are stale)")
    if version_lag is not None:
        stale = (version_lag > 0)[:, None, None, None]
        behav = router_ids if behav_ids is None else jnp.where(stale, behav_ids.astype(router_ids.dtype), router_ids)
        parts = [("staleness", router_ids)] + ([] if rollout_ids is None else [("precision", rollout_ids)])
        for name, other in parts:
            differs = routing_disagrees(behav, other)
            out[f"moe/router_disagree_{name}_frac"] = jnp.mean(layer_frac(differs))
            out[f"moe/router_disagree_{name}_token_frac"] = tok.frac(jnp.any(differs, axis=-1))
    if rollout_ids is not None:
        differs = routing_disagrees(router_ids, rollout_ids)  # [b, t, layers]
        frac = layer_frac(differs)
        out["moe/router_disagree_frac"] = jnp.mean(frac)
        out.update({f"moe/router_disagree_frac_layer{i}": frac[j] for j, i in enumerate(layer_ids)})
        any_differs = jnp.any(differs, axis=-1)
        out["moe/router_disagree_token_frac"] = tok.frac(any_differs)
        r = rho(old_logp, rollout_logp, m)
        agreed, disagreed = Masked(m & ~any_differs), Masked(m & any_differs)
        out["moe/rho_std_routing_agreed"] = agreed.std(r)
        out["moe/rho_std_routing_disagreed"] = disagreed.std(r)
    return {k: f32(v) for k, v in out.items()}


def moe_metric_names(layer_ids: tuple[int, ...], *, with_rollout: bool, with_lag: bool = False) -> list[str]:
    """The keys ``moe_step_metrics`` returns, in order (``with_lag``: given ``version_lag``)."""
    names = ["moe/router_entropy", "moe/load_max_over_mean", "moe/load_max_over_mean_max", "moe/load_cv"]
    if with_lag:
        for part in ("staleness",) + (("precision",) if with_rollout else ()):
            names += [f"moe/router_disagree_{part}_frac", f"moe/router_disagree_{part}_token_frac"]
    if with_rollout:
        names += ["moe/router_disagree_frac", *(f"moe/router_disagree_frac_layer{i}" for i in layer_ids),
                  "moe/router_disagree_token_frac", "moe/rho_std_routing_agreed", "moe/rho_std_routing_disagreed"]
    return names
