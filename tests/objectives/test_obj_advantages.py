"""Advantage estimators against NumPy references; zero-variance groups give exactly zero."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_mismatch.objectives import (
    compute_advantages,
    drgrpo_advantages,
    grpo_advantages,
    rloo_advantages,
    token_advantages,
)


def np_advantages(name, rewards, groups, eps=1e-6):
    out = np.zeros(len(rewards))
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        r = rewards[idx].astype(np.float64)
        if len(idx) < 2 or np.all(r == r[0]):
            continue
        if name == "grpo":
            out[idx] = (r - r.mean()) / (r.std(ddof=1) + eps)
        elif name == "drgrpo":
            out[idx] = r - r.mean()
        else:  # rloo: r_i − mean of the others
            out[idx] = [r[k] - np.delete(r, k).mean() for k in range(len(r))]
    return out


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_advantages_match_numpy(name, seed):
    rng = np.random.default_rng(seed)
    groups = rng.permutation(np.repeat(np.arange(5), [4, 4, 1, 3, 4]))  # includes a group of one
    rewards = rng.normal(size=groups.size).astype(np.float32)
    rewards[groups == 3] = 0.7  # a constant group
    got = compute_advantages(name, jnp.asarray(rewards), jnp.asarray(groups), 5)
    np.testing.assert_allclose(got, np_advantages(name, rewards, groups), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[groups == 3] == 0) and np.all(np.asarray(got)[groups == 2] == 0)


@settings(max_examples=30, deadline=None)
@given(value=st.floats(-1e6, 1e6, width=32), size=st.sampled_from([1, 2, 7]))
def test_constant_groups_are_exactly_zero(value, size):
    r = jnp.full((size,), value, jnp.float32)
    g = jnp.zeros((size,), jnp.int32)
    for fn in (grpo_advantages, drgrpo_advantages, rloo_advantages):
        a = np.asarray(fn(r, g, 1))
        assert np.all(a == 0.0), (fn.__name__, a)


def test_binary_rewards_rloo_and_grpo_values():
    r = jnp.array([1.0, 0.0, 0.0, 0.0])
    g = jnp.zeros(4, jnp.int32)
    np.testing.assert_allclose(rloo_advantages(r, g, 1), [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)
    np.testing.assert_allclose(drgrpo_advantages(r, g, 1), [0.75, -0.25, -0.25, -0.25], rtol=1e-6)
    np.testing.assert_allclose(grpo_advantages(r, g, 1), np.array([0.75, -0.25, -0.25, -0.25]) / 0.5, rtol=1e-5)


def test_token_advantages_and_unknown_name():
    mask = jnp.array([[1, 1, 0], [0, 0, 0]], bool)
    np.testing.assert_array_equal(token_advantages(jnp.array([2.0, 3.0]), mask), [[2, 2, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="valid: grpo, drgrpo, rloo"):
        compute_advantages("ppo", jnp.zeros(2), jnp.zeros(2, jnp.int32), 1)
