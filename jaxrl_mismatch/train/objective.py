"""The objective the update step optimises: a policy loss recipe plus optional KL and entropy terms.

Binds `objectives.policy_loss` (loss type × mismatch correction × aggregation) and
`metrics.compute_metrics` to the step's batch layout (see `train/step.py`). Everything here runs inside
the jitted step; all normalisers come from the whole minibatch so microbatching never changes the result.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp

from jaxrl_mismatch.metrics import MetricsConfig, compute_metrics
from jaxrl_mismatch.objectives import Normalizers, ObjectiveConfig, normalizers, policy_loss

Batch = Mapping[str, jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyObjective:
    """loss = policy_loss + kl_coef · KL_k3(π‖π_ref) − entropy_coef · H(π), token-averaged over the batch.

    The KL term uses the k3 estimator exp(q) − q − 1 with q = log π_ref − log π (Schulman's k3, as in
    GRPO eq. 4); it needs `ref_logp` in the batch. Extra per-token weights for the objective-hacking
    diagnostics (φ of eq. 18, ξ of eq. 21) arrive as an optional `token_weight` batch entry.
    """

    cfg: ObjectiveConfig
    metrics_cfg: MetricsConfig = MetricsConfig()
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    def normaliser(self, batch: Batch) -> Normalizers:
        return normalizers(self.cfg, batch["response_mask"], batch["old_logp"], batch["rollout_logp"])

    def loss(self, logp: jax.Array, entropy: jax.Array, mb: Batch, norm: Normalizers) -> tuple[jax.Array, dict]:
        mask = mb["response_mask"]
        loss, aux = policy_loss(
            self.cfg,
            logp=logp,
            old_logp=mb["old_logp"],
            rollout_logp=mb["rollout_logp"],
            advantages=mb["advantages"],
            mask=mask,
            norm=norm,
            token_weight=mb.get("token_weight"),
        )
        maskb = mask.astype(bool)
        if self.kl_coef:
            # where() before exp: padding may hold anything (even non-finite) and must not leak.
            q = jnp.clip(jnp.where(maskb, mb["ref_logp"] - logp, 0.0), -20.0, 20.0)
            kl = jnp.sum(jnp.where(maskb, jnp.exp(q) - q - 1.0, 0.0)) / norm.tokens
            loss = loss + self.kl_coef * kl
            aux["loss/kl_ref_k3"] = kl
        if self.entropy_coef:
            ent = jnp.sum(jnp.where(maskb, entropy, 0.0)) / norm.tokens
            loss = loss - self.entropy_coef * ent
        return loss, aux

    def metrics(self, logp: jax.Array, entropy: jax.Array, batch: Batch) -> dict[str, jax.Array]:
        return compute_metrics(
            batch["old_logp"],
            batch["rollout_logp"],
            batch["response_mask"],
            logp=logp,
            advantages=batch["advantages"],
            entropy=entropy,
            cfg=self.metrics_cfg,
        )
