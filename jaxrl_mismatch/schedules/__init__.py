"""LR schedules for RL fine-tuning: pure in-graph Optax schedules, the optimizer factory with host-set
float32 hyperparameters, and host-side controllers that time the LR paper's step decay from what the
run observes (response-length surge, mismatch or grad-norm alarms). See docs/schedules.md.
"""

from jaxrl_mismatch.schedules.controllers import (
    CONTROLLERS,
    Combined,
    ConstantScale,
    Controller,
    LengthTriggeredDecay,
    MetricTriggered,
    MissingMetricError,
    combine,
    make_controller,
    step_decay_scale,
)
from jaxrl_mismatch.schedules.optim import (
    OPTIMIZERS,
    configured_hyperparams,
    get_lr,
    make_optimizer,
    replicated,
    set_hyperparams,
    set_learning_rate,
    set_lr_scale,
)
from jaxrl_mismatch.schedules.pure import (
    SCHEDULES,
    Schedule,
    constant_schedule,
    cosine_schedule,
    linear_warmup_schedule,
    make_schedule,
    step_decay_schedule,
)

__all__ = [
    "CONTROLLERS",
    "OPTIMIZERS",
    "SCHEDULES",
    "Combined",
    "ConstantScale",
    "Controller",
    "LengthTriggeredDecay",
    "MetricTriggered",
    "MissingMetricError",
    "Schedule",
    "combine",
    "configured_hyperparams",
    "constant_schedule",
    "cosine_schedule",
    "get_lr",
    "linear_warmup_schedule",
    "make_controller",
    "make_optimizer",
    "make_schedule",
    "replicated",
    "set_hyperparams",
    "set_learning_rate",
    "set_lr_scale",
    "step_decay_scale",
    "step_decay_schedule",
]
