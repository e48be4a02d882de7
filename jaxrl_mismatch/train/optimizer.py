"""The optimizer, LR schedule and host LR controller a config describes (`config.optim`, `config.controller`).

Built from the registries of `schedules/`; `validate` builds them once to check their arguments, the
learner and the loop build them for the run, `export` for a checkpoint's optimizer state.
"""

from __future__ import annotations

import ml_collections


def build_controller(controller: ml_collections.ConfigDict):
    """The host LR controller of `config.controller` (None for "none")."""
    if controller.name == "none":
        return None
    from jaxrl_mismatch.schedules import make_controller

    return make_controller(controller.name, **controller.kwargs.to_dict())


def build_schedule(optim: ml_collections.ConfigDict):
    """The in-graph LR schedule of `config.optim`: a float for "constant", else an Optax schedule.

    The schedule's peak/initial value is `optim.lr`; `warmup_steps` prepends a linear warmup with
    `optax.join_schedules`. Host controllers multiply the result through the `lr_scale` hyperparameter.
    """
    import optax

    from jaxrl_mismatch.schedules import linear_warmup_schedule, make_schedule

    kwargs = optim.schedule_kwargs.to_dict()
    if optim.schedule == "constant" and not kwargs:
        sched = float(optim.lr)
    else:
        first = {"constant": "value", "linear_warmup": "peak_value"}.get(optim.schedule, "init_value")
        if first in kwargs:  # else "make_schedule() got multiple values for keyword argument"
            raise ValueError(f"{first}: schedule {optim.schedule!r} takes its {first} from optim.lr; set optim.lr "
                             f"instead of schedule_kwargs.{first}")
        sched = make_schedule(optim.schedule, **{first: float(optim.lr)}, **kwargs)
    if optim.warmup_steps:
        after = sched if callable(sched) else make_schedule("constant", value=float(optim.lr))
        warm = linear_warmup_schedule(peak_value=float(optim.lr), warmup_steps=int(optim.warmup_steps))
        sched = optax.join_schedules([warm, after], [int(optim.warmup_steps)])
    return sched


def build_optimizer(optim: ml_collections.ConfigDict):
    """The Optax chain of `config.optim`, passing each optimizer only the hyperparameters it takes.

    `config.optim` holds every optimizer's hyperparameters (b1/b2/eps/weight_decay for adamw, momentum for
    sgd), so one the chosen optimizer does not take would silently do nothing: set away from its default, it
    is refused by name (`--config.optim.name=adam --config.optim.weight_decay=0.1` trained without decay)."""
    from jaxrl_mismatch.schedules import OPTIMIZERS, make_optimizer

    if optim.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optim.name!r}; valid optimizers: {sorted(OPTIMIZERS)}")
    accepted = OPTIMIZERS[optim.name][1]
    defaults = {k: v for _, d in OPTIMIZERS.values() for k, v in d.items()}
    for key, default in sorted(defaults.items()):
        if key in optim and key not in accepted and optim[key] != default:
            raise ValueError(f"{key} = {optim[key]!r} does nothing for optimizer {optim.name!r}, which takes "
                             f"{', '.join(sorted(accepted))}; leave {key} at {default!r} or pick an optimizer "
                             f"that takes it ({', '.join(n for n, (_, d) in OPTIMIZERS.items() if key in d)})")
    hparams = {k: optim[k] for k in accepted if k in optim}
    return make_optimizer(optim.name, learning_rate=build_schedule(optim), max_grad_norm=optim.max_grad_norm, **hparams)
