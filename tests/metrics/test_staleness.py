"""staleness/* (metrics/staleness.py): the split of log ρ into staleness and precision, against NumPy."""

import jax.numpy as jnp
import numpy as np

from jaxrl_mismatch.metrics import MetricsConfig, step_metrics
from jaxrl_mismatch.metrics.staleness import STALENESS_KEYS, staleness_metrics

B, T = 6, 8


def _batch(seed):
    rng = np.random.default_rng(seed)
    prox = -rng.exponential(1.0, size=(B, T))
    behav = np.minimum(prox + 0.3 * rng.normal(size=(B, T)), 0)  # older trainer weights
    mu = np.minimum(behav + 0.05 * rng.normal(size=(B, T)), 0)  # the engine at those weights
    lengths = rng.integers(1, T + 1, size=B)
    mask = np.arange(T)[None, :] < lengths[:, None]
    lag = np.array([0, 1, 2, 2, 1, 0], np.int32)
    f = lambda x: np.where(mask, x, 0).astype(np.float32)  # noqa: E731
    return f(prox), f(behav), f(mu), mask, lag


def _np_split(prox, behav, mu, mask, lag):
    behav = np.where(lag[:, None] > 0, behav, prox).astype(np.float64)
    ls, lp = prox - behav, behav - mu
    tok = lambda x: x[mask]  # noqa: E731
    return {
        "staleness/kl_k1": -tok(ls).mean(), "staleness/kl_k3": tok(np.expm1(ls) - ls).mean(),
        "staleness/rho_std": tok(np.exp(ls)).std(),
        "staleness/precision_kl_k1": -tok(lp).mean(), "staleness/precision_kl_k3": tok(np.expm1(lp) - lp).mean(),
        "staleness/precision_rho_std": tok(np.exp(lp)).std(),
        "staleness/version_lag_mean": lag.mean(), "staleness/version_lag_max": lag.max(),
        "staleness/stale_seq_frac": (lag > 0).mean(),
    }


def test_split_matches_numpy_and_adds_up_to_mismatch():
    prox, behav, mu, mask, lag = _batch(0)
    got = staleness_metrics(*map(jnp.asarray, (prox, behav, mu, mask, lag)))
    assert set(got) == set(STALENESS_KEYS)
    want = _np_split(prox, behav, mu, mask, lag)
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, rtol=2e-5, atol=1e-6, err_msg=k)
    total = step_metrics(jnp.asarray(prox), jnp.asarray(mu), jnp.asarray(mask), jnp.zeros((B, T)),
                         cfg=MetricsConfig())["mismatch/kl_k1"]
    np.testing.assert_allclose(float(got["staleness/kl_k1"] + got["staleness/precision_kl_k1"]), float(total),
                               rtol=1e-5, atol=1e-6)
    assert float(got["staleness/kl_k3"]) > 0 and float(got["staleness/precision_kl_k3"]) > 0


def test_exact_engine_has_zero_precision_part_and_lag_zero_zero_staleness():
    prox, behav, _, mask, lag = _batch(1)
    mu_rows = np.where(lag[:, None] > 0, behav, prox)  # exact engine: μ = π_behav bit for bit
    got = staleness_metrics(*map(jnp.asarray, (prox, behav, mu_rows, mask, lag)))
    for k in ("staleness/precision_kl_k1", "staleness/precision_kl_k3", "staleness/precision_rho_std"):
        assert float(got[k]) == 0.0, k
    assert float(got["staleness/kl_k3"]) > 0
    sync = staleness_metrics(jnp.asarray(prox), None, jnp.asarray(prox), jnp.asarray(mask), jnp.zeros(B, jnp.int32))
    assert all(float(v) == 0.0 for v in sync.values())


def test_padding_and_unread_behav_rows_change_nothing():
    prox, behav, mu, mask, lag = _batch(2)
    a = staleness_metrics(*map(jnp.asarray, (prox, behav, mu, mask, lag)))
    junk = np.where(mask, 0, 9.0).astype(np.float32)
    behav2 = np.where(lag[:, None] > 0, behav, -5.0).astype(np.float32)  # lag-0 rows of behav are never read
    b = staleness_metrics(*map(jnp.asarray, (prox + junk, behav2 + junk, mu - junk, mask, lag)))
    for k in a:
        assert float(a[k]) == float(b[k]), k


def test_without_a_proximal_policy_the_staleness_part_is_left_out_and_precision_covers_stale_rows():
    """`proximal = "bypass"` has no π_prox forward: the staleness part is unknown (with μ in its place it read
    back the precision part, negated — E4's naive-PPO runs logged that), and the precision part is π_behav/μ on
    the rows where π_behav was scored."""
    prox, behav, mu, mask, lag = _batch(0)
    got = {k: float(v) for k, v in staleness_metrics(None, jnp.asarray(behav), jnp.asarray(mu), jnp.asarray(mask),
                                                      jnp.asarray(lag)).items()}
    assert not {"staleness/kl_k1", "staleness/kl_k3", "staleness/rho_std"} & set(got)
    stale = mask & (lag[:, None] > 0)
    lp = (behav - mu)[stale]
    np.testing.assert_allclose(got["staleness/precision_kl_k1"], -lp.mean(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["staleness/precision_rho_std"], np.exp(lp).std(), rtol=1e-5, atol=1e-7)
    assert got["staleness/version_lag_max"] == lag.max()
    # A step without stale rows measured no precision part there: NaN (not logged), not 0.0, which reads as an
    # engine without mismatch
    fresh = {k: float(v) for k, v in staleness_metrics(None, None, jnp.asarray(mu), jnp.asarray(mask),
                                                        jnp.zeros(B, jnp.int32)).items()}
    assert all(np.isnan(fresh[f"staleness/precision_{k}"]) for k in ("kl_k1", "kl_k3", "rho_std"))
    assert fresh["staleness/stale_seq_frac"] == 0.0 and fresh["staleness/version_lag_max"] == 0.0
