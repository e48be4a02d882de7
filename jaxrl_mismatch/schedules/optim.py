"""The Optax optimizer factory and the host-side setters for its injected hyperparameters.

`make_optimizer` returns `chain(clip_by_global_norm, inject_hyperparams(<opt> then scale(lr_scale)))`:

* every numeric hyperparameter (`learning_rate`, betas, eps, weight decay, `lr_scale`) lives in the
  optimizer state as a float32 scalar (`hyperparam_dtype=float32`, so bf16/fp16 params never round
  the LR), so the host can change it between steps without retracing the jitted update — provided
  the new value has the same dtype, weak-typedness and sharding, which `set_hyperparams` guarantees by
  placing a float32 array with the caller's replicated sharding (`tests/schedules/test_schedules_optim.py`
  counts the traces);
* `learning_rate` may be a float (host-settable) or an in-graph schedule (`pure.py`). A scheduled
  hyperparameter is recomputed from the step count inside the update, so a host write to it would be
  silently ignored: `set_learning_rate` refuses it, and the host steers through `lr_scale` instead,
  a second float32 hyperparameter multiplied onto the whole update (decoupled weight decay included,
  so it really scales the effective LR). This is how a host controller (`controllers.py`) composes
  with an in-graph schedule: effective LR = schedule(count) × lr_scale.

AdamW defaults follow the LR paper's setup (verl defaults, which the paper uses: betas (0.9, 0.999),
eps 1e-8, weight decay 0.01) and its gradient clipping at 1.0 (`summary.md`, "Method Summary").
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, PyTree

from jaxrl_mismatch.schedules.pure import Schedule


def _adamw_then_scale(learning_rate, b1, b2, eps, weight_decay, lr_scale):
    return optax.chain(
        optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay),
        optax.scale(lr_scale),
    )


def _adam_then_scale(learning_rate, b1, b2, eps, lr_scale):
    return optax.chain(optax.adam(learning_rate, b1=b1, b2=b2, eps=eps), optax.scale(lr_scale))


def _sgd_then_scale(learning_rate, momentum, lr_scale):
    # momentum=None keeps plain SGD stateless (inject_hyperparams treats None as a static argument).
    return optax.chain(optax.sgd(learning_rate, momentum=momentum), optax.scale(lr_scale))


# name -> (inner factory, default hyperparameters). Defaults: LR paper / verl AdamW settings.
OPTIMIZERS: dict[str, tuple[Callable[..., optax.GradientTransformation], dict[str, Any]]] = {
    "adamw": (_adamw_then_scale, {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.01}),
    "adam": (_adam_then_scale, {"b1": 0.9, "b2": 0.999, "eps": 1e-8}),
    "sgd": (_sgd_then_scale, {"momentum": None}),
}


def _check_hparam(name: str, value: Any) -> None:
    if value is None and name == "momentum":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"optimizer hyperparameter {name}={value!r} must be a finite number")
    if name in ("b1", "b2", "momentum") and not 0.0 <= value < 1.0:
        raise ValueError(f"optimizer hyperparameter {name}={value!r} must lie in [0, 1)")
    if name == "eps" and value <= 0.0:
        raise ValueError(f"optimizer hyperparameter eps={value!r} must be > 0")
    if name == "weight_decay" and value < 0.0:
        raise ValueError(f"optimizer hyperparameter weight_decay={value!r} must be >= 0")


def make_optimizer(
    name: str = "adamw",
    *,
    learning_rate: float | Schedule,
    max_grad_norm: float | None = 1.0,
    lr_scale: float = 1.0,
    **hparams: Any,
) -> optax.GradientTransformation:
    """`optax.chain(clip_by_global_norm(max_grad_norm), inject_hyperparams(<name> ∘ scale(lr_scale)))`.

    Args:
      name: one of `OPTIMIZERS` ("adamw", "adam", "sgd"); anything else raises listing the valid names.
      learning_rate: a positive float (host-settable via `set_learning_rate`) or an in-graph schedule
        `count -> lr` (e.g. from `pure.make_schedule`; then steer from the host with `set_lr_scale`).
      max_grad_norm: global-norm clip threshold (LR paper: 1.0); `None` disables clipping.
      lr_scale: initial value of the host-set multiplier on the update.
      **hparams: the optimizer's own hyperparameters, overriding the defaults in `OPTIMIZERS`
        (adamw: b1, b2, eps, weight_decay). Unknown names raise listing the accepted ones, so typos fail
        early. A run's `config.optim` section (`lr`, `schedule`, `warmup_steps`, ...) is not these arguments:
        `train/optimizer.build_optimizer(c.optim)` turns it into this call.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid optimizers: {sorted(OPTIMIZERS)}")
    factory, defaults = OPTIMIZERS[name]
    unknown = sorted(set(hparams) - set(defaults))
    if unknown:
        raise TypeError(
            f"optimizer {name!r}: unknown hyperparameter(s) {unknown}; accepted: "
            f"{['learning_rate', 'max_grad_norm', 'lr_scale', *defaults]}"
        )
    resolved = {**defaults, **hparams}
    for key, value in resolved.items():
        _check_hparam(key, value)
    if not callable(learning_rate):
        if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not (
            math.isfinite(learning_rate) and learning_rate > 0
        ):
            raise ValueError(f"learning_rate must be a finite number > 0 or a schedule, got {learning_rate!r}")
    if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
    if isinstance(lr_scale, bool) or not (math.isfinite(lr_scale) and lr_scale >= 0):
        raise ValueError(f"lr_scale must be a finite number >= 0, got {lr_scale!r}")

    injected = optax.inject_hyperparams(factory, hyperparam_dtype=jnp.float32)(
        learning_rate=learning_rate, lr_scale=float(lr_scale), **resolved
    )
    if max_grad_norm is None:
        return injected
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), injected)


def _inject_state(opt_state: PyTree) -> optax.InjectStatefulHyperparamsState:
    found = [
        leaf
        for leaf in jax.tree.leaves(
            opt_state, is_leaf=lambda x: isinstance(x, optax.InjectStatefulHyperparamsState)
        )
        if isinstance(leaf, optax.InjectStatefulHyperparamsState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected exactly one inject_hyperparams state in the optimizer state (as built by "
            f"make_optimizer), found {len(found)}"
        )
    return found[0]


def _under_hyperparams(path: tuple, value: Any) -> bool:
    # A scheduled hyperparameter also has an entry (its schedule state) under `hyperparams_states`
    # with the same key: only ever touch the `hyperparams` dict.
    del value
    return any(getattr(key, "name", None) == "hyperparams" for key in path)


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated sharding on `mesh`, the one hyperparameters must keep across steps."""
    return NamedSharding(mesh, P())


def set_hyperparams(opt_state: PyTree, sharding: jax.sharding.Sharding | Mesh, **values: float) -> PyTree:
    """Return `opt_state` with the named float32 hyperparameters replaced; never causes a retrace.

    Each value becomes a float32 0-d array placed with `sharding` (a `Mesh` means replicated on it),
    i.e. exactly the abstract value and sharding the jitted update was compiled for. A Python float
    here would be weak-typed and an unplaced numpy scalar would land on one device: both retrace or
    recompile the step (`test_counters_do_detect_a_retrace` shows both). Scheduled hyperparameters are refused, since
    the update would overwrite them from the schedule.
    """
    inject = _inject_state(opt_state)
    if isinstance(sharding, Mesh):
        sharding = replicated(sharding)
    placed = {}
    for name, value in values.items():
        if name not in inject.hyperparams:
            available = sorted(inject.hyperparams)
            raise KeyError(f"no hyperparameter {name!r} in the optimizer state; available: {available}")
        if name in inject.hyperparams_states:
            raise ValueError(
                f"hyperparameter {name!r} is an in-graph schedule, so a host value would be ignored; "
                f"set 'lr_scale' (set_lr_scale) to steer it from the host"
            )
        host = np.asarray(value, dtype=np.float32)
        if host.shape != () or not np.isfinite(host):
            raise ValueError(f"hyperparameter {name!r} must be a finite scalar, got {value!r}")
        placed[name] = jax.device_put(host, sharding)
    return optax.tree_utils.tree_set(opt_state, _under_hyperparams, **placed)


def set_lr_scale(opt_state: PyTree, value: float, sharding: jax.sharding.Sharding | Mesh) -> PyTree:
    """Set the host multiplier on the update (effective LR = learning_rate × lr_scale); no retrace."""
    if not value >= 0:
        raise ValueError(f"lr_scale must be >= 0, got {value!r}")
    return set_hyperparams(opt_state, sharding, lr_scale=value)


def set_learning_rate(opt_state: PyTree, value: float, sharding: jax.sharding.Sharding | Mesh) -> PyTree:
    """Set a constant (non-scheduled) learning rate from the host; no retrace."""
    if not value > 0:
        raise ValueError(f"learning_rate must be > 0, got {value!r}")
    return set_hyperparams(opt_state, sharding, learning_rate=value)


def configured_hyperparams(opt_state: PyTree) -> dict[str, float]:
    """The host-settable hyperparameters of `opt_state` as built from the config (learning_rate when constant,
    b1, b2, eps, weight_decay, momentum), as host floats: not `lr_scale` (the controller's) nor a scheduled one.

    Why: they live in the optimizer state, so a restored checkpoint carries the values of the run that wrote it;
    a resume that accepted a changed `optim.*` sets these again (`set_hyperparams`) to train with the new ones."""
    inject = _inject_state(opt_state)
    return {name: float(np.asarray(value)) for name, value in inject.hyperparams.items()
            if name != "lr_scale" and name not in inject.hyperparams_states}


def get_lr(opt_state: PyTree) -> Float[Array, ""]:
    """Effective LR `learning_rate × lr_scale`, as used by the most recent update (works inside jit).

    Before any update it is the value the first update will use (schedule(0) × lr_scale).
    """
    hyperparams = _inject_state(opt_state).hyperparams
    return hyperparams["learning_rate"] * hyperparams["lr_scale"]
