"""`LearnerConfig`: the part of the run config the learner reads, typed and resolved once.

The learner builds the policy, its train state and the jitted step from these values alone; the loop keeps
the rest of the config (rollout server, data, evaluation, logging, checkpoints). `learner_config(c)` is the
one place that reads a (validated) `ConfigDict` for it: defaults that follow other fields are resolved
here (`trainer.exact_forward`, `trainer.remat`), and the objective and the optimizer are built here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
from jax.sharding import Mesh

from jaxrl_mismatch.metrics import metrics_config
from jaxrl_mismatch.models.config import ModelConfig
from jaxrl_mismatch.objectives import objective_config
from jaxrl_mismatch.train.config import ConfigError, exact_forward_enabled
from jaxrl_mismatch.train.config_checks import check_mesh, check_model
from jaxrl_mismatch.train.objective import LossInterventions, PolicyLoss
from jaxrl_mismatch.train.optimizer import build_optimizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    # The policy model (model.path, trainer.*).
    model_path: str
    precision: str  # precision.PRESETS
    fp32_lm_head: bool
    scan_layers: bool
    attention_impl: str
    remat_policy: str  # "none" when trainer.remat is off
    mesh: Mesh  # trainer.mesh on this job's devices
    chunk_size: int
    packing: bool
    routing_replay: str  # models.moe.REPLAY_MODES
    exact_forward: bool  # trainer.exact_forward resolved (None follows rollout.exact)
    # What the rollouts were sampled with (rollout.*): π is scored the same way.
    exact_rollout: bool  # rollout.exact: π(θ_old) by the exact scorer the engine sampled with
    temperature: float
    max_tokens: int
    max_staleness: int
    max_prompt_len: int  # task.max_prompt_len: no prompt is longer (checked at start-up); bounds the exact forward
    # The step (batch.*, seed).
    rows: int  # prompts_per_step × group_size
    ppo_epochs: int
    minibatches: int
    microbatches: int
    seed: int
    # What is optimised, and how.
    objective: PolicyLoss
    optimizer: Any  # optax.GradientTransformation of config.optim
    max_grad_norm: float

    @property
    def minibatch_rows(self) -> int:
        return self.rows // self.minibatches

    @property
    def scores_exactly(self) -> bool:
        """π(θ_old) (and π_behav) come from the batch-invariant exact scorer (`models.exact.score_exact`)."""
        return self.exact_rollout or self.exact_forward


def build_policy_loss(c: ml_collections.ConfigDict) -> PolicyLoss:
    """The configured objective: preset + overrides, metrics bounds taken from it, diagnostics."""
    obj_cfg = objective_config(c.objective.preset, **c.objective.overrides.to_dict())
    d = c.diagnostics
    on = d.weight_distortion_delta >= 0  # surrogate J measures the configured φ, else the paper's δ = 2
    metrics_cfg = metrics_config(obj_cfg, phi_delta=d.weight_distortion_delta if on else None,
                                 phi_pi_low=d.weight_distortion_pi_low if on else None)
    return PolicyLoss(
        cfg=obj_cfg, metrics_cfg=metrics_cfg, kl_coef=c.objective.kl_coef, entropy_coef=c.objective.entropy_coef,
        router_aux_coef=c.objective.router_aux_coef,
        interventions=LossInterventions(weight_distortion_delta=d.weight_distortion_delta,
                                weight_distortion_pi_low=d.weight_distortion_pi_low, variance_sigma=d.variance_sigma))


def learner_config(c: ml_collections.ConfigDict) -> LearnerConfig:
    """The learner's part of a validated run config (`config_checks.validate`), checked against this job's
    devices (`check_mesh`) and the policy's `config.json` (`check_model`) before any weight is read."""
    mesh = check_mesh(c)
    try:
        model_cfg = ModelConfig.from_hf(c.model.path)
    except (ValueError, OSError) as e:  # a damaged or unsupported config.json: one line naming it
        raise ConfigError(f"config.model.path: {c.model.path}: {e}") from None
    check_model(c, model_cfg)
    t = c.trainer
    return LearnerConfig(
        model_path=c.model.path, precision=t.precision, fp32_lm_head=bool(t.fp32_lm_head),
        scan_layers=bool(t.scan_layers), attention_impl=t.attention_impl,
        remat_policy=t.remat_policy if t.remat else "none", mesh=mesh, chunk_size=t.chunk_size,
        packing=bool(t.packing), routing_replay=t.routing_replay, exact_forward=exact_forward_enabled(c),
        exact_rollout=bool(c.rollout.exact), temperature=float(c.rollout.temperature),
        max_tokens=c.rollout.max_tokens, max_staleness=int(c.rollout.max_staleness),
        max_prompt_len=int(c.task.max_prompt_len),
        rows=c.batch.prompts_per_step * c.rollout.group_size, ppo_epochs=c.batch.ppo_epochs,
        minibatches=c.batch.minibatches, microbatches=c.batch.microbatches, seed=c.seed,
        objective=build_policy_loss(c), optimizer=build_optimizer(c.optim), max_grad_norm=c.optim.max_grad_norm,
    )
