"""Pure schedules against their closed forms, their composition with optax.join_schedules, and the registry."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_mismatch.schedules import controllers, pure

COUNTS = np.arange(0, 400)


def _values(schedule, counts=COUNTS):
    # Evaluate under jit with int32 counts, as inject_hyperparams does inside the update.
    return np.asarray(jax.jit(jax.vmap(schedule))(jnp.asarray(counts, jnp.int32)))


def test_constant():
    np.testing.assert_array_equal(_values(pure.constant_schedule(3e-6)), np.float32(3e-6))


def test_linear_warmup_closed_form():
    got = _values(pure.linear_warmup_schedule(1e-3, warmup_steps=50, init_value=1e-4))
    want = 1e-4 + (1e-3 - 1e-4) * np.minimum(COUNTS / 50, 1.0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(_values(pure.linear_warmup_schedule(2e-3, warmup_steps=0)), np.float32(2e-3))


def test_cosine_closed_form():
    got = _values(pure.cosine_schedule(1e-3, decay_steps=300, alpha=0.1))
    frac = np.minimum(COUNTS / 300, 1.0)
    want = 1e-3 * (0.9 * 0.5 * (1 + np.cos(np.pi * frac)) + 0.1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("start_step", [0, 37])
def test_step_decay_closed_form(start_step):
    # LR paper: halve every decay_period until 1/10 of lr0 -> 1, .5, .25, .125, then the floor .1.
    got = _values(pure.step_decay_schedule(1e-6, decay_period=60, floor=0.1, start_step=start_step))
    n = np.maximum(COUNTS - start_step, 0) // 60
    want = 1e-6 * np.maximum(0.5**n, 0.1)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.min() >= np.float32(1e-7) * (1 - 1e-6)
    # Boundaries are exact: the value changes exactly at start + k * period.
    changes = np.flatnonzero(np.diff(got)) + 1
    np.testing.assert_array_equal(changes, [start_step + 60 * k for k in (1, 2, 3, 4)])


def test_step_decay_matches_host_twin():
    # The host controllers use controllers.step_decay_scale; it must be the same staircase.
    schedule = pure.step_decay_schedule(1.0, decay_period=45, floor=0.2, factor=0.5, start_step=10)
    got = _values(schedule)
    host = [controllers.step_decay_scale(int(c), first_decay_step=55, decay_period=45, floor=0.2) for c in COUNTS]
    np.testing.assert_allclose(got, host, rtol=1e-7)


def test_join_warmup_then_step_decay():
    # optax.join_schedules hands the second schedule `count - boundary`.
    warmup, decay = pure.linear_warmup_schedule(1e-3, 20), pure.step_decay_schedule(1e-3, decay_period=100)
    joined = optax.join_schedules([warmup, decay], boundaries=[20])
    got = _values(joined)
    want = np.where(COUNTS < 20, 1e-3 * COUNTS / 20, 1e-3 * np.maximum(0.5 ** ((COUNTS - 20) // 100), 0.1))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_make_schedule_registry():
    schedule = pure.make_schedule("step_decay", init_value=2.0, decay_period=10)
    assert float(schedule(25)) == pytest.approx(0.5)
    valid = r"\['constant', 'cosine', 'linear_warmup', 'step_decay'\]"
    with pytest.raises(ValueError, match=r"unknown schedule 'cosin'.*" + valid):
        pure.make_schedule("cosin", init_value=1.0)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['period'\].*accepted"):
        pure.make_schedule("step_decay", init_value=1.0, period=10)
    with pytest.raises(TypeError, match=r"missing required argument\(s\) \['decay_period'\]"):
        pure.make_schedule("step_decay", init_value=1.0)


@pytest.mark.parametrize(
    "factory, kwargs, match",
    [
        (pure.step_decay_schedule, dict(init_value=1.0, decay_period=0), "decay_period"),
        (pure.step_decay_schedule, dict(init_value=1.0, decay_period=10, floor=0.0), "floor"),
        (pure.step_decay_schedule, dict(init_value=1.0, decay_period=10, factor=1.0), "factor"),
        (pure.step_decay_schedule, dict(init_value=-1.0, decay_period=10), "init_value"),
        (pure.cosine_schedule, dict(init_value=1.0, decay_steps=10, alpha=1.5), "alpha"),
        (pure.linear_warmup_schedule, dict(peak_value=math.nan, warmup_steps=3), "peak_value"),
        (pure.linear_warmup_schedule, dict(peak_value=1.0, warmup_steps=2.5), "warmup_steps"),
    ],
)
def test_bad_arguments(factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        factory(**kwargs)
