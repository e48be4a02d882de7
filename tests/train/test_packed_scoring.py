"""`make_packed_scorer` (train/packed_scoring.py) computes `make_scorer`'s log-probs, on packed rows."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import Transformer
from jaxrl_mismatch.models.scoring import make_scorer
from jaxrl_mismatch.models.sharding import make_mesh
from jaxrl_mismatch.train.compiles import count_compilations
from jaxrl_mismatch.train.packed_scoring import make_packed_scorer
from jaxrl_mismatch.train.state import split_model
from tests.train.tiny_policy import synthetic_batch, tiny_config


@pytest.fixture(scope="module")
def policy():
    model = Transformer(tiny_config(), precision.policy("fp32", param_dtype="float32"), rngs=nnx.Rngs(0))
    return split_model(model)


@pytest.fixture(scope="module")
def unpacked_scorer(policy):
    """`make_scorer` without a mesh at temperature 1: one jitted function (pure) for the tests that compare with
    it, so a shape two tests score is traced and compiled once."""
    return make_scorer(policy[0], None, chunk_size=8)


@pytest.mark.parametrize("devices", [0, 1, 2])
def test_packed_scorer_equals_unpacked(policy, devices):
    graphdef, params = policy
    mesh = make_mesh({"data": -1}, devices=jax.devices()[:devices]) if devices else None
    b = synthetic_batch(batch=8, seq=16, seed=3)
    tokens, mask, response = b["tokens"], b["attention_mask"], b["response_mask"]
    ref, ref_ent = (np.asarray(x) for x in make_scorer(graphdef, mesh, chunk_size=8, temperature=0.7)(params, tokens, mask))
    with count_compilations("packed_fn") as packed_compiles:
        got, got_ent = (np.asarray(x) for x in make_packed_scorer(graphdef, mesh, chunk_size=8, temperature=0.7)(
            params, tokens, mask))
    assert packed_compiles["compiles"] == 1  # the packed forward ran
    assert got.shape == ref.shape
    # Every target with a real token on both sides: the same value; the rest (padding) 0.
    valid = (mask[:, :-1] == 1) & (mask[:, 1:] == 1)
    assert np.abs(ref[valid]).min() > 0.1  # the comparison sees real log-probs
    np.testing.assert_allclose(got[valid], ref[valid], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_ent[valid], ref_ent[valid], atol=1e-5, rtol=0)
    assert np.all(got[~valid] == 0)
    np.testing.assert_allclose(got * response, ref * response, atol=1e-5, rtol=0)


def test_packed_scorer_row_buckets_bound_the_compiles(policy):
    """Batches of one shape but different lengths pack into at most `row_buckets` packed shapes."""
    graphdef, params = policy
    fn = make_packed_scorer(graphdef, None, chunk_size=8, row_buckets=2)
    with count_compilations("packed_fn") as c:
        for seed in range(6):
            fn(params, *(synthetic_batch(batch=8, seq=16, prompt_len=3, seed=seed)[k] for k in ("tokens", "attention_mask")))
    assert 1 <= c["compiles"] <= 2


def test_packed_scorer_with_kept_counts_scores_unpacked(policy, unpacked_scorer):
    """Truncated sampling's kept-set sizes are not carried by packed rows: the unpacked scorer answers, exactly."""
    graphdef, params = policy
    b = synthetic_batch(batch=8, seq=16, seed=5)  # the other tests' shape: `full` below shares their program
    kept = np.full((8, 15), 7, np.int32)
    ref = np.asarray(unpacked_scorer(params, b["tokens"], b["attention_mask"], kept)[0])
    with count_compilations("packed_fn") as c:
        got = np.asarray(make_packed_scorer(graphdef, None, chunk_size=8)(params, b["tokens"], b["attention_mask"], kept)[0])
    assert c["compiles"] == 0
    np.testing.assert_array_equal(got, ref)
    full = np.asarray(unpacked_scorer(params, b["tokens"], b["attention_mask"])[0])
    assert np.abs(full - ref).max() > 1e-3  # kept changes the values: it reached the scorer


def test_behaviour_scorer_on_the_packed_scorer_scores_each_row_with_its_version(policy, unpacked_scorer):
    """π_behav (train/behaviour.py) through the packed scorer: each lagged row scored with its version's
    weights, as through the unpacked one; unlagged rows 0."""
    from jaxrl_mismatch.train.batch import RolloutBatch
    from jaxrl_mismatch.train.behaviour import BehaviourScorer
    from jaxrl_mismatch.train.row_scoring import score_rows

    graphdef, params = policy
    b = synthetic_batch(batch=8, seq=16, seed=7)
    batch = RolloutBatch(**b, rollout_logp=np.zeros_like(b["response_mask"]),
                         version_lag=np.array([0, 1, 2, 1, 0, 2, 2, 1], np.int32))
    # On the host (numpy): an eager jnp multiply would compile a program per weight shape.
    versions = {v: jax.tree.map(lambda x, v=v: np.asarray(x) * np.float32(1.0 + 0.2 * v), params) for v in (1, 2, 3)}
    outs = {}
    for name, forward in (("unpacked", unpacked_scorer), ("packed", make_packed_scorer(graphdef, None, chunk_size=8))):

        def score(p, rb, rows, forward=forward, packed=name == "packed"):
            return score_rows(forward, p, rb.tokens, rb.attention_mask, rows, packed=packed) * rb.response_mask

        scorer = BehaviourScorer(2, score)
        for v, p in versions.items():
            scorer.remember(v, p)
        outs[name] = scorer.behav_logp(batch)
    np.testing.assert_allclose(outs["packed"], outs["unpacked"], atol=1e-5, rtol=0)
    lag = batch.version_lag
    assert np.all(outs["packed"][lag == 0] == 0)
    # Rows one behind are scored with version 2, rows two behind with version 1: not interchangeable.
    with_v1 = unpacked_scorer(versions[1], b["tokens"], b["attention_mask"])[0]
    with_v1 = np.asarray(with_v1) * b["response_mask"]
    np.testing.assert_allclose(outs["packed"][lag == 2], with_v1[lag == 2], atol=1e-5, rtol=0)
    assert np.abs(outs["packed"][lag == 1] - with_v1[lag == 1]).max() > 1e-3
