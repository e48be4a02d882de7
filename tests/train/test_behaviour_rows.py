"""π_behav scores only the rows of each lag (train/row_scoring.py, train/behaviour.py): per row the same
log-probs as scoring the whole batch with that lag's weights, on fewer rows, in a bounded number of shapes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import Transformer
from jaxrl_mismatch.models.scoring import make_scorer
from jaxrl_mismatch.models.sharding import make_mesh
from jaxrl_mismatch.train.batch import RolloutBatch
from jaxrl_mismatch.train.behaviour import BehaviourScorer
from jaxrl_mismatch.train.compiles import count_compilations
from jaxrl_mismatch.train.packed_scoring import make_packed_scorer
from jaxrl_mismatch.train.row_scoring import bucketed_rows, score_rows
from jaxrl_mismatch.train.state import split_model
from tests.train.tiny_policy import synthetic_batch, tiny_config

LAGS = np.array([0, 1, 2, 1, 0, 2, 2, 1], np.int32)


@pytest.fixture(scope="module")
def policy():
    model = Transformer(tiny_config(), precision.policy("fp32", param_dtype="float32"), rngs=nnx.Rngs(0))
    return split_model(model)


@pytest.fixture(scope="module")
def whole_batch_scorer(policy):
    """The reference: `make_scorer` on the whole batch, one jitted function for every case of the file (pure)."""
    return make_scorer(policy[0], None, chunk_size=8)


def _versions(params):
    """Weights of versions 1..3, far enough apart that scoring a row with the wrong one shows."""
    return {v: jax.tree.map(lambda x, v=v: x * (1.0 + 0.2 * v), params) for v in (1, 2, 3)}


@pytest.mark.parametrize("n_total,multiple,buckets", [(8, 1, 8), (64, 2, 8), (64, 8, 8), (30, 3, 4), (5, 1, 8)])
def test_bucketed_rows_bounds_the_row_counts(n_total, multiple, buckets):
    counts = [bucketed_rows(n, n_total, multiple=multiple, buckets=buckets) for n in range(1, n_total + 1)]
    assert len(set(counts)) <= buckets
    for n, m in zip(range(1, n_total + 1), counts):
        assert n <= m <= n_total
        assert m == n_total or m % multiple == 0
    assert bucketed_rows(0, n_total) == 0


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("devices", [0, 2])
def test_mixed_lags_score_each_row_with_its_version_on_its_rows_only(policy, whole_batch_scorer, packed, devices):
    """Lags 0/1/2 in one batch: every lagged row equals the whole batch scored with its version's weights
    (≤ 1e-5); lag-0 rows are never scored (π_behav = π_prox there) and read 0; the forwards see the lagged
    rows only — not one whole batch per lag, as before."""
    graphdef, params = policy
    mesh = make_mesh({"data": -1}, devices=jax.devices()[:devices]) if devices else None
    shards = devices or 1
    b = synthetic_batch(batch=8, seq=16, seed=11)
    batch = RolloutBatch(**b, rollout_logp=np.zeros_like(b["response_mask"]), version_lag=LAGS)
    forward = (make_packed_scorer if packed else make_scorer)(graphdef, mesh, chunk_size=8)
    seen = []  # (rows, real tokens) each forward was given

    def counting(p, tokens, mask, kept=None):
        seen.append((tokens.shape[0], int(np.asarray(mask).sum())))
        return forward(p, tokens, mask, kept)

    def score(p, rb, rows):
        logp = score_rows(counting, p, rb.tokens, rb.attention_mask, rows, packed=packed, multiple=shards)
        return logp * rb.response_mask

    scorer = BehaviourScorer(2, score)
    versions = _versions(params)
    for v, p in versions.items():
        scorer.remember(v, p)
    got = scorer.behav_logp(batch)

    whole = whole_batch_scorer
    for lag in (1, 2):
        ref = np.asarray(whole(versions[3 - lag], b["tokens"], b["attention_mask"])[0]) * b["response_mask"]
        rows = LAGS == lag
        assert np.abs(ref[rows]).max() > 0.1  # real log-probs compared
        np.testing.assert_allclose(got[rows], ref[rows], atol=1e-5, rtol=0)
    assert np.all(got[LAGS == 0] == 0)
    # The other version's weights give other values: each lag was scored with its own.
    v1 = np.asarray(whole(versions[1], b["tokens"], b["attention_mask"])[0]) * b["response_mask"]
    assert np.abs(got[LAGS == 1] - v1[LAGS == 1]).max() > 1e-3

    assert len(seen) == 2  # one forward per distinct lag > 0
    lagged_tokens = int(b["attention_mask"][LAGS > 0].sum())
    if packed:  # only the lagged rows' sequences are packed
        assert sum(t for _, t in seen) == lagged_tokens
    else:  # 3 rows per lag, rounded up to the shards: 6 or 8 rows where the whole batch per lag was 16
        assert sum(r for r, _ in seen) == 2 * bucketed_rows(3, 8, multiple=shards)
        assert sum(r for r, _ in seen) < 2 * 8


def test_unpacked_subsets_compile_at_most_buckets_programs(policy):
    graphdef, params = policy
    forward = make_scorer(graphdef, None, chunk_size=8)
    b = synthetic_batch(batch=8, seq=16, seed=2)
    with count_compilations("fn") as c:
        for n in range(1, 9):
            rows = np.zeros(8, bool)
            rows[np.random.default_rng(n).permutation(8)[:n]] = True
            out = score_rows(forward, params, b["tokens"], b["attention_mask"], rows, buckets=4)
            assert np.all(out[~rows] == 0) and np.any(out[rows] != 0)
    assert 1 <= c["compiles"] <= 4


def test_packed_subsets_compile_no_shape_the_whole_batch_would_not(policy):
    """A subset's packed row count is bucketed on the whole batch: `row_buckets` shapes at most, as before."""
    graphdef, params = policy
    forward = make_packed_scorer(graphdef, None, chunk_size=8, row_buckets=2)
    b = synthetic_batch(batch=8, seq=16, seed=4)
    with count_compilations("packed_fn") as c:
        for n in range(1, 9):
            rows = np.arange(8) < n
            score_rows(forward, params, b["tokens"], b["attention_mask"], rows, packed=True)
    assert 1 <= c["compiles"] <= 2


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    from tests.rollout.conftest import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("behaviour_rows") / "base", tied=False)


@pytest.mark.parametrize("mode", ["packed", "unpacked", pytest.param("exact", marks=pytest.mark.xla_full_opt)])
def test_learner_behav_logp_of_mixed_lags_equals_whole_batch_scoring(base_ckpt, tmp_path, mode):
    """Through `Learner` (what `prepare` uses): each lag's rows as scored on the whole batch — bit for bit with
    the batch-invariant exact scorer, ≤ 1e-5 otherwise."""
    from jaxrl_mismatch.train.config import base_config
    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    c = base_config()
    c.model.path, c.run_dir = str(base_ckpt), str(tmp_path / "run")
    c.rollout.group_size, c.batch.prompts_per_step, c.trainer.chunk_size = 4, 2, 8
    c.rollout.max_staleness, c.rollout.max_tokens = 2, 24
    c.trainer.packing = mode == "packed"
    c.rollout.exact = mode == "exact"
    learner = Learner(learner_config(c))
    b = synthetic_batch(batch=8, seq=24, prompt_len=4, seed=5)
    batch = RolloutBatch(**b, rollout_logp=np.zeros_like(b["response_mask"]), version_lag=LAGS)
    versions = _versions(learner.state.params)
    for v, p in versions.items():
        learner.behaviour.remember(v, p)
    got = learner.behaviour.behav_logp(batch)
    every = np.ones(8, bool)
    for lag in (1, 2):
        ref = learner._score(versions[3 - lag], batch, every)  # the whole batch, as before
        rows = LAGS == lag
        assert np.abs(ref[rows]).max() > 0.1
        if mode == "exact":
            np.testing.assert_array_equal(got[rows], ref[rows])
        else:
            np.testing.assert_allclose(got[rows], ref[rows], atol=1e-5, rtol=0)
    assert np.all(got[LAGS == 0] == 0)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """A tiny random Qwen3-MoE (2 sparse layers, 8 experts, top-2) in HF format."""
    from jaxrl_mismatch.models import hf_io

    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, norm_topk_prob=True)
    out = tmp_path_factory.mktemp("behaviour_moe") / "ckpt"
    hf_io.save_hf(Transformer(cfg, precision.policy("fp32", param_dtype="float32"), rngs=nnx.Rngs(0)), cfg, str(out))
    return out


def test_moe_learner_scores_each_lagged_row_s_routing_at_its_version_and_splits_the_routing_metrics(moe_ckpt, tmp_path):
    """A MoE policy's π_behav forward also returns its routers' own top-k at the row's version (what splits
    `moe/router_disagree_*`, metrics/moe.py): per lagged row, the ids the routed forward gives at that version's
    weights (not the current one's), 0 on lag-0 rows, in the engines' uint8; `prepare` then reports both parts."""
    from jaxrl_mismatch.metrics import moe_metric_names
    from jaxrl_mismatch.models.scoring import score_tokens
    from jaxrl_mismatch.train.config import base_config
    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    c = base_config()
    c.model.path, c.run_dir = str(moe_ckpt), str(tmp_path / "run")
    c.rollout.group_size, c.batch.prompts_per_step, c.trainer.chunk_size = 4, 2, 8
    c.rollout.max_staleness, c.rollout.max_tokens = 2, 24
    learner = Learner(learner_config(c))
    rng = np.random.default_rng(0)
    # Versions 1..3: the weights plus noise, so routers choose differently per version.
    versions = {v: jax.tree.map(lambda x: np.asarray(x) + rng.normal(0, 0.05, np.shape(x)).astype(np.float32),
                                learner.state.params) for v in (1, 2, 3)}
    for v, p in versions.items():
        learner.behaviour.remember(v, p)
    b = synthetic_batch(batch=8, seq=24, prompt_len=4, seed=5)
    batch = RolloutBatch(**b, rollout_logp=np.zeros_like(b["response_mask"]), version_lag=LAGS)
    logp, routing = learner.behaviour.behaviour(batch)
    assert routing.dtype == np.uint8 and routing.shape == (8, 23, 2, 2)
    assert np.all(routing[LAGS == 0] == 0) and np.all(logp[LAGS == 0] == 0)
    valid = b["attention_mask"][:, :-1] > 0

    def own(params):
        return np.asarray(score_tokens(learner._graphdef, params, b["tokens"], b["attention_mask"],
                                       chunk_size=8).router.router_ids)

    mine = {v: own(p) for v, p in versions.items()}
    for lag in (1, 2):
        rows = LAGS == lag
        np.testing.assert_array_equal(routing[rows][valid[rows]], mine[3 - lag][rows][valid[rows]])
        # ... and the versions' routings really differ there, so a wrong version would show
        assert np.any(np.sort(mine[3 - lag][rows], -1)[valid[rows]] != np.sort(mine[3][rows], -1)[valid[rows]])
    # Through `prepare` with an engine routing: both parts of the split, finite.
    engine = np.zeros((8, 24, 2, 2), np.uint8)
    engine[:, :-1] = mine[3].astype(np.uint8) * valid[:, :, None, None]
    _, metrics = learner.prepare(batch.replace(routing=engine), seed=0)
    for key in moe_metric_names((0, 1), with_rollout=True, with_lag=True):
        assert np.isfinite(metrics[key]), key
    assert metrics["moe/router_disagree_staleness_frac"] > 0
