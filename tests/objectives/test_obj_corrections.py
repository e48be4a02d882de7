"""Corrections and the ρ convention, against NumPy references written here; hypothesis properties."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_mismatch.objectives import (
    IS_WEIGHTS,
    LOG_RATIO_CLAMP,
    REJECTIONS,
    batch_normalize,
    is_weights,
    log_rho,
    rejection_mask,
    rho,
    weight_mean,
)

CAP, LOW = 1.6, 0.7
HYP = settings(max_examples=30, deadline=None)


def make_batch(seed, b=5, t=9, spread=0.6):
    rng = np.random.default_rng(seed)
    old = -rng.exponential(1.0, size=(b, t)).astype(np.float32)
    roll = np.minimum(old + spread * rng.normal(size=(b, t)), 0.0).astype(np.float32)
    lengths = rng.integers(0, t + 1, size=b)
    lengths[0] = t  # at least one full row
    mask = np.arange(t)[None, :] < lengths[:, None]
    # garbage in padding: must never matter
    old = np.where(mask, old, rng.choice([-1e30, 7.0, -3.0], size=(b, t))).astype(np.float32)
    roll = np.where(mask, roll, rng.choice([0.0, -1e30, 5.0], size=(b, t))).astype(np.float32)
    return old, roll, mask


# ---------------------------------------------------------------- NumPy reference (independent of the package)
def np_log_rho(old, roll, mask):
    d = np.clip(old.astype(np.float64) - roll.astype(np.float64), -20, 20)
    return np.where(mask, d, 0.0)


def np_seq(old, roll, mask, level):
    lr = np_log_rho(old, roll, mask)
    s = lr.sum(-1)
    if level == "seq_mean":
        s = s / np.maximum(mask.sum(-1), 1)
    return np.exp(np.clip(s, -20, 20))[:, None] * np.ones_like(lr)


def np_is_weight(name, old, roll, mask, cap, low):
    r = np.exp(np_log_rho(old, roll, mask))
    if name == "none":
        w = np.ones_like(r)
    elif name == "token_is":
        w = r
    elif name == "token_tis":
        w = np.minimum(r, cap)
    elif name == "token_mis":
        w = r * (r <= cap)
    elif name == "icepop":
        w = r * ((r >= low) & (r <= cap))
    else:
        level, kind = name.rsplit("_", 1)
        rs = np_seq(old, roll, mask, level)
        w = {"is": rs, "tis": np.minimum(rs, cap), "mis": rs * (rs <= cap)}[kind]
    return np.where(mask, w, 0.0)


def np_rejection(name, old, roll, mask, low, high):
    if name == "none":
        return mask.astype(np.float64)
    stat, level = name.split("_", 1)
    lr = np_log_rho(old, roll, mask)
    r = np.exp(lr)
    if stat == "ratio":
        lo = 0.0 if low is None else low
        hi = np.inf if high is None else high
        tok = r
        ok = lambda v: (v >= lo) & (v <= hi)  # noqa: E731
    else:
        tok = 0.5 * lr**2 if stat == "k2" else r - 1 - lr
        ok = lambda v: v <= high  # noqa: E731
    keep = np.zeros(mask.shape, bool)
    for i in range(mask.shape[0]):
        idx = mask[i]
        if level == "token":
            keep[i] = ok(tok[i])
        elif level == "seq_max":
            keep[i] = bool(np.all(ok(tok[i][idx])))
        else:
            vals = lr[i][idx] if stat == "ratio" else tok[i][idx]
            agg = vals.sum() if level == "seq_sum" else (vals.mean() if vals.size else 0.0)
            if stat == "ratio":
                agg = math.exp(min(max(agg, -20), 20))
            keep[i] = bool(ok(agg))
    return np.where(mask, keep, False).astype(np.float64)


# ---------------------------------------------------------------- the convention
def test_convention_pi_above_mu_means_rho_above_one_and_cap_hits_it():
    # token 0: π = 0.9, μ = 0.1 (π ≫ μ)  → ρ = 9;  token 1: π = 0.1, μ = 0.9 (π ≪ μ) → ρ = 1/9;  token 2: equal
    old = np.log(np.array([[0.9, 0.1, 0.5]], np.float32))
    roll = np.log(np.array([[0.1, 0.9, 0.5]], np.float32))
    mask = np.ones((1, 3), bool)
    r = np.asarray(rho(old, roll, mask))
    np.testing.assert_allclose(r, [[9.0, 1 / 9, 1.0]], rtol=1e-5)
    assert r[0, 0] > 1  # π > μ  ⇒  ρ > 1
    np.testing.assert_allclose(is_weights("token_tis", old, roll, mask, cap=2.0), [[2.0, 1 / 9, 1.0]], rtol=1e-5)
    np.testing.assert_allclose(is_weights("token_mis", old, roll, mask, cap=2.0), [[0.0, 1 / 9, 1.0]], rtol=1e-5)
    # IcePop keeps lo ≤ ρ ≤ hi: ρ = 9 and ρ = 1/9 both dropped with [0.5, 2]
    np.testing.assert_allclose(is_weights("icepop", old, roll, mask, cap=2.0, low=0.5), [[0, 0, 1.0]], atol=1e-6)
    # ratio rejection bounds are on ρ, not −log ρ (verl's token_k1 inverts asymmetric bounds): with
    # [0.05, 10] → keep all; with [0.5, 20] the π ≪ μ token is rejected, the π ≫ μ token kept.
    np.testing.assert_array_equal(rejection_mask("ratio_token", old, roll, mask, low=0.05, high=10.0), [[1, 1, 1]])
    np.testing.assert_array_equal(rejection_mask("ratio_token", old, roll, mask, low=0.5, high=20.0), [[1, 0, 1]])
    np.testing.assert_array_equal(rejection_mask("ratio_token", old, roll, mask, low=0.01, high=5.0), [[0, 1, 1]])


def test_log_ratio_clamp_documented_value():
    assert LOG_RATIO_CLAMP == 20.0
    old, roll, mask = jnp.zeros((1, 2)), jnp.array([[-1e6, 0.0]]), jnp.ones((1, 2), bool)
    np.testing.assert_allclose(log_rho(old, roll, mask), [[20.0, 0.0]])


# ---------------------------------------------------------------- against the reference
@pytest.mark.parametrize("name", list(IS_WEIGHTS))
@pytest.mark.parametrize("seed", [0, 1])
def test_is_weights_match_numpy(name, seed):
    old, roll, mask = make_batch(seed)
    got = np.asarray(is_weights(name, old, roll, mask, cap=CAP, low=LOW))
    want = np_is_weight(name, old, roll, mask, CAP, LOW)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


REJ_BOUNDS = {"ratio": (0.6, 1.5), "k2": (None, 0.08), "k3": (None, 0.08)}
# per-level bounds for the reference comparison, chosen so the test data hit both outcomes
REJ_LEVEL_BOUNDS = {
    "ratio_token": (0.7, 1.4), "ratio_seq_sum": (0.6, 1.5), "ratio_seq_mean": (0.93, 1.1),
    "ratio_seq_max": (0.5, 1.6), "k2_token": (None, 0.02), "k2_seq_sum": (None, 0.3),
    "k2_seq_mean": (None, 0.045), "k2_seq_max": (None, 0.14), "k3_token": (None, 0.02),
    "k3_seq_sum": (None, 0.3), "k3_seq_mean": (None, 0.045), "k3_seq_max": (None, 0.14),
}


@pytest.mark.parametrize("name", list(REJECTIONS))
@pytest.mark.parametrize("seed", [0, 3])
def test_rejection_masks_match_numpy(name, seed):
    old, roll, mask = make_batch(seed, spread=0.3)
    low, high = REJ_LEVEL_BOUNDS.get(name, (None, None))
    got = np.asarray(rejection_mask(name, old, roll, mask, low=low, high=high))
    want = np_rejection(name, old, roll, mask, low, high)
    np.testing.assert_array_equal(got, want)
    if name != "none":  # the bounds are tight enough that the test data exercise both outcomes
        assert 0 < got[mask].sum() < mask.sum(), name


@pytest.mark.parametrize("level", ["token", "seq_sum", "seq_mean", "seq_max"])
def test_ratio_rejection_bounds_hold_beyond_the_log_ratio_clamp(level):
    """Bounds past e^±20 (the exp clamp of ratios.py): a sequence log ρ(y) of ±30 (3 tokens of ±10; 1 token
    of ±30 at the token levels) is rejected by high = 1e10 / low = 1e-10 (log 23.03), ±21 is kept. The
    clamp kept all four rows."""
    per_token = {"token": [30.0, -30.0, 21.0, -21.0], "seq_max": [30.0, -30.0, 21.0, -21.0],
                 "seq_sum": [10.0, -10.0, 7.0, -7.0], "seq_mean": [30.0, -30.0, 21.0, -21.0]}[level]
    old = jnp.asarray(np.repeat(np.asarray(per_token, np.float32)[:, None], 3, axis=1) - 40.0)
    roll = jnp.full((4, 3), -40.0, jnp.float32)
    mask = jnp.ones((4, 3), bool)
    got = np.asarray(rejection_mask(f"ratio_{level}", old, roll, mask, low=1e-10, high=1e10))
    np.testing.assert_array_equal(got[:, 0], [0, 0, 1, 1])


def test_rejection_k_stats_reject_low_bound():
    old, roll, mask = make_batch(0)
    with pytest.raises(ValueError, match="low"):
        rejection_mask("k3_token", old, roll, mask, low=0.1, high=1.0)
    with pytest.raises(ValueError, match="valid: none, ratio_token"):
        rejection_mask("k9_token", old, roll, mask, high=1.0)
    with pytest.raises(ValueError, match="valid: none, token_is"):
        is_weights("tis", old, roll, mask)


def test_batch_normalize_matches_numpy():
    old, roll, mask = make_batch(5)
    w = is_weights("token_tis", old, roll, mask, cap=CAP)
    mean = weight_mean(w, mask)
    want_mean = np_is_weight("token_tis", old, roll, mask, CAP, LOW)[mask].mean()
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5)
    wn = np.asarray(batch_normalize(w, mask, mean))
    np.testing.assert_allclose(wn[mask].mean(), 1.0, rtol=1e-5)
    np.testing.assert_allclose(wn, np.where(mask, np.asarray(w) / want_mean, 0), rtol=1e-5)


# ---------------------------------------------------------------- properties
# The property tests all use [3, 5] batches (the padding test's unpadded shape), so the small programs each
# correction compiles per shape are shared between them.
token_logps = st.lists(st.floats(-30.0, 0.0, width=32), min_size=15, max_size=15)


@HYP
@given(vals=token_logps, n_valid=st.integers(0, 15), cap=st.floats(1.0, 10.0), low=st.floats(0.0, 1.0))
def test_mu_equals_pi_every_correction_is_identity(vals, n_valid, cap, low):
    old = jnp.asarray(np.array(vals, np.float32).reshape(3, 5))
    mask = jnp.asarray((np.arange(15) < n_valid).reshape(3, 5))
    ident = np.asarray(mask, np.float32)
    for name in IS_WEIGHTS:
        np.testing.assert_allclose(is_weights(name, old, old, mask, cap=cap, low=low), ident, err_msg=name)
    for name in REJECTIONS:
        stat = name.split("_")[0]
        low_r, high_r = (low, cap) if stat == "ratio" else (None, 1e-6)
        np.testing.assert_array_equal(rejection_mask(name, old, old, mask, low=low_r, high=high_r), ident, name)


@HYP
@given(seed=st.integers(0, 10_000), pad=st.sampled_from([2, 5]), fill=st.sampled_from([0.0, -1e30, 3.0, -7.5]))
def test_appending_padding_changes_no_weight(seed, pad, fill):
    old, roll, mask = make_batch(seed, b=3, t=5)
    old2 = np.concatenate([old, np.full((3, pad), fill, np.float32)], 1)
    roll2 = np.concatenate([roll, np.full((3, pad), -fill, np.float32)], 1)
    mask2 = np.concatenate([mask, np.zeros((3, pad), bool)], 1)
    for name in IS_WEIGHTS:
        a = is_weights(name, old, roll, mask, cap=CAP, low=LOW)
        b = is_weights(name, old2, roll2, mask2, cap=CAP, low=LOW)
        np.testing.assert_allclose(b[:, :5], a, rtol=1e-6, err_msg=name)
        assert np.all(np.asarray(b)[:, 5:] == 0)
    for name in REJECTIONS:
        low, high = REJ_BOUNDS.get(name.split("_")[0], (None, None))
        a = rejection_mask(name, old, roll, mask, low=low, high=high)
        b = rejection_mask(name, old2, roll2, mask2, low=low, high=high)
        np.testing.assert_array_equal(np.asarray(b)[:, :5], a, err_msg=name)


@pytest.mark.parametrize("name", list(IS_WEIGHTS) + [r for r in REJECTIONS if r != "none"])
def test_correction_weights_carry_no_gradient(name):
    old, roll, mask = make_batch(2, spread=0.3)

    def total(o, r):
        if name in IS_WEIGHTS:
            w = is_weights(name, o, r, mask, cap=CAP, low=LOW)
        else:
            low, high = REJ_BOUNDS[name.split("_")[0]]
            w = rejection_mask(name, o, r, mask, low=low, high=high)
        return jnp.sum(w * np.arange(w.size, dtype=np.float32).reshape(w.shape))

    g_old, g_roll = jax.grad(total, argnums=(0, 1))(jnp.asarray(old), jnp.asarray(roll))
    assert np.all(np.asarray(g_old) == 0) and np.all(np.asarray(g_roll) == 0)


@HYP
@given(scale=st.sampled_from([1e2, 1e4, 1e6, 1e30]), seed=st.integers(0, 1000))
def test_extreme_log_ratios_stay_finite(scale, seed):
    rng = np.random.default_rng(seed)
    old = (-rng.random((3, 5)) * scale).astype(np.float32)
    roll = (-rng.random((3, 5)) * scale).astype(np.float32)
    mask = rng.random((3, 5)) < 0.8
    for name in IS_WEIGHTS:
        w = np.asarray(is_weights(name, old, roll, mask, cap=CAP, low=LOW))
        assert np.all(np.isfinite(w)) and np.all(w <= math.exp(20) * 1.0001), name
        assert np.all(np.isfinite(np.asarray(batch_normalize(w, mask, weight_mean(w, mask)))))
    for name in REJECTIONS:
        low, high = REJ_BOUNDS.get(name.split("_")[0], (None, None))
        assert np.all(np.isfinite(np.asarray(rejection_mask(name, old, roll, mask, low=low, high=high))))


@pytest.mark.parametrize("name", ["seq_sum_is", "seq_sum_tis", "seq_sum_mis"])
def test_sequence_weights_sum_token_log_ratios_beyond_the_clamp(name):
    """log ρ(y) = Σ_t log ρ_t (FP16 eqs. 5, 10) from the unclamped tokens: +25 and −24 give ρ(y) = e. Each token
    was clamped to ±20 before the sum, which gave 1 (a review's case); only the sequence value is clamped."""
    old, roll, mask = jnp.array([[0.0, -24.0]]), jnp.array([[-25.0, 0.0]]), jnp.ones((1, 2), bool)
    got = np.asarray(is_weights(name, old, roll, mask, cap=3.0, low=LOW))
    np.testing.assert_allclose(got[0], [math.e, math.e], rtol=1e-6)
