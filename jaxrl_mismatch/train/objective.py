"""The objective the update step optimises: a policy-loss recipe plus optional KL and entropy terms, and
the diagnostics and metrics bound to the step's batch (`train.batch.RolloutBatch`).

Everything here runs inside jit. Loss normalisers come from the whole minibatch, so microbatching never
changes the result; statistics are returned as sufficient statistics (see `metrics`), so they combine
exactly over minibatches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_mismatch.metrics import MetricsConfig, step_metrics, update_stats
from jaxrl_mismatch.models.moe import RouterOutput, load_balancing_loss
from jaxrl_mismatch.objectives import (
    BatchConstants,
    ObjectiveConfig,
    batch_constants,
    m2po_mask,
    policy_loss,
    proximal_logp,
    ref_kl_k3,
    variance_weights,
    weight_distortion,
    weight_numerator,
)
from jaxrl_mismatch.train.batch import RolloutBatch


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossInterventions:
    """Objective-hacking paper interventions on the loss (both off by default; config section `diagnostics`).

    `weight_distortion_delta` ≥ 0 multiplies tokens with π(θ_old) < `weight_distortion_pi_low` by δ
    (φ, eq. 18); `variance_sigma` > 0 multiplies every token by ξ ~ N(1, σ²) (eq. 21).
    """

    weight_distortion_delta: float = -1.0
    weight_distortion_pi_low: float = 0.1
    variance_sigma: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLoss:
    """loss = policy_loss + kl_coef · KL_k3(π‖π_ref) − entropy_coef · H(π), token-averaged over the batch
    (+ router_aux_coef · load-balancing loss for mixture-of-experts policies, `router_loss`).

    The KL term uses the k3 estimator exp(q) − q − 1 with q = log π_ref − log π (Schulman's k3, as in
    GRPO eq. 4); it needs `ref_logp` in the batch. Per-token weights of the diagnostics arrive as
    `token_weight`.
    """

    cfg: ObjectiveConfig
    metrics_cfg: MetricsConfig  # `metrics.metrics_config(cfg, ...)`: every bound is the objective's
    interventions: LossInterventions = LossInterventions()
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    router_aux_coef: float = 0.0  # MoE: Qwen3-MoE's `router_aux_loss_coef` (HF default 0.001; 0 = off)

    def batch_constants(self, batch: RolloutBatch) -> BatchConstants:
        return batch_constants(self.cfg, batch.response_mask, batch.old_logp, batch.rollout_logp)

    def loss(self, logp: jax.Array, entropy: jax.Array, mb: RolloutBatch, norm: BatchConstants
             ) -> tuple[jax.Array, dict]:
        mask = mb.response_mask
        loss, aux = policy_loss(self.cfg, logp=logp, old_logp=mb.old_logp, rollout_logp=mb.rollout_logp,
                                advantages=mb.advantages, mask=mask, norm=norm, token_weight=mb.token_weight)
        maskb = mask.astype(bool)
        if self.kl_coef:
            loss = loss + self.kl_coef * jnp.sum(ref_kl_k3(logp, mb.ref_logp, mask)) / norm.tokens
        if self.entropy_coef:
            ent = jnp.sum(jnp.where(maskb, entropy, 0.0)) / norm.tokens
            loss = loss - self.entropy_coef * ent
        return loss, aux

    def router_loss(self, router: RouterOutput, input_tokens: jax.Array) -> tuple[jax.Array, dict]:
        """router_aux_coef × the Switch load-balancing loss (Fedus et al. 2021 eqs. 4–6, `moe.load_balancing_loss`:
        E · Σ_e f_e P_e over the sparse layers) of one microbatch's θ forward, and ``moe/aux_loss``.

        f_e (a share of hard assignments) and P_e are both means over the tokens, so the loss is not a sum of
        per-token terms and the whole-minibatch value cannot be split exactly over microbatches. As Megatron-Core
        and HF's gradient accumulation do, each microbatch computes it over its own tokens; here it is weighted
        by the microbatch's share of the minibatch's valid input tokens (`input_tokens`), so the scan's sum is
        their token-weighted mean — exactly the minibatch's loss with one microbatch. Logged even at coef 0.
        """
        lb = router.num_tokens / jnp.maximum(input_tokens, 1.0) * load_balancing_loss(router)
        extra = self.router_aux_coef * lb if self.router_aux_coef else jnp.zeros((), jnp.float32)
        return extra, {"moe/aux_loss": lb}

    def token_weight(self, batch: RolloutBatch, seed: jax.Array) -> jax.Array | None:
        """φ × ξ of the configured interventions over the whole batch (drawn once, never per microbatch)."""
        d, mask, weight = self.interventions, batch.response_mask, None
        if d.weight_distortion_delta >= 0:
            weight = weight_distortion(batch.old_logp, mask, delta=d.weight_distortion_delta,
                                       pi_low=d.weight_distortion_pi_low)
        if d.variance_sigma:
            xi = variance_weights(mask, sigma=d.variance_sigma, seed=jax.random.wrap_key_data(seed))
            weight = xi if weight is None else weight * xi
        return weight

    def step_metrics(self, batch: RolloutBatch) -> dict[str, jax.Array]:
        """θ-independent metrics over the whole step batch (mismatch, corrections, lengths, surrogate J)."""
        return step_metrics(batch.old_logp, batch.rollout_logp, batch.response_mask, batch.advantages,
                            cfg=self.metrics_cfg, token_weight=batch.token_weight)

    def update_stats(self, logp: jax.Array, entropy: jax.Array, batch: RolloutBatch) -> dict[str, jax.Array]:
        """θ-dependent sufficient statistics of one update: PPO ratios and clipping, entropy of π; with a KL
        penalty, its k3 towards π_ref (`policy/kl_ref_k3`: Σ k3 / tokens over all the step's updates, not a mean
        of per-minibatch means); with M2PO, the share of tokens this update's loss masked
        (`correction/m2po_masked_frac`).

        M2PO's cut is a constant of the update's batch (the minibatch, as the loss normaliser is), so it is
        counted here with the cut the loss used; the step metric `correction/zero_weight_frac` applies one cut
        to the whole step batch and equals it only with one minibatch per step."""
        stats = update_stats(logp, batch.old_logp, batch.advantages, batch.response_mask, cfg=self.metrics_cfg,
                             entropy=entropy)
        if self.kl_coef:  # the KL penalty's k3 towards π_ref, a token mean over every update of the step
            m = batch.response_mask > 0
            stats["num:policy/kl_ref_k3"] = jnp.sum(ref_kl_k3(jax.lax.stop_gradient(logp), batch.ref_logp, m))
            stats["den:policy/kl_ref_k3"] = jnp.sum(m).astype(jnp.float32)
        if self.cfg.m2po_threshold is not None:
            m = batch.response_mask > 0
            num = weight_numerator(self.cfg, logp, proximal_logp(self.cfg.proximal, batch.old_logp, batch.rollout_logp))
            keep = m2po_mask(num, batch.rollout_logp, m, self.batch_constants(batch).m2_cut)
            stats["num:correction/m2po_masked_frac"] = jnp.sum(m & (keep == 0)).astype(jnp.float32)
            stats["den:correction/m2po_masked_frac"] = jnp.sum(m).astype(jnp.float32)
        return stats
