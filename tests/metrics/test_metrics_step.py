"""Step metrics (θ-independent, once per step on the whole batch): every metric against a NumPy reference
written here; statistics over all the step's tokens; names stable and documented; μ = π neutral;
padding-invariant; finite for extreme log-ratios; jit-able."""

import pathlib

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_mismatch.metrics import MetricsConfig, metric_names, metrics_config, step_metric_names, step_metrics
from jaxrl_mismatch.objectives import objective_config, surrogate_j, weight_distortion

CFG = metrics_config(objective_config("grpo_token_tis", correction_cap=1.1, correction_low=0.97))
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "objectives.md"
HYP = settings(max_examples=25, deadline=None)


def make_batch(seed, b=7, t=11, spread=0.3):
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.001, 1.0, size=(b, t)))
    roll = np.minimum(old + spread * rng.normal(size=(b, t)), 0.0)
    lengths = rng.integers(1, t + 1, size=b)
    lengths[-1] = 0  # an all-padding row
    mask = np.arange(t)[None, :] < lengths[:, None]
    adv = rng.normal(size=(b, t))
    junk = lambda x: np.where(mask, x, rng.choice([np.inf, -1e30, 9.0], size=(b, t))).astype(np.float32)  # noqa
    return junk(old), junk(roll), mask, junk(adv)


def np_metrics(old, roll, mask, adv, cfg):
    """Independent float64 reference: loops over sequences, plain numpy formulas."""
    rows = [i for i in range(mask.shape[0]) if mask[i].any()]
    tok = lambda x: x[mask].astype(np.float64)  # noqa: E731
    o, r_ = tok(old), tok(roll)
    lrho = np.clip(o - r_, -20, 20)
    rho = np.exp(lrho)
    seq_lr = np.array([np.clip(old[i][mask[i]].astype(np.float64) - roll[i][mask[i]], -20, 20).sum() for i in rows])
    seq_len = np.array([mask[i].sum() for i in rows])
    lp_tr = np.array([-old[i][mask[i]].astype(np.float64).mean() for i in rows])
    lp_ro = np.array([-roll[i][mask[i]].astype(np.float64).mean() for i in rows])
    diff = lp_tr - lp_ro
    rs = np.exp(np.clip(seq_lr, -20, 20))
    gm = np.exp(seq_lr / seq_len)
    p, q = np.exp(o), np.exp(r_)
    d = np.abs(p - q)
    out = {
        "mismatch/log_ppl_diff": diff.mean(), "mismatch/log_ppl_abs_diff": np.abs(diff).mean(),
        "mismatch/log_ppl_diff_max": diff.max(), "mismatch/log_ppl_diff_min": diff.min(),
        "mismatch/ppl_train": np.exp(lp_tr).mean(), "mismatch/ppl_rollout": np.exp(lp_ro).mean(),
        "mismatch/rho_mean": rho.mean(), "mismatch/rho_std": rho.std(), "mismatch/rho_min": rho.min(),
        "mismatch/rho_max": rho.max(),
        "mismatch/ess_token": 1.0 / np.mean((rho / rho.mean()) ** 2),
        "mismatch/ess_seq": 1.0 / np.mean((rs / rs.mean()) ** 2),
        "mismatch/chi2_token": np.mean(rho**2) - 1, "mismatch/chi2_seq": np.mean(rs**2) - 1,
        "mismatch/kl_k1": np.mean(np.log(q / p)), "mismatch/kl_k2": np.mean(0.5 * np.log(p / q) ** 2),
        "mismatch/kl_k3": np.mean(p / q - 1 - np.log(p / q)),
        "mismatch/prob_abs_diff_max": d.max(), "mismatch/prob_abs_diff_mean": d.mean(),
        "mismatch/prob_abs_diff_std": d.std(), "mismatch/prob_pearson": np.corrcoef(p, q)[0, 1],
    }
    edges = cfg.prob_buckets
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        sel = (p >= lo) & ((p <= hi) if k == len(edges) - 2 else (p < hi))
        name = f"pi_{lo:g}-{hi:g}"
        out[f"mismatch/rho_mean_{name}"] = rho[sel].mean() if sel.any() else 1.0
        out[f"mismatch/token_frac_{name}"] = sel.mean()
    outside = lambda x: (x < cfg.mask_low) | (x > cfg.mask_high)  # noqa: E731
    any_out = [outside(np.exp(np.clip(old[i][mask[i]].astype(np.float64) - roll[i][mask[i]], -20, 20))).any()
               for i in rows]
    out.update({
        "correction/token_truncated_frac": np.mean(rho > cfg.tis_cap),
        "correction/token_masked_frac": np.mean(outside(rho)),
        "correction/seq_sum_truncated_frac": np.mean(rs > cfg.tis_cap),
        "correction/seq_sum_masked_frac": np.mean(outside(rs)),
        "correction/seq_mean_truncated_frac": np.mean(gm > cfg.tis_cap),
        "correction/seq_mean_masked_frac": np.mean(outside(gm)),
        "correction/seq_any_token_masked_frac": np.mean(any_out),
        "length/mean": seq_len.mean(), "length/min": seq_len.min(), "length/max": seq_len.max(),
    })
    w = np.minimum(rho, cfg.tis_cap)  # the preset's token TIS weight (no token_weight)
    out.update({
        "correction/weight_mean": w.mean(), "correction/zero_weight_frac": np.mean(w == 0),
        "diag/surrogate_j": np.sum(tok(adv) * (np.where(p < cfg.phi_pi_low, cfg.phi_delta, 1.0) - 1)),
        "diag/nonfinite_logp_train": 0.0,
    })
    return out


# One jitted program per (cfg, shapes), as the trainer runs it (jitted, cfg static), shared by every test here;
# op-by-op (eager) calls would compile each of its dozens of small ops again for every new shape.
_STEP = jax.jit(step_metrics, static_argnames=("cfg",))


def _step(old, roll, mask, adv, cfg=CFG, **kw):
    return _STEP(old, roll, mask, adv, cfg=cfg, **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_metric_matches_numpy(seed):
    old, roll, mask, adv = make_batch(seed)
    got = _step(old, roll, mask, adv)
    want = np_metrics(old, roll, mask, adv, CFG)
    assert list(got) == list(sorted(got)) and sorted(got) == sorted(want) == sorted(step_metric_names(CFG))
    for k in want:
        assert got[k].shape == () and got[k].dtype == np.float32, k
        np.testing.assert_allclose(got[k], want[k], rtol=5e-5, atol=2e-6, err_msg=k)
    # the data exercise the fractions (not all zero / all one)
    for k in ("correction/token_truncated_frac", "correction/token_masked_frac", "correction/seq_mean_masked_frac"):
        assert 0 < want[k] < 1, k


def test_statistics_are_over_the_whole_step_not_means_of_minibatch_values():
    # Issue 13: the loop averaged per-minibatch values, logging J/M for OLH eq. 23's sum and a mean of
    # per-minibatch stds for rho_std. step_metrics runs once on the whole step: J is the sum over all the
    # step's tokens (= the sum of the parts' J) and rho_std the std over all of them.
    # Two minibatches with different mismatch and token counts (3 calm rows, 4 noisy ones: the whole step has the
    # shape of make_batch's, so its jitted program is test_every_metric_matches_numpy's).
    calm, noisy = make_batch(7, b=3, spread=0.02), make_batch(8, b=4, spread=0.5)
    old, roll, mask, adv = (np.concatenate(x) for x in zip(calm, noisy))
    adv = np.ones_like(adv)  # J = Σ_t (φ_t − 1) = the number of tokens with π(θ_old) < π_low
    whole = _step(old, roll, mask, adv)
    parts = [_step(old[a:b], roll[a:b], mask[a:b], adv[a:b]) for a, b in ((0, 3), (3, 7))]
    phi = weight_distortion(old, mask, delta=CFG.phi_delta, pi_low=CFG.phi_pi_low)
    np.testing.assert_allclose(whole["diag/surrogate_j"], surrogate_j(adv, phi, mask), rtol=1e-6)
    np.testing.assert_allclose(whole["diag/surrogate_j"], sum(float(p["diag/surrogate_j"]) for p in parts),
                               rtol=1e-5)
    assert float(whole["diag/surrogate_j"]) >= 1 and float(whole["diag/surrogate_j"]) != pytest.approx(
        np.mean([p["diag/surrogate_j"] for p in parts]), rel=0.1)
    rho = np.exp(np.clip(old[mask].astype(np.float64) - roll[mask], -20, 20))
    np.testing.assert_allclose(whole["mismatch/rho_std"], rho.std(), rtol=5e-5)
    assert abs(rho.std() - np.mean([p["mismatch/rho_std"] for p in parts])) > 0.02


def test_bounds_come_from_the_objective():
    old, roll, mask, adv = make_batch(3)
    icepop = _step(old, roll, mask, adv, cfg=objective_config("icepop", correction_low=0.9, correction_cap=1.2))
    same = _step(old, roll, mask, adv, cfg=metrics_config(objective_config("icepop", correction_low=0.9,
                                                                           correction_cap=1.2)))
    rho = np.exp(np.clip(old[mask].astype(np.float64) - roll[mask], -20, 20))
    assert icepop == same
    np.testing.assert_allclose(icepop["correction/token_masked_frac"], np.mean((rho < 0.9) | (rho > 1.2)), rtol=1e-6)
    np.testing.assert_allclose(icepop["correction/zero_weight_frac"], np.mean((rho < 0.9) | (rho > 1.2)), rtol=1e-6)
    np.testing.assert_allclose(icepop["correction/token_truncated_frac"], np.mean(rho > 1.2), rtol=1e-6)
    cfg = metrics_config(objective_config("dapo"), phi_delta=3.0, phi_pi_low=0.2)
    assert (cfg.tis_cap, cfg.mask_low, cfg.mask_high, cfg.phi_delta) == (3.0, 0.5, 3.0, 3.0)
    assert metrics_config(objective_config("dapo"), phi_delta=None).phi_delta == 2.0
    with pytest.raises(ValueError, match="phi_pi_low must be in"):
        metrics_config(objective_config("dapo"), phi_pi_low=0.0)


def test_token_weight_enters_the_applied_weight_statistics():
    old, roll, mask, adv = make_batch(5)
    xi = np.where(mask, 1.0 + 0.5 * np.random.default_rng(0).normal(size=mask.shape), np.inf).astype(np.float32)
    xi[0, 0] = 0.0
    got = _step(old, roll, mask, adv, cfg=objective_config("grpo"), token_weight=xi)
    np.testing.assert_allclose(got["correction/weight_mean"], xi[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(got["correction/zero_weight_frac"], 1.0 / mask.sum(), rtol=1e-6)


def test_metric_names_are_documented():
    doc = DOC.read_text()
    for name in metric_names():
        assert f"`{name}`" in doc, f"{name} missing from docs/objectives.md"
    assert metric_names(with_entropy=False) == metric_names()[:-1]


NEUTRAL = {
    "mismatch/log_ppl_diff": 0, "mismatch/log_ppl_abs_diff": 0, "mismatch/log_ppl_diff_max": 0,
    "mismatch/log_ppl_diff_min": 0, "mismatch/rho_mean": 1, "mismatch/rho_std": 0, "mismatch/rho_min": 1,
    "mismatch/rho_max": 1, "mismatch/ess_token": 1, "mismatch/ess_seq": 1, "mismatch/chi2_token": 0,
    "mismatch/chi2_seq": 0, "mismatch/kl_k1": 0, "mismatch/kl_k2": 0, "mismatch/kl_k3": 0,
    "mismatch/prob_abs_diff_max": 0, "mismatch/prob_abs_diff_mean": 0, "mismatch/prob_abs_diff_std": 0,
    "mismatch/prob_pearson": 1, "correction/token_truncated_frac": 0, "correction/token_masked_frac": 0,
    "correction/seq_sum_truncated_frac": 0, "correction/seq_sum_masked_frac": 0,
    "correction/seq_mean_truncated_frac": 0, "correction/seq_mean_masked_frac": 0,
    "correction/seq_any_token_masked_frac": 0, "correction/weight_mean": 1, "correction/zero_weight_frac": 0,
}


@HYP
@given(seed=st.integers(0, 10_000), n_valid=st.integers(0, 24))
def test_mu_equals_pi_gives_neutral_metrics(seed, n_valid):
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(1e-4, 1, size=(4, 6))).astype(np.float32)
    mask = (np.arange(24) < n_valid).reshape(4, 6)
    out = _step(old, old, mask, rng.normal(size=(4, 6)).astype(np.float32), cfg=objective_config("icepop"))
    for k, v in NEUTRAL.items():
        np.testing.assert_allclose(out[k], v, atol=1e-5, err_msg=k)
    for suffix in ("pi_0-0.1", "pi_0.1-0.5", "pi_0.5-0.9", "pi_0.9-1"):
        np.testing.assert_allclose(out[f"mismatch/rho_mean_{suffix}"], 1.0, atol=1e-6)


@HYP
@given(seed=st.integers(0, 10_000), pad=st.just(3), rows=st.sampled_from([0, 2]),
       fill=st.sampled_from([0.0, -1e30, 5.0, np.inf]))
def test_appending_padding_changes_no_metric(seed, pad, rows, fill):
    old, roll, mask, adv = make_batch(seed)
    b, t = mask.shape

    def padded(x, v):
        x = np.concatenate([x, np.full((b, pad), v, x.dtype)], 1)
        return np.concatenate([x, np.full((rows, t + pad), v, x.dtype)], 0)

    a = _step(old, roll, mask, adv)
    p = [padded(x, fill) for x in (old, roll, adv)]
    z = _step(p[0], p[1], padded(mask, False), p[2])
    for k in a:
        np.testing.assert_allclose(z[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)


@HYP
@given(scale=st.sampled_from([1e2, 1e4, 1e6, 1e30]), seed=st.integers(0, 1000))
def test_extreme_log_ratios_give_finite_metrics(scale, seed):
    rng = np.random.default_rng(seed)
    shape = (7, 11)  # make_batch's: the program of test_every_metric_matches_numpy
    old = (-rng.random(shape) * scale).astype(np.float32)
    roll = (-rng.random(shape) * scale).astype(np.float32)
    mask = rng.random(shape) < 0.8
    out = _step(old, roll, mask, rng.normal(size=shape).astype(np.float32))
    bad = {k: float(v) for k, v in out.items() if not np.isfinite(float(v))}
    assert not bad, bad


def test_empty_batch_is_finite_and_neutral():
    z = np.zeros((2, 3), np.float32)
    out = _step(z, z - 1, np.zeros((2, 3), bool), z, cfg=MetricsConfig())
    assert all(np.isfinite(float(v)) for v in out.values())
    assert float(out["mismatch/rho_mean"]) == 1.0 and float(out["length/mean"]) == 0.0


def test_log_ppl_diff_counts_a_token_past_the_ratio_clamp_in_full():
    """log_ppl_diff is never exponentiated: a token with |Δ log p| > 20 (the outlier the LR paper's indicator
    is for) counts in full, so the diff equals log ppl_train − log ppl_rollout."""
    old = np.array([[-1.0, -50.0, -0.1]], np.float32)
    roll = np.array([[-1.0, -1.0, -0.1]], np.float32)
    out = _step(old, roll, np.ones((1, 3), bool), np.zeros((1, 3), np.float32))
    assert float(out["mismatch/log_ppl_diff"]) == pytest.approx(49 / 3, rel=1e-6)
    assert float(out["mismatch/log_ppl_abs_diff"]) == pytest.approx(49 / 3, rel=1e-6)
    assert float(out["mismatch/log_ppl_diff_max"]) == pytest.approx(49 / 3, rel=1e-6)
    log_ppl = np.log(float(out["mismatch/ppl_train"])) - np.log(float(out["mismatch/ppl_rollout"]))
    assert float(out["mismatch/log_ppl_diff"]) == pytest.approx(log_ppl, rel=1e-5)
    assert float(out["mismatch/rho_min"]) == pytest.approx(np.exp(-20.0), rel=1e-5)  # the ratios stay clamped


def test_sequence_ratio_metrics_reduce_unclamped_token_log_ratios():
    """ρ(y) = Π_t ρ_t from the unclamped tokens (as the objectives' sequence weights): +25 and −24 give ρ(y) = e
    (χ²_seq = e² − 1); the tokens clamped to ±20 first gave ρ(y) = 1 (χ²_seq = 0)."""
    old = np.array([[0.0, -24.0]], np.float32)
    roll = np.array([[-25.0, 0.0]], np.float32)
    out = _step(old, roll, np.ones((1, 2), bool), np.zeros((1, 2), np.float32))
    assert float(out["mismatch/chi2_seq"]) == pytest.approx(np.e ** 2 - 1, rel=1e-5)


def test_chi2_is_exact_when_the_mismatch_is_at_float32_rounding():
    """χ² = E[ρ² − 1] as expm1(2 log ρ): at a log-ratio spread of 1e-5 (an fp32 engine) r·r − 1 was 9 % off."""
    rng = np.random.default_rng(0)
    roll = -rng.exponential(1.0, size=(64, 256)).astype(np.float32)
    old = (roll + 1e-5 * rng.normal(size=roll.shape)).astype(np.float32)
    out = _step(old, roll, np.ones(roll.shape, bool), np.zeros(roll.shape, np.float32))
    lr = old.astype(np.float64) - roll.astype(np.float64)
    assert float(out["mismatch/chi2_token"]) == pytest.approx(np.mean(np.expm1(2 * lr)), rel=1e-2)


@pytest.mark.parametrize("bad", [np.nan, -np.inf, np.inf])
def test_a_non_finite_trainer_logprob_makes_every_ratio_metric_nan_and_is_counted(bad):
    """Compared with NaN a bound or bucket is not hit, so without the rule the ESS (1), the Pearson and the
    fractions would come out as believable numbers. Lengths do not depend on log-probs and stay."""
    old, roll, mask, adv = make_batch(0)
    r, t = np.argwhere(mask)[3]
    old = old.copy()
    old[r, t] = bad
    out = _step(old, roll, mask, adv)
    ratio_keys = [k for k in out if k.startswith(("mismatch/", "correction/")) or k == "diag/surrogate_j"]
    assert len(ratio_keys) > 30
    assert [k for k in ratio_keys if not np.isnan(float(out[k]))] == []
    assert float(out["diag/nonfinite_logp_train"]) == 1.0
    clean = _step(*make_batch(0))
    for k in ("length/mean", "length/min", "length/max"):
        assert float(out[k]) == float(clean[k])
    assert float(clean["diag/nonfinite_logp_train"]) == 0.0
