"""Aggregation with a global normaliser: NumPy reference, and loss/gradient/aux invariance to microbatching,
padding and data-parallel sharding for every mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_mismatch.objectives import (
    AGGREGATIONS,
    aggregate,
    global_normalizer,
    batch_constants,
    objective_config,
    policy_loss,
)

B, T, L = 8, 6, 12
HYP = settings(max_examples=15, deadline=None)


def make_batch(seed):
    rng = np.random.default_rng(seed)
    old = -rng.exponential(1.0, size=(B, T))
    roll = np.minimum(old + 0.3 * rng.normal(size=(B, T)), 0.0)
    logp = old + 0.25 * rng.normal(size=(B, T))
    lengths = rng.integers(0, T + 1, size=B)
    lengths[0] = T
    mask = np.arange(T)[None, :] < lengths[:, None]
    adv = np.repeat(rng.normal(size=(B, 1)), T, 1)
    f = lambda x: np.where(mask, x, rng.normal(size=(B, T)) * 30).astype(np.float32)  # noqa: E731
    return f(logp), f(old), f(roll), f(adv), mask


def np_aggregate(v, mask, mode, max_len=None):
    v = np.where(mask, v.astype(np.float64), 0.0)
    rows = [i for i in range(mask.shape[0]) if mask[i].any()]
    if mode == "token-mean":
        return v.sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return sum(v[i].sum() for i in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(v[i].sum() / mask[i].sum() for i in rows) / len(rows)
    return sum(v[i].sum() / max_len for i in rows) / len(rows)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aggregate_matches_numpy(mode, seed):
    _, _, _, _, mask = make_batch(seed)
    v = np.random.default_rng(seed + 10).normal(size=(B, T)).astype(np.float32)
    v[~mask] = np.inf  # padding values must be ignored, even non-finite ones
    got = aggregate(v, mask, mode, global_normalizer(mask, mode, max_len=L))
    np.testing.assert_allclose(got, np_aggregate(v, mask, mode, L), rtol=1e-5)


def test_normalizer_errors_and_empty_batch():
    mask = np.zeros((2, 3), bool)
    with pytest.raises(ValueError, match="max_len"):
        global_normalizer(mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="valid: token-mean, seq-mean-token-sum"):
        global_normalizer(mask, "mean")
    for mode in AGGREGATIONS:
        assert float(aggregate(jnp.ones((2, 3)), mask, mode, global_normalizer(mask, mode, max_len=4))) == 0.0


VARIANTS = [
    ("grpo", {}), ("dapo", {"dual_clip": 3.0}), ("grpo_token_tis", {}), ("grpo_seq_mis", {"correction_cap": 1.5}),
    ("icepop", {"normalize_weights": True}), ("gspo", {}), ("gmpo", {}), ("pg_seq_is", {}),
    ("grpo", {"correction": "seq_mean_tis", "rejection": "k3_seq_max", "rejection_high": 0.2}),
    ("grpo_token_tis", {"rejection": "ratio_seq_mean", "rejection_low": 0.9, "rejection_high": 1.1,
                        "normalize_weights": True}),
]


def _loss_fn(cfg, old, roll, adv, mask, norm):
    def f(lp):
        return policy_loss(cfg, logp=lp, old_logp=old, rollout_logp=roll, advantages=adv, mask=mask, norm=norm)
    return jax.value_and_grad(f, has_aux=True)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@HYP
@given(seed=st.integers(0, 10_000), variant=st.sampled_from(range(len(VARIANTS))),
       cuts=st.sets(st.sampled_from([1, 2, 4, 6]), max_size=3))
def test_loss_grad_aux_invariant_to_microbatch_split(mode, seed, variant, cuts):
    preset, over = VARIANTS[variant]
    logp, old, roll, adv, mask = make_batch(seed)
    cfg = objective_config(preset, agg=mode, max_len=L, **over)
    norm = batch_constants(cfg, mask, old, roll)  # from the whole batch
    (full, full_aux), full_grad = _loss_fn(cfg, old, roll, adv, mask, norm)(jnp.asarray(logp))
    edges = [0, *sorted(cuts), B]
    total, grads, aux_sum = 0.0, [], {k: 0.0 for k in full_aux}
    for a, b in zip(edges[:-1], edges[1:]):
        (loss, aux), g = _loss_fn(cfg, old[a:b], roll[a:b], adv[a:b], mask[a:b], norm)(jnp.asarray(logp[a:b]))
        total += float(loss)
        grads.append(np.asarray(g))
        for k in aux:
            aux_sum[k] += float(aux[k])
    np.testing.assert_allclose(total, full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate(grads), full_grad, rtol=1e-5, atol=1e-8)
    for k in full_aux:
        np.testing.assert_allclose(aux_sum[k], full_aux[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@HYP
@given(seed=st.integers(0, 10_000), variant=st.sampled_from(range(len(VARIANTS))), pad=st.just(3),
       rows=st.sampled_from([0, 2]), fill=st.sampled_from([0.0, 40.0, -1e30]))
def test_appending_padding_changes_nothing(mode, seed, variant, pad, rows, fill):
    preset, over = VARIANTS[variant]
    logp, old, roll, adv, mask = make_batch(seed)
    cfg = objective_config(preset, agg=mode, max_len=L, **over)

    def padded(x, v):
        x = np.concatenate([x, np.full((B, pad), v, x.dtype)], 1)
        return np.concatenate([x, np.full((rows, T + pad), v, x.dtype)], 0)

    big = [padded(x, fill) for x in (logp, old, roll, adv)] + [padded(mask, False)]
    (l1, a1), g1 = _loss_fn(cfg, old, roll, adv, mask, batch_constants(cfg, mask, old, roll))(jnp.asarray(logp))
    lp2, old2, roll2, adv2, mask2 = big
    (l2, a2), g2 = _loss_fn(cfg, old2, roll2, adv2, mask2, batch_constants(cfg, mask2, old2, roll2))(jnp.asarray(lp2))
    # float32 sums are reordered by the new shape; terms are O(1), so compare at float32 resolution
    np.testing.assert_allclose(l2, l1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g2)[:B, :T], g1, rtol=1e-5, atol=1e-8)
    assert np.all(np.asarray(g2)[B:] == 0) and np.all(np.asarray(g2)[:, T:] == 0)
    for k in a1:
        np.testing.assert_allclose(a2[k], a1[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_data_parallel_sharding_matches_single_device(mode):
    logp, old, roll, adv, mask = make_batch(3)
    cfg = objective_config("grpo_seq_mis", agg=mode, max_len=L, normalize_weights=True)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    shard = NamedSharding(mesh, PartitionSpec("data", None))

    @jax.jit
    def step(lp, o, r, a, m):
        norm = batch_constants(cfg, m, o, r)
        return _loss_fn(cfg, o, r, a, m, norm)(lp)

    (l1, _), g1 = step(logp, old, roll, adv, mask)
    args = [jax.device_put(x, shard) for x in (logp, old, roll, adv, mask)]
    (l8, _), g8 = step(*args)
    assert g8.sharding.is_equivalent_to(shard, 2) or len(g8.sharding.device_set) == 8
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    np.testing.assert_allclose(g8, g1, rtol=1e-5, atol=1e-9)
