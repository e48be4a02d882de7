"""Off-policy (stale) data: AReaL's decoupled PPO, its "bypass" proximal policy, and M2PO's second-moment mask.

Three policies meet in an asynchronous run (``rollout.max_staleness`` > 0):

- μ, the *behaviour* policy: the engine's log-probs at the weight version the sample was generated with
  (``rollout_logp``; possibly several versions old, and in the engine's precision);
- π_prox, the *proximal* policy: the trainer's θ_old at the current version (``old_logp``, the forward
  ``Learner.prepare`` runs anyway);
- π, the policy being optimised.

AReaL's decoupled PPO objective (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning
System for Language Reasoning", arXiv:2505.24298, §5.2, the decoupled objective — eq. 5 of the arXiv
version) is

    J(θ) = E_{y∼μ} [ Σ_t  (π_prox(y_t)/μ(y_t)) · min( u_t A_t, clip(u_t, 1−ε, 1+ε) A_t ) ],   u_t = π(y_t)/π_prox(y_t).

The clip keeps π near the *recent* π_prox (the trust region), and the importance weight π_prox/μ corrects
for the sample coming from μ — stale *and* in another precision, both at once. In this package that weight
is exactly ``ρ_t = π(θ_old)/μ`` of ``objectives/ratios.py`` (θ_old being the current weights), so the
decoupled objective is the ``ppo`` loss with a ρ correction, and every correction of ``corrections.py``
(token/sequence TIS, MIS, IcePop, the rejection masks) applies to the decoupled weight unchanged. Naive PPO
on stale data clips π/μ instead and has no weight: that is ``proximal = "bypass"`` below.

``proximal = "bypass"`` (verl's rollout-correction bypass mode; AReaL's naive-PPO baseline): μ itself stands
in for π_prox, so the θ_old forward of ``prepare`` is skipped (``Learner.prepare``; its saving is measured
in ``benchmarks/async_rollouts.py``); the clip acts on π/μ and ρ = π_prox/μ ≡ 1, so the PPO family's
corrections, rejections, weight normalisation and M2PO cut have nothing to act on (``ObjectiveConfig`` refuses
them there) and the ``mismatch/*`` metrics read their μ = π values (ratios 1,
differences 0: there is no π(θ_old) to compare μ with). ``pg``'s weight π(θ)/μ does not involve π_prox and
still applies; its batch mean (``normalize_weights``) and M2PO's cut need θ_old and are refused with bypass.

M2PO (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on
LLMs?", arXiv:2510.01161, §4, the second-moment constraint M̂₂ = (1/N) Σ_i (log r_i)² ≤ τ_M2 and its
masking algorithm): drop the tokens with the largest (log r)², largest first, until the mean over the kept
tokens is ≤ τ_M2 (the paper uses τ_M2 = 0.04). Here r = π_prox/μ (= ρ), taken over the update's whole batch
(the minibatch) once, so the cut is a batch constant (``BatchConstants.m2_cut``, like the loss normaliser) and
microbatching never changes it; at the first minibatch of a step θ = θ_old and this is the paper's r = π_θ/μ
exactly. The masked share each update applied is ``correction/m2po_masked_frac`` (``train/objective.py``). The paper's M2PO also drops
PPO's clip; the ``decoupled_m2po`` preset keeps the decoupled clip (M2PO's mask on AReaL's objective, as
the presets below state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_mismatch.objectives._types import Scalar, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.ratios import as_bool_mask, log_rho

sg = jax.lax.stop_gradient

PROXIMALS = ("recompute", "bypass")  # π_prox: the trainer's θ_old forward | μ itself (no forward)


def proximal_logp(proximal: str, old_logp: TokenFloat | None, rollout_logp: TokenFloat) -> TokenFloat:
    """log π_prox: θ_old's log-probs (``recompute``) or μ's (``bypass``)."""
    if proximal == "bypass":
        return rollout_logp
    if old_logp is None:
        raise ValueError("proximal='recompute' needs old_logp (the θ_old forward of prepare)")
    return old_logp


def m2po_cut(prox_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, tau: float) -> Scalar:
    """The largest (log r)² M2PO keeps, r = π_prox/μ, over the whole batch (M2PO §4 masking; see module doc).

    Sort the tokens' M₂ = (log r)² ascending; keep the longest prefix whose mean is ≤ τ (prefix means grow
    with the prefix, so it is one cumulative sum); the cut is its last value. The mask keeps every token with
    M₂ ≤ cut, so tokens tied at one value are kept or dropped together: a prefix may only end where the value
    changes, else the ties past its end would be kept too and the kept mean could exceed τ (bf16 log-probs
    tie often). +inf when every token fits (nothing masked), −1 when not even the smallest does (everything
    masked)."""
    m = as_bool_mask(mask)
    m2 = jnp.where(m, jnp.square(log_rho(prox_logp, rollout_logp, m)), jnp.inf).reshape(-1)
    v = jnp.sort(m2)
    n_valid = jnp.sum(m).astype(jnp.int32)
    k = jnp.arange(1, v.shape[0] + 1)
    prefix_mean = jnp.cumsum(jnp.where(jnp.isfinite(v), v, 0.0)) / k
    ends_a_tie_group = jnp.append(v[1:] > v[:-1], True) | (k == n_valid)
    ok = (prefix_mean <= tau) & (k <= n_valid) & ends_a_tie_group
    keep = jnp.max(jnp.where(ok, k, 0))  # the longest such prefix
    cut = jnp.where(keep > 0, v[jnp.maximum(keep - 1, 0)], -1.0)
    return sg(jnp.where(keep >= n_valid, jnp.inf, cut).astype(jnp.float32))


def m2po_mask(prox_logp: TokenFloat, rollout_logp: TokenFloat, mask: TokenMask, cut: Scalar) -> TokenFloat:
    """1 on the tokens M2PO keeps ((log r)² ≤ ``cut`` from ``m2po_cut``), 0 elsewhere and on padding."""
    m = as_bool_mask(mask)
    m2 = jnp.square(log_rho(prox_logp, rollout_logp, m))
    return sg(jnp.where(m & (m2 <= cut), 1.0, 0.0).astype(jnp.float32))


# Presets for stale data (merged into policy.PRESETS; pinned by tests/objectives/test_decoupled.py). All use
# GRPO advantages, token-mean aggregation and ε = 0.2 like the "grpo" preset, so they differ only in the
# proximal policy and the weight: the AReaL table's rows at one setting.
DECOUPLED_PRESETS: dict[str, dict] = {
    # AReaL's naive PPO on stale data: clip on π/μ, no weight (μ is the proximal policy).
    "naive_ppo": dict(advantages="grpo", loss="ppo", proximal="bypass"),
    # AReaL's decoupled PPO: clip on π/π_prox, weight π_prox/μ (untruncated, as in the paper).
    "decoupled": dict(advantages="grpo", loss="ppo", correction="token_is"),
    # Decoupled PPO with the weight truncated at C = 3 (token TIS on the decoupled weight). AReaL's
    # `behav_imp_weight_cap` drops the tokens above its cap instead: `correction="token_mis"` here.
    "decoupled_tis": dict(advantages="grpo", loss="ppo", correction="token_tis"),
    # Decoupled PPO + M2PO's second-moment mask, τ_M2 = 0.04 (the M2PO paper's value).
    "decoupled_m2po": dict(advantages="grpo", loss="ppo", correction="token_is", m2po_threshold=0.04),
}
