"""Every metric against a NumPy reference written here; names stable and documented; μ = π neutral;
padding-invariant; finite for extreme log-ratios; jit-able."""

import pathlib

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_mismatch.metrics import MetricsConfig, compute_metrics, metric_names

CFG = MetricsConfig(tis_cap=1.3, mask_low=0.93, mask_high=1.08, eps_low=0.1, eps_high=0.15)
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "objectives.md"
HYP = settings(max_examples=25, deadline=None)


def make_batch(seed, b=7, t=11, spread=0.3):
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.001, 1.0, size=(b, t)))
    roll = np.minimum(old + spread * rng.normal(size=(b, t)), 0.0)
    logp = old + 0.25 * rng.normal(size=(b, t))
    lengths = rng.integers(1, t + 1, size=b)
    lengths[-1] = 0  # an all-padding row
    mask = np.arange(t)[None, :] < lengths[:, None]
    adv = rng.normal(size=(b, t))  # per-token advantages exercise both clip sides
    ent = rng.uniform(0, 3, size=(b, t))
    junk = lambda x: np.where(mask, x, rng.choice([np.inf, -1e30, 9.0], size=(b, t))).astype(np.float32)  # noqa
    return junk(old), junk(roll), mask, junk(logp), junk(adv), junk(ent)


def np_metrics(old, roll, mask, logp, adv, ent, cfg):
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
    rr = np.exp(tok(logp) - o)
    a = tok(adv)
    low, high = (a < 0) & (rr < 1 - cfg.eps_low), (a > 0) & (rr > 1 + cfg.eps_high)
    seq_low, seq_high = [], []
    for i in rows:
        ri = np.exp(logp[i][mask[i]].astype(np.float64) - old[i][mask[i]])
        ai = adv[i][mask[i]]
        seq_low.append(((ai < 0) & (ri < 1 - cfg.eps_low)).any())
        seq_high.append(((ai > 0) & (ri > 1 + cfg.eps_high)).any())
    out.update({
        "ppo/clip_frac_low": low.mean(), "ppo/clip_frac_high": high.mean(),
        "ppo/seq_clip_frac_low": np.mean(seq_low), "ppo/seq_clip_frac_high": np.mean(seq_high),
        "ppo/ratio_mean": rr.mean(), "ppo/ratio_max": rr.max(), "ppo/ratio_min": rr.min(),
        "policy/entropy": tok(ent).mean(),
        "diag/surrogate_j": np.sum(a * (np.where(p < cfg.phi_pi_low, cfg.phi_delta, 1.0) - 1)),
    })
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_metric_matches_numpy(seed):
    old, roll, mask, logp, adv, ent = make_batch(seed)
    got = jax.jit(lambda *a: compute_metrics(*a[:3], logp=a[3], advantages=a[4], entropy=a[5], cfg=CFG))(
        old, roll, mask, logp, adv, ent)
    want = np_metrics(old, roll, mask, logp, adv, ent, CFG)
    assert sorted(got) == sorted(want) == sorted(metric_names(CFG))
    for k in want:
        assert got[k].shape == () and got[k].dtype == np.float32, k
        np.testing.assert_allclose(got[k], want[k], rtol=5e-5, atol=2e-6, err_msg=k)
    # the data exercise the fractions (not all zero / all one)
    for k in ("correction/token_truncated_frac", "correction/token_masked_frac", "ppo/clip_frac_low",
              "ppo/clip_frac_high", "correction/seq_mean_masked_frac"):
        assert 0 < want[k] < 1, k


def test_metric_names_are_documented_and_optional_families():
    doc = DOC.read_text()
    for name in metric_names():
        assert f"`{name}`" in doc, f"{name} missing from docs/objectives.md"
    old, roll, mask, *_ = make_batch(4)
    assert sorted(compute_metrics(old, roll, mask)) == sorted(
        metric_names(with_ppo=False, with_entropy=False, with_advantages=False))


NEUTRAL = {
    "mismatch/log_ppl_diff": 0, "mismatch/log_ppl_abs_diff": 0, "mismatch/log_ppl_diff_max": 0,
    "mismatch/log_ppl_diff_min": 0, "mismatch/rho_mean": 1, "mismatch/rho_std": 0, "mismatch/rho_min": 1,
    "mismatch/rho_max": 1, "mismatch/ess_token": 1, "mismatch/ess_seq": 1, "mismatch/chi2_token": 0,
    "mismatch/chi2_seq": 0, "mismatch/kl_k1": 0, "mismatch/kl_k2": 0, "mismatch/kl_k3": 0,
    "mismatch/prob_abs_diff_max": 0, "mismatch/prob_abs_diff_mean": 0, "mismatch/prob_abs_diff_std": 0,
    "mismatch/prob_pearson": 1, "correction/token_truncated_frac": 0, "correction/token_masked_frac": 0,
    "correction/seq_sum_truncated_frac": 0, "correction/seq_sum_masked_frac": 0,
    "correction/seq_mean_truncated_frac": 0, "correction/seq_mean_masked_frac": 0,
    "correction/seq_any_token_masked_frac": 0, "ppo/clip_frac_low": 0, "ppo/clip_frac_high": 0,
    "ppo/seq_clip_frac_low": 0, "ppo/seq_clip_frac_high": 0, "ppo/ratio_mean": 1,
}


@HYP
@given(seed=st.integers(0, 10_000), n_valid=st.integers(0, 24))
def test_mu_equals_pi_gives_neutral_metrics(seed, n_valid):
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(1e-4, 1, size=(4, 6))).astype(np.float32)
    mask = (np.arange(24) < n_valid).reshape(4, 6)
    out = compute_metrics(old, old, mask, logp=old, advantages=rng.normal(size=(4, 6)).astype(np.float32))
    for k, v in NEUTRAL.items():
        np.testing.assert_allclose(out[k], v, atol=1e-5, err_msg=k)
    for suffix in ("pi_0-0.1", "pi_0.1-0.5", "pi_0.5-0.9", "pi_0.9-1"):
        np.testing.assert_allclose(out[f"mismatch/rho_mean_{suffix}"], 1.0, atol=1e-6)


@HYP
@given(seed=st.integers(0, 10_000), pad=st.just(3), rows=st.sampled_from([0, 2]),
       fill=st.sampled_from([0.0, -1e30, 5.0, np.inf]))
def test_appending_padding_changes_no_metric(seed, pad, rows, fill):
    old, roll, mask, logp, adv, ent = make_batch(seed)
    b, t = mask.shape

    def padded(x, v):
        x = np.concatenate([x, np.full((b, pad), v, x.dtype)], 1)
        return np.concatenate([x, np.full((rows, t + pad), v, x.dtype)], 0)

    a = compute_metrics(old, roll, mask, logp=logp, advantages=adv, entropy=ent, cfg=CFG)
    p = [padded(x, fill) for x in (old, roll, logp, adv, ent)]
    z = compute_metrics(p[0], p[1], padded(mask, False), logp=p[2], advantages=p[3], entropy=p[4], cfg=CFG)
    for k in a:
        np.testing.assert_allclose(z[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)


@HYP
@given(scale=st.sampled_from([1e2, 1e4, 1e6, 1e30]), seed=st.integers(0, 1000))
def test_extreme_log_ratios_give_finite_metrics(scale, seed):
    rng = np.random.default_rng(seed)
    old = (-rng.random((3, 8)) * scale).astype(np.float32)
    roll = (-rng.random((3, 8)) * scale).astype(np.float32)
    logp = (-rng.random((3, 8)) * scale).astype(np.float32)
    mask = rng.random((3, 8)) < 0.8
    out = compute_metrics(old, roll, mask, logp=logp, advantages=rng.normal(size=(3, 8)).astype(np.float32),
                          entropy=np.ones((3, 8), np.float32))
    bad = {k: float(v) for k, v in out.items() if not np.isfinite(float(v))}
    assert not bad, bad


def test_empty_batch_is_finite_and_neutral():
    z = np.zeros((2, 3), np.float32)
    out = compute_metrics(z, z - 1, np.zeros((2, 3), bool), logp=z, advantages=z, entropy=z)
    assert all(np.isfinite(float(v)) for v in out.values())
    assert float(out["mismatch/rho_mean"]) == 1.0 and float(out["length/mean"]) == 0.0
