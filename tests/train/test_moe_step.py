"""MoE in the jitted step (issue 11): routing replay in `prepare` and the update, the load-balancing term, and the
`moe/*` metrics against a NumPy reference.

A tiny random Qwen3-MoE `Transformer` (2 sparse layers, 8 experts, top-2, router at its 0.02 init so top-k
choices are near ties and move when θ moves). The update uses SGD with lr 1 and no clipping, so
θ_old − θ_new is the gradient itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.metrics import metrics_config, moe_metric_names, moe_step_metrics
from jaxrl_mismatch.models import Transformer, logprobs_from_hidden, positions_from_mask
from jaxrl_mismatch.models.moe import load_balancing_loss
from jaxrl_mismatch.models.sharding import make_mesh
from jaxrl_mismatch.objectives import objective_config
from jaxrl_mismatch.schedules import make_optimizer
from jaxrl_mismatch.train.batch import RolloutBatch
from jaxrl_mismatch.train.objective import PolicyLoss
from jaxrl_mismatch.train.state import init_state, split_model
from jaxrl_mismatch.train.step import jit_prepare, make_prepare_fn, make_update_fn, place_batch
from tests.train.tiny_policy import synthetic_batch, tiny_config

LAYERS, K, EXPERTS = (0, 1), 2, 8


def moe_config():
    return tiny_config(architecture="Qwen3MoeForCausalLM", num_experts=EXPERTS, num_experts_per_tok=K,
                       moe_intermediate_size=16, norm_topk_prob=True)


@pytest.fixture(scope="module")
def policy():
    model = Transformer(moe_config(), precision.policy("fp32", param_dtype="float32"), rngs=nnx.Rngs(0))
    graphdef, params = split_model(model)
    return graphdef, params


@pytest.fixture(scope="module")
def host_batch():
    b = synthetic_batch(batch=8, seq=16, seed=3)
    rng = np.random.default_rng(7)
    b["rollout_logp"] = (-rng.uniform(0.5, 3.0, size=b["response_mask"].shape) * b["response_mask"]).astype(np.float32)
    return b


@pytest.fixture(scope="module")
def engine_routing(host_batch):
    """An "engine" routing: k distinct random experts per token and layer, 0 on padding."""
    rng = np.random.default_rng(1)
    b, s = host_batch["tokens"].shape
    engine = np.argsort(rng.random((b, s, len(LAYERS), EXPERTS)), axis=-1)[..., :K].astype(np.int32)
    return engine * host_batch["attention_mask"][:, :, None, None]


def _loss(aux: float = 0.0) -> PolicyLoss:
    cfg = objective_config("grpo")
    return PolicyLoss(cfg=cfg, metrics_cfg=metrics_config(cfg), router_aux_coef=aux)


_JITTED: dict = {}  # one jitted function per (kind, option): jit then reuses its trace per batch structure
_OPT = make_optimizer("sgd", learning_rate=1.0, max_grad_norm=None)


def _prepare(graphdef, params, batch: RolloutBatch, replay: str, split_routing: bool = False):
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    key = ("prepare", replay, split_routing)
    if key not in _JITTED:
        _JITTED[key] = jit_prepare(make_prepare_fn(graphdef, _loss(), chunk_size=8, routing_replay=replay,
                                                   moe_layers=LAYERS, split_routing=split_routing), mesh)
    out, metrics = _JITTED[key](params, None, place_batch(batch, mesh), jax.random.key_data(jax.random.key(0)))
    return jax.tree.map(np.asarray, out), {k: float(v) for k, v in metrics.items()}


def _grad(graphdef, params, batch: RolloutBatch, aux: float = 0.0, microbatches: int = 1):
    """(gradient, stats) of one update: SGD at lr 1 without clipping, so θ − θ' is the gradient."""
    state = init_state(params, _OPT, precision.loss_scale_for(precision.policy("fp32")), seed=0)
    key = ("update", aux, microbatches)
    if key not in _JITTED:
        _JITTED[key] = jax.jit(make_update_fn(graphdef, _OPT, _loss(aux), num_microbatches=microbatches,
                                              max_grad_norm=None, chunk_size=8))
    new, stats = _JITTED[key](state, batch)
    grad = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, new.params)
    return grad, {k: float(v) for k, v in stats.items()}


@functools.partial(jax.jit, static_argnums=0)
def _reference_forwards(graphdef, params, tokens, mask, response_mask, routing):
    """(π(θ) under `routing`, θ's own routing ids), outside the step; one program instead of one per eager op."""
    model = nnx.merge(graphdef, params)
    ids, m = tokens[:, :-1], mask[:, :-1]
    hidden = model(ids, positions_from_mask(m), m, routing=routing[:, :-1])
    logp = logprobs_from_hidden(model, hidden, tokens[:, 1:], m, chunk_size=8)[0] * response_mask
    _, router = model.forward_routed(ids, positions_from_mask(m), m)
    return logp, router.expert_ids


def _own_routing(graphdef, params, batch, engine):
    """θ's own top-k experts on `batch` (`engine` only fills the program's routed half; its output is unused)."""
    return np.asarray(_reference_forwards(graphdef, params, batch.tokens, batch.attention_mask, batch.response_mask,
                                          engine)[1])


def _max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _router_kernels(tree):
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    out = [np.asarray(x) for path, x in leaves if "router" in jax.tree_util.keystr(path)]
    assert len(out) == len(LAYERS)
    return out


def _sets_differ(a, b, valid):
    return np.any(np.sort(a, -1) != np.sort(b, -1), axis=(-2, -1))[valid]


def test_r3_prepare_replays_the_engine_routing_and_the_update_follows_it(policy, host_batch, engine_routing):
    graphdef, params = policy
    engine = engine_routing
    batch = RolloutBatch(**host_batch, routing=engine)
    r3, m3 = _prepare(graphdef, params, batch, "R3")
    off, m_off = _prepare(graphdef, params, batch, "off")
    valid = host_batch["attention_mask"][:, :-1].astype(bool)
    assert r3.routing is None and off.routing is None and off.replay_routing is None  # the update never reads it
    np.testing.assert_array_equal(r3.replay_routing[:, :-1][valid], engine[:, :-1][valid])
    # π(θ_old) under the engine's routing is the routed forward's, not the free one's.
    want = np.asarray(_reference_forwards(graphdef, params, host_batch["tokens"], host_batch["attention_mask"],
                                          host_batch["response_mask"], engine)[0])
    assert np.max(np.abs(r3.old_logp - want)) <= 1e-6
    assert np.max(np.abs(r3.old_logp - off.old_logp)) > 1e-3
    # The trainer's own router disagrees with random ids almost everywhere (1 − 1/28 per layer by chance).
    assert m3["moe/router_disagree_frac"] > 0.8 and m_off["moe/router_disagree_frac"] > 0.8
    assert set(moe_metric_names(LAYERS, with_rollout=True)) <= set(m3)
    # The θ forward of the update replays it too: another gradient than routing freely.
    g_r3, _ = _grad(graphdef, params, r3)
    g_off, _ = _grad(graphdef, params, off.replace(old_logp=r3.old_logp))
    assert _max_diff(g_r3, g_off) > 1e-4


def test_r3_reference_forward_replays_the_same_routing_so_the_kl_is_zero_at_the_reference(policy, host_batch,
                                                                                           engine_routing):
    """With free routing in the reference forward and the engine's experts in the θ forwards, KL(π_θ ‖ π_ref) was
    not 0 at θ = θ_ref: the penalty pulled the tokens whose routing the engine flipped towards the trainer's."""
    graphdef, params = policy
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    prepare = jit_prepare(make_prepare_fn(graphdef, _loss(), chunk_size=8, routing_replay="R3", moe_layers=LAYERS),
                          mesh)
    batch = place_batch(RolloutBatch(**host_batch, routing=engine_routing), mesh)
    out, _ = prepare(params, params, batch, jax.random.key_data(jax.random.key(0)))
    mask = host_batch["response_mask"] > 0
    np.testing.assert_allclose(np.asarray(out.ref_logp)[mask], np.asarray(out.old_logp)[mask], rtol=0, atol=1e-6)


def test_bypass_splits_rho_by_routing_with_the_theta_old_forward(policy, host_batch, engine_routing):
    """proximal="bypass" hands prepare μ as old_logp: the split of ρ = π(θ_old)/μ by routing agreement read
    ρ = 1 everywhere (both halves 0) while the router disagreed on most tokens."""
    graphdef, params = policy
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    batch = RolloutBatch(**host_batch, routing=engine_routing)
    out = {}
    for proximal in ("recompute", "bypass"):
        cfg = objective_config("grpo", proximal=proximal)
        prepare = jit_prepare(make_prepare_fn(graphdef, PolicyLoss(cfg=cfg, metrics_cfg=metrics_config(cfg)),
                                              chunk_size=8, routing_replay="off", moe_layers=LAYERS), mesh)
        given = batch.replace(old_logp=batch.rollout_logp) if proximal == "bypass" else batch  # as the Learner does
        out[proximal] = prepare(params, None, place_batch(given, mesh), jax.random.key_data(jax.random.key(0)))[1]
    assert float(out["recompute"]["moe/rho_std_routing_disagreed"]) > 0  # random engine ids: (almost) all disagree
    for half in ("agreed", "disagreed"):
        key = f"moe/rho_std_routing_{half}"
        np.testing.assert_allclose(float(out["bypass"][key]), float(out["recompute"][key]), rtol=1e-6)


def test_r2_replays_theta_old_routing_in_the_update(policy, host_batch, engine_routing):
    graphdef, params = policy
    batch = RolloutBatch(**host_batch)
    r2, metrics = _prepare(graphdef, params, batch, "R2")
    # "off" drops an engine routing (the R3 test checks it), so it may ride along: the R3 test's program is reused.
    off, _ = _prepare(graphdef, params, batch.replace(routing=engine_routing), "off")
    valid = host_batch["attention_mask"][:, :-1].astype(bool)
    own = _own_routing(graphdef, params, batch, engine_routing)
    np.testing.assert_array_equal(r2.replay_routing[:, :-1][valid], own[valid])
    assert r2.replay_routing.dtype == np.uint8  # models.moe.routing_dtype(8 experts), not int32
    assert "moe/router_disagree_frac" not in metrics and metrics["moe/router_entropy"] > 0  # no engine routing
    np.testing.assert_allclose(r2.old_logp, off.old_logp, atol=1e-6)  # R2's θ_old forward routes freely
    # At θ = θ_old, replaying θ_old's routing is routing freely: the same gradient.
    g_r2, _ = _grad(graphdef, params, r2)
    g_off, _ = _grad(graphdef, params, off)
    assert _max_diff(g_r2, g_off) <= 1e-5
    # After a large step θ routes some tokens elsewhere; R2 then keeps θ_old's experts and the gradient changes.
    theta = jax.tree.map(lambda p, g: np.asarray(p) - np.float32(30.0) * g, params, g_off)
    moved = _sets_differ(_own_routing(graphdef, theta, batch, engine_routing), own, valid)
    assert 0 < moved.mean() < 1, moved.mean()
    g_r2, _ = _grad(graphdef, theta, r2)
    g_off, _ = _grad(graphdef, theta, off)
    assert _max_diff(g_r2, g_off) > 1e-4


def test_async_routing_split_puts_each_disagreement_on_staleness_or_precision(policy, host_batch, engine_routing):
    """Asynchronous rows: θ_behav (the weights a lagged row was sampled with) is θ_old moved by a large step.
    Lagged rows get a perfect engine at θ_behav (engine ids = θ_behav's own), the others a random engine; so every
    disagreement of a lagged row is staleness and every one of a fresh row is precision, and the two parts add up
    to `router_disagree_frac` exactly. Checked against the definition, not only the sum."""
    graphdef, params = policy
    batch = RolloutBatch(**host_batch)
    off, _ = _prepare(graphdef, params, batch.replace(routing=engine_routing), "off")
    g, _ = _grad(graphdef, params, off)
    behav_params = jax.tree.map(lambda p, g: np.asarray(p) - np.float32(30.0) * g, params, g)
    behav = _own_routing(graphdef, behav_params, batch, engine_routing).astype(np.uint8)  # [B, S-1, L, k]
    own = _own_routing(graphdef, params, batch, engine_routing)
    lag = np.array([1, 1, 1, 1, 0, 0, 0, 0], np.int32)
    stale = lag > 0
    engine = engine_routing.copy()
    engine[stale, :-1] = behav[stale] * host_batch["attention_mask"][stale, :-1, None, None]
    given = batch.replace(routing=engine, version_lag=lag, behav_routing=np.where(stale[:, None, None, None], behav, 0))
    _, m = _prepare(graphdef, params, given, "off", split_routing=True)
    _, m_sync = _prepare(graphdef, params, batch.replace(routing=engine), "off")  # synchronous: no split
    # An asynchronous step with no lagged row (no behav_routing): θ_behav = θ_old, all of it is precision.
    _, m_fresh = _prepare(graphdef, params, batch.replace(routing=engine, version_lag=0 * lag), "off",
                          split_routing=True)
    assert m_fresh["moe/router_disagree_staleness_frac"] == 0
    # Without an engine routing (vLLM returns none) the staleness part is still reported, alone.
    _, m_vllm = _prepare(graphdef, params, given.replace(routing=None), "off", split_routing=True)
    assert m_vllm["moe/router_disagree_staleness_frac"] == m["moe/router_disagree_staleness_frac"]
    assert not any(k.startswith("moe/router_disagree") and "staleness" not in k for k in m_vllm)
    assert m_fresh["moe/router_disagree_precision_frac"] == pytest.approx(m_fresh["moe/router_disagree_frac"], abs=1e-7)
    mask = host_batch["response_mask"] > 0

    def layer_frac(a, b, rows):  # mean over layers of the share of all response positions differing in `rows`
        differs = np.sort(a, -1) != np.sort(b, -1)
        return np.mean([np.sum(np.any(differs[..., j, :], -1) & mask & rows[:, None]) / mask.sum()
                        for j in range(len(LAYERS))])

    staleness, precision_ = layer_frac(own, behav, stale), layer_frac(own, engine[:, :-1], ~stale)
    assert staleness > 0.1 and precision_ > 0.1, (staleness, precision_)  # both parts really occur
    assert m["moe/router_disagree_staleness_frac"] == pytest.approx(staleness, abs=1e-6)
    assert m["moe/router_disagree_precision_frac"] == pytest.approx(precision_, abs=1e-6)
    assert m["moe/router_disagree_staleness_frac"] + m["moe/router_disagree_precision_frac"] == pytest.approx(
        m["moe/router_disagree_frac"], abs=1e-6)
    assert m["moe/router_disagree_frac"] == m_sync["moe/router_disagree_frac"]  # the unsplit metric is unchanged
    names = moe_metric_names(LAYERS, with_rollout=True, with_lag=True)
    assert set(names) <= set(m) and not any("staleness" in k or "precision" in k for k in m_sync)
    # Token level: "any layer" of each part, each on its own rows.
    any_stale = _sets_differ(own, behav, mask) & np.broadcast_to(stale[:, None], mask.shape)[mask]
    assert m["moe/router_disagree_staleness_token_frac"] == pytest.approx(any_stale.mean(), abs=1e-6)


def test_aux_coef_adds_the_load_balancing_gradient(policy, host_batch, engine_routing):
    graphdef, params = policy
    # The engine routing rides along only to reuse the R3 test's "off" program; "off" drops it.
    batch, _ = _prepare(graphdef, params, RolloutBatch(**host_batch, routing=engine_routing), "off")
    coef = 0.5
    g0, s0 = _grad(graphdef, params, batch)
    g1, s1 = _grad(graphdef, params, batch, aux=coef)
    value, g_lb = _lb_value_and_grad(graphdef, params, batch.tokens, batch.attention_mask)
    assert s0["mean:moe/aux_loss"] == pytest.approx(float(value), rel=1e-5)  # logged also at coef 0
    assert s1["mean:moe/aux_loss"] == pytest.approx(float(value), rel=1e-5)
    assert s1["mean:loss/total"] == pytest.approx(s0["mean:loss/total"] + coef * float(value), rel=1e-5, abs=1e-6)
    for k0, k1, klb in zip(_router_kernels(g0), _router_kernels(g1), _router_kernels(g_lb)):
        assert np.max(np.abs(k1 - k0)) > 1e-4
        np.testing.assert_allclose(k1 - k0, coef * klb, atol=1e-5)
    # Two microbatches: each computes it over its own tokens, weighted by its share of the valid tokens.
    _, s2 = _grad(graphdef, params, batch, aux=coef, microbatches=2)
    n_all = float(np.sum(batch.attention_mask[:, :-1]))
    halves = [float(np.sum(part.attention_mask[:, :-1])) / n_all * _lb_of(graphdef, params, part)
              for part in (jax.tree.map(lambda x: x[:4], batch), jax.tree.map(lambda x: x[4:], batch))]
    assert s2["mean:moe/aux_loss"] == pytest.approx(sum(halves), rel=1e-5)


def _lb(graphdef, params, tokens, mask):
    model = nnx.merge(graphdef, params)
    ids, m = tokens[:, :-1], mask[:, :-1]
    return load_balancing_loss(model.forward_routed(ids, positions_from_mask(m), m)[1])


# Jitted once at module level (graphdef static): op by op the MoE forward cost ~15 s, and a jit per call recompiles.
_lb_jit = jax.jit(_lb, static_argnums=0)
_lb_value_and_grad = jax.jit(jax.value_and_grad(_lb, argnums=1), static_argnums=0)


def _lb_of(graphdef, params, batch) -> float:
    return float(_lb_jit(graphdef, params, batch.tokens, batch.attention_mask))


# -- moe_step_metrics against NumPy -------------------------------------------------------------------------
def _reference(router_ids, entropy, load, old_logp, rollout_logp, mask, rollout_ids):
    m = mask.astype(bool)
    out = {"moe/router_entropy": entropy[m].mean()}
    mom = load.max(-1) / load.mean(-1)
    out["moe/load_max_over_mean"], out["moe/load_max_over_mean_max"] = mom.mean(), mom.max()
    out["moe/load_cv"] = (load.std(-1) / load.mean(-1)).mean()
    b, t, layers, _ = router_ids.shape
    differs = np.zeros((b, t, layers), bool)
    for i in range(b):
        for j in range(t):
            for l in range(layers):
                differs[i, j, l] = set(router_ids[i, j, l]) != set(rollout_ids[i, j, l])
    fracs = [differs[..., l][m].mean() for l in range(layers)]
    out["moe/router_disagree_frac"] = np.mean(fracs)
    for l, f in zip((3, 5, 9), fracs):
        out[f"moe/router_disagree_frac_layer{l}"] = f
    anyd = differs.any(-1)
    out["moe/router_disagree_token_frac"] = anyd[m].mean()
    r = np.exp(old_logp - rollout_logp)
    out["moe/rho_std_routing_agreed"] = r[m & ~anyd].std()
    out["moe/rho_std_routing_disagreed"] = r[m & anyd].std()
    return out


def _random_inputs(seed=0, b=4, t=7, layers=3, k=2, experts=6):
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((b, t, layers, experts)), -1)[..., :k].astype(np.int32)
    other = ids.copy()
    flip = rng.random((b, t, layers)) < 0.3
    other[flip] = np.argsort(rng.random((int(flip.sum()), experts)), -1)[:, :k]
    other[..., ::-1] = other.copy()  # same sets in another slot order must count as agreement
    entropy = rng.uniform(0.1, 1.5, (b, t, layers)).astype(np.float32)
    load = rng.integers(1, 20, (layers, experts)).astype(np.float32)
    old = -rng.uniform(0.1, 3.0, (b, t)).astype(np.float32)
    roll = (old + rng.normal(0, 0.2, (b, t))).astype(np.float32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    return ids, entropy, load, old, roll, mask, other


def _jit_in_order(fn, **jit_kw):
    """`fn` jitted, its dict output in the order `fn` built it (jit's pytree flattening sorts dict keys)."""
    order = {}

    @functools.wraps(fn)
    def traced(*args, **kw):
        out = fn(*args, **kw)
        order[tuple(sorted(out))] = list(out)
        return out

    jitted = jax.jit(traced, **jit_kw)

    def call(*args, **kw):
        out = jitted(*args, **kw)
        return {k: out[k] for k in order[tuple(out)]}

    return call


# Jitted as the step runs it (one program per shape instead of one per eager op); layer_ids is static there too.
_metrics = _jit_in_order(moe_step_metrics, static_argnames="layer_ids")


def test_moe_metrics_match_numpy_and_ignore_padding():
    ids, entropy, load, old, roll, mask, other = _random_inputs()
    got = _metrics(jnp.asarray(ids), jnp.asarray(entropy), jnp.asarray(load), jnp.asarray(old),
                   jnp.asarray(roll), jnp.asarray(mask), layer_ids=(3, 5, 9), rollout_ids=jnp.asarray(other))
    want = _reference(ids, entropy, load, old, roll, mask, other)
    assert list(got) == moe_metric_names((3, 5, 9), with_rollout=True)
    for k, v in want.items():
        assert float(got[k]) == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
    assert 0 < float(got["moe/router_disagree_frac"]) < 1
    # Padding positions with garbage change nothing.
    pad = lambda x, fill: np.concatenate([x, np.full((x.shape[0], 3) + x.shape[2:], fill, x.dtype)], axis=1)  # noqa: E731
    padded = _metrics(jnp.asarray(pad(ids, 1)), jnp.asarray(pad(entropy, 9.0)), jnp.asarray(load),
                      jnp.asarray(pad(old, -7.0)), jnp.asarray(pad(roll, 0.0)), jnp.asarray(pad(mask, 0.0)),
                      layer_ids=(3, 5, 9), rollout_ids=jnp.asarray(pad(other, 4)))
    for k in want:
        assert float(padded[k]) == pytest.approx(float(got[k]), rel=1e-6, abs=1e-7), k


def test_moe_metrics_empty_sets_are_zero_not_nan():
    ids, entropy, load, old, roll, mask, _ = _random_inputs(seed=2)
    got = _metrics(jnp.asarray(ids), jnp.asarray(entropy), jnp.asarray(np.zeros_like(load)),
                   jnp.asarray(old), jnp.asarray(roll), jnp.asarray(mask), layer_ids=(3, 5, 9),
                   rollout_ids=jnp.asarray(ids[..., ::-1]))
    assert float(got["moe/router_disagree_frac"]) == 0.0 and float(got["moe/rho_std_routing_disagreed"]) == 0.0
    assert float(got["moe/rho_std_routing_agreed"]) > 0 and float(got["moe/load_cv"]) == 0.0
    assert all(np.isfinite(float(v)) for v in got.values())
    with pytest.raises(ValueError, match="layer_ids has 2 entries for 3 sparse layers"):
        _metrics(jnp.asarray(ids), jnp.asarray(entropy), jnp.asarray(load), jnp.asarray(old),
                 jnp.asarray(roll), jnp.asarray(mask), layer_ids=(0, 1))


@pytest.mark.parametrize("replay", ["R2", "R3"])
def test_moe_prepare_scores_in_row_blocks_with_the_same_routing_metrics_and_a_blocks_memory(
        policy, engine_routing, replay):
    """A MoE policy's θ_old forward in `prepare` ran the whole step batch at once (the 30B config's step too).
    Routing is dropless, each token's experts independent of the other rows, so it runs in the update's row blocks:
    the same log-probs, replayed routing and `moe/*` metrics (loads are summed over the blocks), one block's
    memory."""
    graphdef, params = policy
    host = synthetic_batch(batch=32, seq=16, seed=3)
    host["rollout_logp"] = (-np.random.default_rng(7).uniform(0.5, 3.0, size=host["response_mask"].shape)
                            * host["response_mask"]).astype(np.float32)
    routing = np.concatenate([engine_routing] * 4)  # the fixture's 8 rows of engine ids, for 32 rows
    mesh = make_mesh({"data": 2}, devices=jax.devices()[:2])
    batch = place_batch(RolloutBatch(**host, routing=routing), mesh)
    key = jax.random.key_data(jax.random.key(0))
    out, metrics, temp = {}, {}, {}
    for blocks in (1, 4):
        prep = jit_prepare(make_prepare_fn(graphdef, _loss(), chunk_size=8, routing_replay=replay,
                                           moe_layers=LAYERS, row_blocks=blocks, mesh=mesh), mesh)
        temp[blocks] = prep.lower(params, None, batch, key).compile().memory_analysis().temp_size_in_bytes
        b, m = prep(params, None, batch, key)
        out[blocks], metrics[blocks] = jax.tree.map(np.asarray, b), {k: float(v) for k, v in m.items()}
    np.testing.assert_allclose(out[4].old_logp, out[1].old_logp, rtol=0, atol=2e-6)
    valid = host["attention_mask"].astype(bool)
    np.testing.assert_array_equal(out[4].replay_routing[valid], out[1].replay_routing[valid])
    assert set(moe_metric_names(LAYERS, with_rollout=True)) <= set(metrics[1]) and metrics[4].keys() == metrics[1].keys()
    for k, v in metrics[1].items():
        assert metrics[4][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert temp[4] < 0.5 * temp[1], temp


def test_routing_rows_keep_the_engines_narrow_ids():
    """The engines send uint8 expert ids (uint16 past 256 experts); the batch widened them to int32, 4x the memory:
    32 GB for one [B, S, L, k] array at the Qwen3-30B-A3B config's step (2,048 rows x 10,240 tokens x 48 x 8)."""
    from jaxrl_mismatch.models.moe import routing_dtype
    from jaxrl_mismatch.train.batch import routing_rows

    assert routing_dtype(128) == np.uint8 and routing_dtype(257) == np.uint16
    rows = [np.full((3, 2, 2), 7, np.uint8), np.full((5, 2, 2), 255, np.uint8)]
    out = routing_rows(rows, 6)
    assert out.dtype == np.uint8 and out.shape == (2, 6, 2, 2)
    assert out[0, :3].min() == 7 and out[0, 3:].max() == 0 and out[1, :5].min() == 255
    assert routing_rows([r.astype(np.uint16) for r in rows], 6).dtype == np.uint16
    assert routing_rows([r.astype(np.int64) for r in rows], 6).dtype == np.int32  # a signed source: as before
    with pytest.raises(ValueError, match="routing: expert ids must be integers, got float32"):
        routing_rows([r.astype(np.float32) for r in rows], 6)
