"""Update statistics and their accumulation: NumPy references per objective; clip fractions on the ratio
the loss clips (GSPO: the sequence ratio); any split of a step into minibatches / microbatches / epochs gives
exactly the whole-step statistic; the accumulator's reductions and errors."""

import ast
import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_mismatch.metrics import (
    StatsAccumulator,
    combine_stats,
    metrics_config,
    update_metric_names,
    update_stats,
)
from jaxrl_mismatch.objectives import objective_config

HYP = settings(max_examples=25, deadline=None)
PKG = pathlib.Path(__file__).resolve().parents[2] / "jaxrl_mismatch"
CFGS = {
    "ppo": objective_config("dapo", eps_low=0.1, eps_high=0.15, dual_clip=1.3),
    "gspo": objective_config("gspo", eps_low=0.02, eps_high=0.03),
    "gmpo": objective_config("gmpo", gmpo_eps=0.12),
    "pg": objective_config("pg"),
}


def make_batch(seed, b=7, t=11, noise=0.25):
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.001, 1.0, size=(b, t)))
    logp = old + noise * rng.normal(size=(b, t))
    lengths = rng.integers(1, t + 1, size=b)
    lengths[-1] = 0  # an all-padding row
    mask = np.arange(t)[None, :] < lengths[:, None]
    adv = np.repeat(rng.normal(size=(b, 1)), t, 1)
    ent = rng.uniform(0, 3, size=(b, t))
    junk = lambda x: np.where(mask, x, rng.choice([np.inf, -1e30, 9.0], size=(b, t))).astype(np.float32)  # noqa
    return junk(logp), junk(old), junk(adv), mask, junk(ent)


def np_reference(logp, old, adv, mask, ent, cfg):
    """float64, per-sequence loops: the metrics over all the rows given."""
    rows = [i for i in range(mask.shape[0]) if mask[i].any()]
    low, high, dual, ratios = [], [], [], []
    for i in rows:
        lr = np.clip(logp[i][mask[i]].astype(np.float64) - old[i][mask[i]], -20, 20)
        a, r = adv[i][mask[i]].astype(np.float64), np.exp(lr)
        none = np.zeros_like(r, bool)
        if cfg.loss == "ppo":
            lo, hi, du = (a < 0) & (r < 1 - cfg.eps_low), (a > 0) & (r > 1 + cfg.eps_high), (a < 0) & (r > cfg.dual_clip)
        elif cfg.loss == "gspo":
            s = np.exp(lr.mean())  # the sequence ratio GSPO clips, on every token of the sequence
            lo, hi, du = (a < 0) & (s < 1 - cfg.eps_low), (a > 0) & (s > 1 + cfg.eps_high), none
        elif cfg.loss == "gmpo":
            lo, hi, du = (a < 0) & (lr < -cfg.gmpo_eps), (a > 0) & (lr > cfg.gmpo_eps), none
        else:
            lo = hi = du = none
        low.append(lo), high.append(hi), dual.append(du), ratios.append(r)
    cat = np.concatenate
    return {
        "ppo/clip_frac_low": cat(low).mean(), "ppo/clip_frac_high": cat(high).mean(),
        "ppo/dual_clip_frac": cat(dual).mean(),
        "ppo/seq_clip_frac_low": np.mean([x.any() for x in low]),
        "ppo/seq_clip_frac_high": np.mean([x.any() for x in high]),
        "ppo/ratio_mean": cat(ratios).mean(), "ppo/ratio_max": cat(ratios).max(), "ppo/ratio_min": cat(ratios).min(),
        "policy/entropy": ent[mask].astype(np.float64).mean(),
    }


@functools.partial(jax.jit, static_argnames="cfg")
def _jit_stats(logp, old, adv, mask, ent, cfg):
    return update_stats(logp, old, adv, mask, cfg=cfg, entropy=ent)


def _stats(logp, old, adv, mask, ent, cfg):
    # One jitted function for the file (the config is static and hashable): each (config, shape) compiles
    # once, where a fresh lambda per call recompiled every minibatch of every Hypothesis example.
    return _jit_stats(logp, old, adv, mask, ent, cfg=cfg)


def _accumulate(parts):
    acc = StatsAccumulator()
    for p in parts:
        acc.add(p)
    return acc.result()


@pytest.mark.parametrize("loss", list(CFGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_update_stats_match_numpy(loss, seed):
    batch = make_batch(seed)
    cfg = metrics_config(CFGS[loss])
    stats = _stats(*batch, cfg)
    assert all(v.shape == () and v.dtype == jnp.float32 for v in stats.values())
    got, want = _accumulate([stats]), np_reference(*batch, CFGS[loss])
    assert sorted(got) == sorted(want) == sorted(update_metric_names())
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=5e-6, atol=1e-7, err_msg=k)
    if loss in ("ppo", "gmpo"):  # the data exercise both clip sides
        assert 0 < want["ppo/clip_frac_low"] < 1 and 0 < want["ppo/clip_frac_high"] < 1
    if loss == "ppo":
        assert 0 < want["ppo/dual_clip_frac"] < 1


def test_gspo_clip_fractions_use_the_sequence_ratio():
    # Issue 13: ppo/clip_frac_* compared *token* ratios with GSPO's ε = 3e-4 and flagged almost every token.
    # Here every sequence's token log-ratios have mean exactly 0 (s_i = 1, nothing is clipped) although
    # each token's ratio is ~±10 % off 1; only row 2, shifted by +0.01 with A > 0, exceeds 1 + 4e-4.
    rng = np.random.default_rng(0)
    b, t = 5, 8
    noise = 0.1 * rng.normal(size=(b, t))
    noise -= noise.mean(axis=1, keepdims=True)
    noise[2] += 0.01
    old = np.log(rng.uniform(0.05, 0.9, size=(b, t))).astype(np.float32)
    logp = (old + noise).astype(np.float32)
    adv = np.repeat(np.array([[1.0], [-1.0], [1.0], [-1.0], [0.5]]), t, 1).astype(np.float32)
    mask = np.ones((b, t), bool)
    got = _accumulate([update_stats(logp, old, adv, mask, cfg=objective_config("gspo"))])
    assert got["ppo/clip_frac_high"] == pytest.approx(t / (b * t)) and got["ppo/clip_frac_low"] == 0.0
    assert got["ppo/seq_clip_frac_high"] == pytest.approx(1 / b) and got["ppo/seq_clip_frac_low"] == 0.0
    token_ratio = np.exp(noise)
    assert np.mean(np.abs(token_ratio - 1) > 4e-4) > 0.95  # what the token-level measure would have flagged


@HYP
@given(seed=st.integers(0, 10_000), loss=st.sampled_from(list(CFGS)),
       cuts=st.lists(st.integers(0, 9), min_size=0, max_size=4), epochs=st.integers(1, 2))
def test_any_split_into_minibatches_gives_the_whole_step_statistic(seed, loss, cuts, epochs):
    logp, old, adv, mask, ent = make_batch(seed, b=9)
    cfg = metrics_config(CFGS[loss])
    edges = [0, *sorted(cuts), 9]
    parts = [_stats(logp[a:b], old[a:b], adv[a:b], mask[a:b], ent[a:b], cfg)
             for _ in range(epochs) for a, b in zip(edges[:-1], edges[1:])]
    got = _accumulate(parts)
    whole = _accumulate([_stats(logp, old, adv, mask, ent, cfg)])
    want = np_reference(logp, old, adv, mask, ent, CFGS[loss])
    for k in want:  # PPO epochs repeat the same tokens: every fraction, mean and extreme is unchanged
        np.testing.assert_allclose(got[k], whole[k], rtol=1e-6, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(got[k], want[k], rtol=5e-6, atol=1e-7, err_msg=k)


def test_minibatches_with_different_token_counts_are_not_averaged():
    # The old step record averaged per-minibatch fractions: with 1 short and 1 long minibatch that weights
    # the short one's tokens far more. The accumulated statistic is clipped tokens / tokens of the step.
    t = 10
    old = np.full((2, t), np.log(0.5), np.float32)
    logp = old.copy()
    logp[0, :2] += 1.0  # minibatch 1 (2 tokens): both clipped high
    mask = np.zeros((2, t), bool)
    mask[0, :2] = True
    mask[1, :] = True  # minibatch 2 (10 tokens): none clipped
    adv = np.ones((2, t), np.float32)
    cfg = objective_config("grpo")
    per_mb = [update_stats(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], cfg=cfg) for i in range(2)]
    fracs = [_accumulate([s])["ppo/clip_frac_high"] for s in per_mb]
    assert fracs == [1.0, 0.0] and np.mean(fracs) == 0.5  # what averaging the minibatch values logged
    assert _accumulate(per_mb)["ppo/clip_frac_high"] == pytest.approx(2 / 12)


def test_combine_stats_over_microbatches_inside_jit_equals_whole():
    logp, old, adv, mask, ent = make_batch(3, b=8)
    cfg = metrics_config(CFGS["ppo"])

    @jax.jit
    def scanned(logp, old, adv, mask, ent):
        split = lambda x: x.reshape((4, 2) + x.shape[1:])  # noqa: E731
        stats = [update_stats(*(split(x)[i] for x in (logp, old, adv, mask)), cfg=cfg, entropy=split(ent)[i])
                 for i in range(4)]
        out = stats[0]
        for s in stats[1:]:
            out = combine_stats(out, s)
        return out

    got = _accumulate([scanned(logp, old, adv, mask, ent)])
    want = _accumulate([_stats(logp, old, adv, mask, ent, cfg)])
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)
    assert combine_stats({"last:s": 1.0, "sum:n": 1.0}, {"last:s": 2.0, "sum:n": 3.0}) == {"last:s": 2.0, "sum:n": 4.0}
    with pytest.raises(ValueError, match="'mean:loss/policy'.*StatsAccumulator"):
        combine_stats({"mean:loss/policy": 1.0}, {})


@HYP
@given(seed=st.integers(0, 10_000), fill=st.sampled_from([0.0, -1e30, np.inf]))
def test_padding_changes_no_statistic(seed, fill):
    logp, old, adv, mask, ent = make_batch(seed)
    cfg = metrics_config(CFGS["gspo"])
    pad = lambda x, v: np.concatenate([np.concatenate([x, np.full((x.shape[0], 3), v, x.dtype)], 1),  # noqa
                                       np.full((2, x.shape[1] + 3), v, x.dtype)], 0)
    a = _stats(logp, old, adv, mask, ent, cfg)
    z = _stats(pad(logp, fill), pad(old, fill), pad(adv, fill), pad(mask, False), pad(ent, fill), cfg)
    for k in a:
        np.testing.assert_allclose(z[k], a[k], rtol=1e-6, err_msg=k)


def test_accumulator_reductions():
    acc = StatsAccumulator()
    acc.add({"mean:loss/policy": jnp.float32(1.0), "last:loss_scale/scale": 8.0, "max:grad/max": 2.0,
             "min:grad/min": np.float32(-1.0), "sum:diag/n": 3, "num:f": 1.0, "den:f": 4.0})
    acc.add({"mean:loss/policy": 3.0, "last:loss_scale/scale": 4.0, "max:grad/max": 1.0, "min:grad/min": 0.0,
             "sum:diag/n": 2, "num:f": 2.0, "den:f": 2.0})
    assert acc.result() == {"loss/policy": 2.0, "loss_scale/scale": 4.0, "grad/max": 2.0, "grad/min": -1.0,
                            "diag/n": 5.0, "f": 0.5}
    acc.reset()
    acc.add({"num:f": 0.0, "den:f": 0.0, "max:m": -math.inf})  # no tokens: no statistic, not a made-up one
    assert all(math.isnan(v) for v in acc.result().values())


@pytest.mark.parametrize("order", [(1.0, math.nan, 3.0), (math.nan, 1.0, 3.0), (1.0, 3.0, math.nan)])
def test_accumulator_extremes_keep_a_nan_in_any_order_like_combine_stats(order):
    """A NaN extreme of one update is the step's extreme whichever update it came in (Python's max would keep
    the first argument when the second is NaN); jit's combine_stats (jnp.maximum) does the same."""
    acc = StatsAccumulator()
    for x in order:
        acc.add({"max:ppo/ratio_max": x, "min:ppo/ratio_min": x})
    assert all(math.isnan(v) for v in acc.result().values())
    jitted = functools.reduce(combine_stats, [{"max:m": jnp.float32(x), "min:n": jnp.float32(x)} for x in order])
    assert all(math.isnan(float(v)) for v in jitted.values())


def test_accumulator_errors_name_the_key_and_leave_it_unchanged():
    acc = StatsAccumulator()
    acc.add({"sum:a": 1.0})
    with pytest.raises(ValueError, match=r"'ppo/clip_frac_low' is not '<how>:<name>'"):
        acc.add({"sum:a": 1.0, "ppo/clip_frac_low": 0.1})
    with pytest.raises(ValueError, match=r"metric 'a' is reduced two ways: 'sum' and 'max'"):
        acc.add({"max:a": 1.0})
    with pytest.raises(ValueError, match=r"'sum:v' must be a scalar, got shape \(2,\)"):
        acc.add({"sum:v": np.ones(2)})
    assert acc.result() == {"a": 1.0}  # the failed adds changed nothing
    acc.add({"num:x": 1.0})
    with pytest.raises(ValueError, match=r"'x' has no den:x"):
        acc.result()


def test_no_literal_log_ratio_clamp_in_objectives_or_metrics():
    # Issue 9: every clamp uses objectives.ratios.LOG_RATIO_CLAMP (a bare 20 once drifted in train/).
    offenders = []
    for path in [*(PKG / "objectives").glob("*.py"), *(PKG / "metrics").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and type(node.value) in (int, float) and abs(node.value) == 20:
                offenders.append(f"{path.name}: {path.read_text().splitlines()[node.lineno - 1].strip()}")
    assert offenders == ["ratios.py: LOG_RATIO_CLAMP = 20.0"], offenders  # the constant itself
