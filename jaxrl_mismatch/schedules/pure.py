"""Pure, in-graph learning-rate schedules: `count -> lr` built from jnp ops (Optax `Schedule`s).

They run inside `jax.jit` (through `optax.inject_hyperparams`), so they must be pure functions of the
step count, and they compose with `optax.join_schedules` (the second schedule sees `count - boundary`).

The step decay is the LR paper's scheduler (Zhang, Li et al., "Beyond Precision: Training-Inference Mismatch
is an Optimization Problem and Simple LR Scheduling Fixes It", arXiv:2602.01826; Sec. 2 "Our Approach",
Fig. 1(c)): halve the LR every `decay_period` steps until it reaches a floor
(1/10 of the initial LR). It is a *fixed* schedule once `decay_period` is known; the paper times it
from the response-length surge (Sec. 3, `decay_period ≈ 1.8 × surge step`), which needs observations,
so the length-triggered version lives on the host in `controllers.LengthTriggeredDecay` and uses the
same formula (`controllers.step_decay_scale`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from jaxrl_mismatch.schedules._registry import check_kwargs

Schedule = Callable[[Int[ArrayLike, ""]], Float[Array, ""]]


def _check_non_negative_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def _is_real(value: Any) -> bool:
    """A finite int or float, not a bool (`True` read as 1.0 turned a decay off)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_positive(name: str, value: float) -> None:
    if not (_is_real(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_fraction(name: str, value: float, *, allow_one: bool) -> None:
    if not (_is_real(value) and 0.0 < value and (value <= 1.0 if allow_one else value < 1.0)):
        interval = "(0, 1]" if allow_one else "(0, 1)"
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")


def constant_schedule(value: float) -> Schedule:
    """`lr(count) = value`. Useful as a segment of `optax.join_schedules`."""
    _check_positive("value", value)

    def schedule(count: Int[ArrayLike, ""]) -> Float[Array, ""]:
        del count
        return jnp.asarray(value, jnp.float32)

    return schedule


def linear_warmup_schedule(peak_value: float, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Linear ramp from `init_value` at count 0 to `peak_value` at `warmup_steps`, then flat.

    `warmup_steps=0` is the constant `peak_value`. RL fine-tuning from a pretrained policy usually uses
    no warm-up (the LR paper trains at a constant 1e-6), so this is mostly a building block for joins.
    """
    _check_positive("peak_value", peak_value)
    _check_non_negative_int("warmup_steps", warmup_steps)
    if not (_is_real(init_value) and init_value >= 0):
        raise ValueError(f"init_value must be a finite number >= 0, got {init_value!r}")

    def schedule(count: Int[ArrayLike, ""]) -> Float[Array, ""]:
        if warmup_steps == 0:
            return jnp.asarray(peak_value, jnp.float32)
        frac = jnp.clip(jnp.asarray(count, jnp.float32) / warmup_steps, 0.0, 1.0)
        return jnp.asarray(init_value + (peak_value - init_value) * frac, jnp.float32)

    return schedule


def cosine_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from `init_value` to `alpha × init_value` over `decay_steps`, then flat.

    The conventional baseline the LR paper argues against (Sec. 2 "Why not a Traditional Scheduler?"):
    its end point is fixed in advance, not tied to when the run becomes unstable. Kept for comparisons.
    """
    _check_positive("init_value", init_value)
    _check_non_negative_int("decay_steps", decay_steps)
    if decay_steps == 0:
        raise ValueError("decay_steps must be >= 1")
    if not (_is_real(alpha) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")

    def schedule(count: Int[ArrayLike, ""]) -> Float[Array, ""]:
        frac = jnp.clip(jnp.asarray(count, jnp.float32) / decay_steps, 0.0, 1.0)
        cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        return jnp.asarray(init_value * ((1.0 - alpha) * cosine + alpha), jnp.float32)

    return schedule


def step_decay_schedule(
    init_value: float,
    decay_period: int,
    floor: float = 0.1,
    factor: float = 0.5,
    start_step: int = 0,
) -> Schedule:
    """The LR paper's step decay: `init × max(factor^n, floor)`, `n = ⌊max(count − start, 0) / period⌋`.

    LR paper Sec. 2 ("Our Approach") and Fig. 1(c): "decay LR by half every decay_period until it
    reaches a minimal floor (e.g., 1/10th of the initial LR)"; Sec. 3 recommends
    `decay_period ≈ 1.8 × surge step` counted from the start of training, so with the default
    `start_step=0` the first halving happens at `count = decay_period`. `count` is Optax's: optimizer
    updates, i.e. training steps × `ppo_epochs` × minibatches (skipped fp16 updates do not count, and an
    `optim.warmup_steps` warmup starts this schedule that many updates later), so give periods in updates.
    `start_step` shifts the whole staircase (the first halving is at `start_step + decay_period`), which is
    how the host-side controller expresses a surge that was detected late.

    Integer counts use integer floor division, so boundaries are exact at any step.
    """
    _check_positive("init_value", init_value)
    _check_non_negative_int("decay_period", decay_period)
    if decay_period == 0:
        raise ValueError("decay_period must be >= 1")
    _check_fraction("floor", floor, allow_one=True)
    _check_fraction("factor", factor, allow_one=False)
    _check_non_negative_int("start_step", start_step)

    def schedule(count: Int[ArrayLike, ""]) -> Float[Array, ""]:
        n = jnp.floor_divide(jnp.maximum(jnp.asarray(count) - start_step, 0), decay_period)
        multiplier = jnp.maximum(jnp.power(jnp.float32(factor), n.astype(jnp.float32)), jnp.float32(floor))
        return jnp.asarray(init_value, jnp.float32) * multiplier

    return schedule


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "constant": constant_schedule,
    "linear_warmup": linear_warmup_schedule,
    "cosine": cosine_schedule,
    "step_decay": step_decay_schedule,
}


def make_schedule(name: str, **kwargs: Any) -> Schedule:
    """Build a registered schedule by name, e.g. `make_schedule("step_decay", init_value=1e-6, decay_period=180)`.

    Raises `ValueError` listing the valid names for an unknown `name`, and `TypeError` naming
    unknown/missing arguments (config typos fail at start-up, not mid-run).
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid schedules: {sorted(SCHEDULES)}")
    factory = SCHEDULES[name]
    check_kwargs("schedule", name, factory, kwargs)
    return factory(**kwargs)
