"""Sequence packing in the update step (`trainer.packing`, issue 12 item 3) and the update step's memory at
the lengths the configs name.

- The jitted update on a packed minibatch equals the unpacked update (the gradient, every statistic), with microbatches and on a data × fsdp mesh; the packing really uses fewer token slots.
- `prepare`'s θ_old and reference forwards on a packed batch (one group per shard) equal the unpacked ones.
- Through `Learner` (the loop's path): `trainer.packing = True` gives the same policy as False.
- XLA's compiled temp memory of the whole update step (forward, backward, AdamW) grows ~linearly in the
  sequence length up to 8192 tokens with the default (`auto`: chunked) attention.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch.metrics import metrics_config
from jaxrl_mismatch.models.sharding import batch_axes
from jaxrl_mismatch.objectives import objective_config
from jaxrl_mismatch.train.batch import RolloutBatch
from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_checks import check_model, validate
from jaxrl_mismatch.train.objective import PolicyLoss
from jaxrl_mismatch.train.packing import pack_batch, packed_layout
from jaxrl_mismatch.train.step import jit_update, place_batch, place_state
from tests.train.tiny_policy import build, synthetic_batch


def _host_batch(mesh, old_lp, params, rows=16, seq=40, seed=3) -> RolloutBatch:
    """Uneven lengths (7..40 tokens of 40) so packing has padding to remove."""
    b = synthetic_batch(batch=rows, seq=seq, prompt_len=5, seed=seed)
    old, _ = old_lp(params, b["tokens"], b["attention_mask"])
    old = np.asarray(old) * b["response_mask"]
    noise = np.random.default_rng(seed).normal(scale=0.05, size=old.shape).astype(np.float32)
    return RolloutBatch(**b, old_logp=old, rollout_logp=(old + noise) * b["response_mask"])


_SGD: dict = {}


def _sgd(mesh_axes, ndev, num_microbatches):
    """(mesh, host copy of the initial state, update_fn, old_lp, {layout: jitted update}) of the tiny policy under SGD
    with lr 1 and no clipping, built once per (mesh, microbatches) for the file: the tests on one configuration
    share one jitted program per batch layout instead of tracing and compiling it again for each test. Each use
    places a fresh state from the host copy (the update donates it), so no test sees another's step."""
    key = (tuple(mesh_axes.items()), ndev, num_microbatches)
    if key not in _SGD:
        mesh, _, state, update_fn, old_lp, _ = build(mesh_axes, jax.devices()[:ndev], num_microbatches=num_microbatches,
                                                     lr=1.0, optimizer="sgd", max_grad_norm=None)
        _SGD[key] = (mesh, jax.tree.map(np.array, state), update_fn, old_lp, {})
    return _SGD[key]


def _sgd_update(mesh_axes, ndev, num_microbatches, batch):
    """The configuration's jitted update for `batch`'s layout (its pytree structure: plain, or packed in so many
    groups), jitted once per layout."""
    mesh, host_state, update_fn, _, jitted = _sgd(mesh_axes, ndev, num_microbatches)
    layout = jax.tree.structure(batch)
    if layout not in jitted:
        jitted[layout] = jit_update(update_fn, place_state(host_state, mesh), batch, mesh)
    return jitted[layout]


def _run(mesh_axes, ndev, *, packed: bool, num_microbatches: int):
    """One SGD step with lr 1 and no clipping: the params move by exactly -∇, so comparing params compares
    gradients (Adam's g / (sqrt(v) + eps) would blow rounding of tiny entries up to lr scale)."""
    mesh, host_state, _, old_lp, _ = _sgd(mesh_axes, ndev, num_microbatches)
    state = place_state(host_state, mesh)
    theta0 = jax.tree.map(np.asarray, host_state.params)
    host = _host_batch(mesh, old_lp, state.params)
    if packed:
        shards = math.prod(mesh.shape[a] for a in batch_axes(mesh))
        host = pack_batch(host, num_groups=num_microbatches, shards=shards, microbatches=True)
    batch = place_batch(host, mesh)
    state, stats = _sgd_update(mesh_axes, ndev, num_microbatches, batch)(state, batch)
    grads = jax.tree.map(lambda a, b: a - np.asarray(b), theta0, state.params)
    return grads, {k: float(v) for k, v in stats.items()}, host


def _max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


@pytest.mark.parametrize("mesh_axes,ndev,micro", [({"data": 1}, 1, 1), ({"data": 1}, 1, 2),
                                                  ({"data": 2, "fsdp": 2}, 4, 2)])
def test_packed_update_equals_unpacked(mesh_axes, ndev, micro):
    g_plain, h_plain, host = _run(mesh_axes, ndev, packed=False, num_microbatches=micro)
    g_packed, h_packed, host_packed = _run(mesh_axes, ndev, packed=True, num_microbatches=micro)
    slots_packed, slots_plain = host_packed.packed.tokens.size, host.tokens.size
    if ndev == 1:
        assert slots_packed < 0.8 * slots_plain, (slots_packed, slots_plain)  # the packing removes padding
    else:  # each microbatch is spread over the shards: its rows rounded up to a multiple of them (8 sequences
        # of a microbatch over 4 devices leave nothing to save at this size), never more than unpacked
        assert host_packed.packed.tokens.shape[0] // micro % ndev == 0 and slots_packed <= slots_plain
    # The same gradient up to float rounding (attention over fewer padded keys sums in another order).
    diff, scale = _max_diff(g_plain, g_packed), _max_diff(g_plain, jax.tree.map(np.zeros_like, g_plain))
    print({"max |Δ∇| packed vs plain": diff, "max |∇|": scale})
    assert scale > 1e-3 and diff <= 1e-5 * scale
    assert set(h_plain) == set(h_packed)
    for k in h_plain:
        # B_simple = tr Σ / |G|² divides a difference of near-equal estimates: rounding shows at ~3e-5 there.
        rel = 1e-4 if k.endswith("grad/noise_scale") else 1e-5
        assert h_packed[k] == pytest.approx(h_plain[k], rel=rel, abs=1e-6), k


def test_a_wrong_unpacking_changes_the_update():
    """The packed path really feeds the loss: scrambling where targets are unpacked from changes the step."""
    mesh, host_state, _, old_lp, _ = _sgd({"data": 1}, 1, 1)
    host = pack_batch(_host_batch(mesh, old_lp, place_state(host_state, mesh).params), num_groups=1)
    idx = np.asarray(host.packed.unpack_index)
    scrambled = host.replace(packed=host.packed.replace(unpack_index=np.roll(idx, 1, axis=1)))
    update = _sgd_update({"data": 1}, 1, 1, place_batch(host, mesh))
    _, good = update(place_state(host_state, mesh), place_batch(host, mesh))
    _, bad = update(place_state(host_state, mesh), place_batch(scrambled, mesh))
    assert abs(float(good["mean:loss/total"]) - float(bad["mean:loss/total"])) > 1e-4


_PREPARE: dict = {}


def _prepare_setup(mesh_axes, ndev):
    """(mesh, θ_old, reference params, jitted prepare) per mesh, built once for the file: `prepare` donates
    nothing, so the tests on one mesh share its params and its compiled programs (one per batch layout)."""
    from jaxrl_mismatch.train.step import jit_prepare, make_prepare_fn

    key = (tuple(mesh_axes.items()), ndev)
    if key not in _PREPARE:
        mesh, graphdef, state, _, _, _ = build(mesh_axes, jax.devices()[:ndev])
        objective = PolicyLoss(cfg=objective_config("grpo"), metrics_cfg=metrics_config(objective_config("grpo")))
        prepare = jit_prepare(make_prepare_fn(graphdef, objective, chunk_size=8), mesh)
        ref = jax.tree.map(lambda x: x * 1.01, state.params)  # a reference policy unlike θ_old
        _PREPARE[key] = (mesh, state.params, ref, prepare)
    return _PREPARE[key]


def _prepare(mesh_axes, ndev, *, packed: bool, scramble: bool = False):
    """`prepare` (θ_old + reference forwards, diagnostics, step metrics) on a batch packed one group per shard."""
    mesh, params, ref, prepare = _prepare_setup(mesh_axes, ndev)
    b = synthetic_batch(batch=32, seq=40, prompt_len=5, seed=4)
    host = RolloutBatch(**b, rollout_logp=-np.abs(np.random.default_rng(0).normal(size=b["response_mask"].shape))
                        .astype(np.float32) * b["response_mask"])
    if packed:
        shards = math.prod(mesh.shape[a] for a in batch_axes(mesh))
        host = pack_batch(host, num_groups=shards, shards=shards)
        # Fewer token slots (the group that needs the most rows sets P).
        assert host.packed.tokens.size < 0.9 * host.tokens.size
        if scramble:
            host = host.replace(packed=host.packed.replace(unpack_index=np.roll(host.packed.unpack_index, 1, axis=1)))
    out, metrics = prepare(params, ref, place_batch(host, mesh), jax.random.key_data(jax.random.key(0)))
    assert out.packed is None
    return out, {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("mesh_axes,ndev", [({"data": 1}, 1), ({"data": 2, "fsdp": 2}, 4)])
def test_packed_prepare_equals_unpacked(mesh_axes, ndev):
    """θ_old and reference log-probs (and every step metric) from packed rows equal the unpacked forward."""
    plain, m_plain = _prepare(mesh_axes, ndev, packed=False)
    packed, m_packed = _prepare(mesh_axes, ndev, packed=True)
    for name in ("old_logp", "ref_logp"):
        a, b = np.asarray(getattr(plain, name)), np.asarray(getattr(packed, name))
        assert np.abs(a).max() > 1.0 and np.abs(a - b).max() <= 1e-5, name
    assert set(m_plain) == set(m_packed)
    for k in m_plain:
        assert m_packed[k] == pytest.approx(m_plain[k], rel=1e-5, abs=1e-6), k


def test_a_wrong_unpacking_changes_prepare():
    """The packed forward is the one `prepare` scores with: scrambling the unpacking changes π(θ_old)."""
    good, _ = _prepare({"data": 1}, 1, packed=True)
    bad, _ = _prepare({"data": 1}, 1, packed=True, scramble=True)
    assert np.abs(np.asarray(good.old_logp) - np.asarray(bad.old_logp)).max() > 0.1


def test_a_packing_must_split_into_the_microbatches():
    mesh, host_state, _, old_lp, _ = _sgd({"data": 1}, 1, 2)
    state = place_state(host_state, mesh)
    host = pack_batch(_host_batch(mesh, old_lp, state.params), num_groups=1)
    with pytest.raises(ValueError, match="packed in 1 groups does not split into num_microbatches=2"):
        _sgd_update({"data": 1}, 1, 2, place_batch(host, mesh))(state, place_batch(host, mesh))


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    from tests.rollout.conftest import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("packing") / "base", tied=False)


def _learner_step(base_ckpt, run_dir, **trainer):
    """A Learner on the tiny checkpoint after prepare + optimize (2 minibatches × 2 microbatches, SGD lr 1,
    a KL penalty: θ_old and reference forwards)."""
    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    c = base_config()
    c.model.path, c.run_dir = str(base_ckpt), str(run_dir)
    c.rollout.group_size, c.batch.prompts_per_step, c.trainer.chunk_size = 4, 4, 8
    c.batch.minibatches, c.batch.microbatches = 2, 2
    c.optim.name, c.optim.lr, c.optim.max_grad_norm = "sgd", 1.0, 1e9
    c.objective.kl_coef = 0.05  # a reference forward in prepare too
    for k, v in trainer.items():
        c.trainer[k] = v
    learner = Learner(learner_config(c))
    learner.theta0 = jax.tree.map(np.array, learner.state.params)  # a host copy: the update donates the state
    b = synthetic_batch(batch=16, seq=30, prompt_len=4, seed=7)
    batch, _ = learner.prepare(RolloutBatch(**b, rollout_logp=np.zeros_like(b["response_mask"])), seed=1)
    assert np.isfinite(learner.optimize(batch, seed=1)["loss/total"])
    return learner


@pytest.fixture(scope="module")
def plain(base_ckpt, tmp_path_factory):
    """The default Learner's step, shared by the two tests that compare another Learner with it (read only)."""
    return _learner_step(base_ckpt, tmp_path_factory.mktemp("plain"))


@pytest.mark.slow
def test_learner_with_packing_trains_the_same_policy(base_ckpt, plain, tmp_path, monkeypatch):
    from jaxrl_mismatch.train import learner as learner_mod

    packings = []  # (rows, groups) of every packing Learner asks for: prepare's whole batch, then each minibatch

    def spy(batch, **kw):
        packings.append((batch.num_rows, kw["num_groups"]))
        return pack_batch(batch, **kw)

    def spy_layout(tokens, attention_mask, **kw):  # a minibatch's layout, from the host batch's tokens
        packings.append((tokens.shape[0], kw["num_groups"]))
        return packed_layout(tokens, attention_mask, **kw)

    monkeypatch.setattr(learner_mod, "pack_batch", spy)
    monkeypatch.setattr(learner_mod, "packed_layout", spy_layout)
    packed = _learner_step(base_ckpt, tmp_path / "packed", packing=True)
    assert packings == [(16, packed._batch_shards), (8, 2), (8, 2)]  # prepare: a group per shard
    moved = _max_diff(jax.tree.map(np.asarray, plain.state.params),
                      jax.tree.map(np.asarray, _learner_step(base_ckpt, tmp_path / "p0").state.params))
    assert moved == 0.0  # deterministic: the comparison below is packing's doing alone
    step = _max_diff(jax.tree.map(np.asarray, plain.state.params), plain.theta0)
    diff = _max_diff(jax.tree.map(np.asarray, plain.state.params), jax.tree.map(np.asarray, packed.state.params))
    print({"max |Δθ| of the two steps": step, "max |θ_packed − θ_plain|": diff})
    assert step > 1e-2 and diff <= 1e-4 * step  # float rounding of the summation order only


@pytest.mark.slow
def test_learner_model_options_reach_the_model(base_ckpt, plain, tmp_path):
    """trainer.scan_layers / attention_impl / remat_policy build that model, and it trains the same policy."""
    from jaxrl_mismatch.models import params_to_hf

    scanned = _learner_step(base_ckpt, tmp_path / "scan", scan_layers=True, attention_impl="chunked", remat=True,
                            remat_policy="save_dots")
    model = nnx.merge(scanned._graphdef, scanned.state.params)
    assert model.scan_layers and model.attention_impl == "chunked" and model.remat == "save_dots"
    a = params_to_hf(jax.tree.map(np.asarray, plain.state.params), plain.model_cfg)
    b = params_to_hf(jax.tree.map(np.asarray, scanned.state.params), scanned.model_cfg)
    assert set(a) == set(b)
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= 1e-5


@pytest.mark.parametrize("field,value,message", [
    ("attention_impl", "flash", "config.trainer.attention_impl: 'flash' is not one of"),
    ("remat_policy", "some", "config.trainer.remat_policy: 'some' is not one of"),
])
def test_model_option_errors_name_the_field(field, value, message):
    c = base_config()
    c.trainer[field] = value
    with pytest.raises(ConfigError, match=message):
        validate(c)


def test_scan_layers_is_refused_in_exact_mode():
    c = base_config()
    c.rollout.exact, c.trainer.scan_layers = True, True
    with pytest.raises(ConfigError, match="config.trainer.scan_layers: must be False with rollout.exact"):
        validate(c)


def test_packing_is_refused_for_moe_policies():
    from tests.models.moe_tiny import make_moe_model

    c = base_config()
    c.trainer.packing = True
    with pytest.raises(ConfigError, match="config.trainer.packing: not available for the mixture-of-experts"):
        check_model(c, _moe_cfg(make_moe_model))


def _moe_cfg(make_moe_model):
    from jaxrl_mismatch.models import ModelConfig

    return ModelConfig.from_hf({**make_moe_model(False, seed=0).config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})


def _update_temp_bytes(seq: int) -> int:
    mesh, _, state, update_fn, _, _ = build({"data": 1}, jax.devices()[:1])
    b = synthetic_batch(batch=1, seq=seq, prompt_len=5)
    batch = RolloutBatch(**b, old_logp=np.zeros_like(b["response_mask"]), rollout_logp=np.zeros_like(b["response_mask"]))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)
    compiled = jit_update(update_fn, state, batch, mesh).lower(state, abstract).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_update_step_memory_grows_linearly_to_8k_tokens():
    """The configs train on 8,192-token responses: the update step's temp memory must not be S×S."""
    temp = [_update_temp_bytes(s) for s in (2048, 4096, 8192)]
    print({"update temp MiB at 2k/4k/8k": [t / 2**20 for t in temp]})
    for small, big in zip(temp, temp[1:]):
        assert big / small < 2.4, temp  # quadratic would be ~4x per doubling


def test_each_microbatch_of_a_packed_update_splits_over_the_shards():
    """The update spreads each microbatch's packed rows over all the batch shards (`step._split_rows`); a layout
    whose microbatch row count the shards did not divide (4 microbatches of 14 rows on 8 devices: only the total
    was rounded) was left unconstrained, gathered, and computed in full on every device: 44.2 against 13.0
    MFLOP per device for this policy and batch (the compiled programs' cost analysis)."""
    mesh, host_state, update_fn, old_lp, _ = _sgd({"data": -1}, 8, 4)
    host = _host_batch(mesh, old_lp, place_state(host_state, mesh).params, rows=64, seq=40)
    flops = {}
    for micro in (False, True):
        packed = pack_batch(host, num_groups=4, shards=8, microbatches=micro)
        rows = packed.packed.tokens.shape[0] // 4
        assert (rows % 8 == 0) == micro, rows  # the old rule rounded only the total (56 rows)
        batch = place_batch(packed, mesh)
        compiled = jit_update(update_fn, place_state(host_state, mesh), batch, mesh).lower(
            place_state(host_state, mesh), batch).compile()
        cost = compiled.cost_analysis()
        flops[micro] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert flops[True] * 2 < flops[False], flops
