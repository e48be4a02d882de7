"""Mesh builder and parameter sharding rules (docs/contracts.md "sharding"), on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_mismatch.models import sharding as sh

# Tiny dims that every mesh axis used below (2 or 4) divides, except where a test says otherwise.
V, D, H, HKV, HD, F = 64, 16, 4, 2, 4, 32


def contract_shapes(arch: str, tied: bool, layers: int = 2) -> dict[str, tuple[int, ...]]:
    """Parameter paths and shapes exactly as the table in docs/contracts.md lists them."""
    shapes = {"embed/embedding": (V, D), "final_norm/scale": (D,)}
    for i in range(layers):
        pre = f"layers/{i}/"
        shapes |= {
            pre + "input_norm/scale": (D,),
            pre + "post_attn_norm/scale": (D,),
            pre + "attn/q_proj/kernel": (D, H * HD),
            pre + "attn/k_proj/kernel": (D, HKV * HD),
            pre + "attn/v_proj/kernel": (D, HKV * HD),
            pre + "attn/o_proj/kernel": (H * HD, D),
            pre + "mlp/gate_proj/kernel": (D, F),
            pre + "mlp/up_proj/kernel": (D, F),
            pre + "mlp/down_proj/kernel": (F, D),
        }
        if arch == "qwen2":
            shapes |= {
                pre + "attn/q_proj/bias": (H * HD,),
                pre + "attn/k_proj/bias": (HKV * HD,),
                pre + "attn/v_proj/bias": (HKV * HD,),
            }
        if arch == "qwen3":
            shapes |= {pre + "attn/q_norm/scale": (HD,), pre + "attn/k_norm/scale": (HD,)}
    if not tied:
        shapes["lm_head/kernel"] = (D, V)
    return shapes


def nest(flat: dict[str, object]) -> dict:
    """{"a/0/b": x} -> {"a": {0: {"b": x}}} (integer layer keys, as nnx.List gives)."""
    tree: dict = {}
    for path, leaf in flat.items():
        *parents, last = [int(k) if k.isdigit() else k for k in path.split("/")]
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return tree


def expected_spec(path: str) -> P:
    """The rule table restated independently, per layer role (what the contract asks for)."""
    role = path.split("/")[-2] + "/" + path.split("/")[-1]
    if role in ("q_proj/kernel", "k_proj/kernel", "v_proj/kernel", "gate_proj/kernel", "up_proj/kernel"):
        return P("fsdp", "tensor")
    if role in ("o_proj/kernel", "down_proj/kernel", "embed/embedding"):
        return P("tensor", "fsdp")
    if role == "lm_head/kernel":
        return P("fsdp", "tensor")
    if role.endswith("_proj/bias"):
        return P("tensor")
    assert role.endswith("norm/scale"), role
    return P(None)


@pytest.fixture(scope="module")
def mesh222():
    return sh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


# ------------------------------------------------------------------------------------------- mesh


@pytest.mark.parametrize(
    "config, shape",
    [
        ({"data": -1, "fsdp": 1, "tensor": 1}, (8, 1, 1)),
        ({"data": -1}, (8, 1, 1)),
        ({"fsdp": -1, "tensor": 2}, (1, 4, 2)),
        ({"data": 2, "fsdp": 2, "tensor": -1}, (2, 2, 2)),
        ({"tensor": 4, "data": 2}, (2, 1, 4)),  # dict order does not matter; axis order is fixed
        ({"fsdp": 8}, (1, 8, 1)),
    ],
)
def test_make_mesh_resolves_sizes(config, shape):
    mesh = sh.make_mesh(config)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert tuple(mesh.shape.values()) == shape
    assert mesh.devices.shape == shape
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    # Auto axes (built with jax.sharding.Mesh, not jax.make_mesh, whose Explicit axes change op typing).
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_make_mesh_on_given_devices():
    devices = jax.devices()[4:]
    mesh = sh.make_mesh({"fsdp": -1}, devices=devices)
    assert mesh.devices.shape == (1, 4, 1)
    assert {d.id for d in mesh.devices.flat} == {4, 5, 6, 7}


@pytest.mark.parametrize(
    "config, match",
    [
        ({"data": 2, "fsdp": 2, "tensor": 1}, r"needs 4 devices .* but 8 devices are available"),
        ({"data": 4, "fsdp": 4}, r"needs 16 devices .* but 8 devices"),
        ({"data": -1, "fsdp": 3}, r"use 3 devices, which does not divide the 8 available"),
        ({"data": -1, "tensor": -1}, r"only one axis may be -1"),
        ({"data": 0, "fsdp": -1}, r"axis 'data' has size 0"),
        ({"data": 2.0, "fsdp": -1}, r"axis 'data' has size 2.0"),
        ({"data": -1, "pipeline": 1}, r"unknown axis \['pipeline'\]"),  # "expert" is an axis since issue 11
    ],
)
def test_make_mesh_bad_config_names_config_and_devices(config, match):
    with pytest.raises(ValueError, match=match) as err:
        sh.make_mesh(config)
    assert str(config) in str(err.value)


# ------------------------------------------------------------------------------------------ rules


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_rules_cover_every_contract_param(arch, tied, mesh222):
    shapes = contract_shapes(arch, tied)
    for path, shape in shapes.items():
        spec = sh.param_partition_spec(path, shape, mesh222)
        assert len(spec) == len(shape), (path, spec)  # spelled out in full
        assert spec == expected_spec(path), (path, spec)
        assert sh.param_partition_spec(path, shape) == expected_spec(path)  # mesh-free form
    # The weight matrices are split over both fsdp and tensor: 1/4 of each on every device.
    tree = nest({p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in shapes.items()})
    shardings = sh.param_shardings(tree, mesh222)
    flat = {sh.tree_path(k): v for k, v in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    assert set(flat) == set(shapes)
    for path, sharding in flat.items():
        assert isinstance(sharding, NamedSharding) and sharding.mesh is mesh222
        if len(shapes[path]) == 2:
            shard = sharding.shard_shape(shapes[path])
            assert np.prod(shard) * 4 == np.prod(shapes[path]), (path, shard)


def test_indivisible_dim_falls_back_to_replicated():
    mesh = sh.make_mesh({"fsdp": 2, "tensor": 4})
    # 10 vocab rows do not divide by tensor=4: that dim is replicated, the fsdp dim still sharded.
    assert sh.param_partition_spec("embed/embedding", (10, 16), mesh) == P(None, "fsdp")
    # 2 KV heads x head_dim 1 = 2 columns on tensor=4, 5 input rows on fsdp=2: nothing sharded.
    assert sh.param_partition_spec("layers/0/attn/k_proj/kernel", (5, 2), mesh) == P(None, None)
    assert sh.param_partition_spec("layers/0/attn/k_proj/bias", (6,), mesh) == P(None)
    assert sh.param_partition_spec("lm_head/kernel", (16, 12), mesh) == P("fsdp", "tensor")
    # The fallback keeps jit happy: placing an array on it works.
    x = jax.device_put(jnp.zeros((10, 16)), NamedSharding(mesh, P(None, "fsdp")))
    assert x.addressable_shards[0].data.shape == (10, 8)


def test_unmatched_path_raises_naming_it():
    with pytest.raises(ValueError, match=r"no sharding rule matches parameter 'layers/0/mlp/fc1/kernel'"):
        sh.param_partition_spec("layers/0/mlp/fc1/kernel", (4, 4))
    # A partial match is not a match: the whole path must fit a rule.
    with pytest.raises(ValueError, match=r"'encoder/embed/embedding'"):
        sh.param_partition_spec("encoder/embed/embedding", (4, 4))
    tree = {"embed": {"embedding": jnp.zeros((4, 4))}, "router": {"kernel": jnp.zeros((4, 2))}}
    with pytest.raises(ValueError, match=r"'router/kernel'"):
        sh.param_shardings(tree, sh.make_mesh({"data": -1}))


def test_rank_mismatch_raises():
    with pytest.raises(ValueError, match=r"'final_norm/scale' has shape \(4, 4\)"):
        sh.param_partition_spec("final_norm/scale", (4, 4))


def test_tree_path_names_parameters_and_checkpoint_leaves():
    """One leaf naming: the contract path without an nnx Variable's `.value` (sharding rules, HF names), and with
    it the spelling checkpoint layout records and fingerprints are keyed by (old checkpoints must keep matching)."""
    from flax import nnx

    from jaxrl_mismatch.train.checkpoint import state_layout

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    tree = {"params": {"layers": [nnx.state(model, nnx.Param)]}}
    paths = [keys for keys, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert [sh.tree_path(k) for k in paths] == ["params/layers/0/bias", "params/layers/0/kernel"]
    assert [sh.tree_path(k, keep_value=True) for k in paths] == ["params/layers/0/bias/value",
                                                                  "params/layers/0/kernel/value"]
    assert [sh.tree_path(k, keep_value=True) for k in paths] == [
        jax.tree_util.keystr(k, simple=True, separator="/") for k in paths]
    assert list(state_layout(tree)) == ["params/layers/0/bias/value", "params/layers/0/kernel/value"]


def test_param_shardings_places_dict_tree(mesh222):
    shapes = contract_shapes("qwen2", tied=False, layers=1)
    rng = np.random.default_rng(0)
    tree = nest({p: jnp.asarray(rng.normal(size=s), jnp.float32) for p, s in shapes.items()})
    placed = jax.device_put(tree, sh.param_shardings(tree, mesh222))
    q = placed["layers"][0]["attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P("fsdp", "tensor")
    assert {s.data.shape for s in q.addressable_shards} == {(D // 2, H * HD // 2)}
    o = placed["layers"][0]["attn"]["o_proj"]["kernel"]
    assert {s.data.shape for s in o.addressable_shards} == {(H * HD // 2, D // 2)}
    bias = placed["layers"][0]["attn"]["q_proj"]["bias"]
    assert {s.data.shape for s in bias.addressable_shards} == {(H * HD // 2,)}
    norm = placed["final_norm"]["scale"]
    assert norm.sharding.is_fully_replicated
    jax.tree.map(np.testing.assert_array_equal, placed, tree)  # values unchanged
    assert placed["lm_head"]["kernel"].sharding.spec == P("fsdp", "tensor")


def test_batch_and_replicated_shardings(mesh222):
    batch = sh.batch_sharding(mesh222)
    assert batch.spec == P(("data", "fsdp"), None)
    x = jax.device_put(jnp.zeros((8, 6), jnp.int32), batch)
    assert {s.data.shape for s in x.addressable_shards} == {(2, 6)}  # 4 batch groups x 2 tensor replicas
    assert sh.batch_sharding(mesh222, ndim=3).spec == P(("data", "fsdp"), None, None)
    with pytest.raises(ValueError, match="ndim"):
        sh.batch_sharding(mesh222, ndim=0)
    assert sh.replicated(mesh222).spec == P()
    assert sh.replicated(mesh222).is_fully_replicated


# ------------------------------------------------------------------------- the real model, sharded


def tiny_config(arch: str, tied: bool):
    from jaxrl_mismatch.models.config import ModelConfig

    name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    return ModelConfig.from_hf(
        {
            "architectures": [name],
            "vocab_size": V,
            "hidden_size": D,
            "intermediate_size": F,
            "num_hidden_layers": 2,
            "num_attention_heads": H,
            "num_key_value_heads": HKV,
            "head_dim": HD,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": tied,
            "max_position_embeddings": 64,
        }
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_rules_cover_every_model_param(arch, tied, mesh222):
    """The model's real parameter tree has exactly the contract's paths, and every one gets a rule."""
    from flax import nnx

    from jaxrl_mismatch.models.model import Transformer
    from jaxrl_mismatch.precision import policy

    cfg = tiny_config(arch, tied)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, policy("fp32"), rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    shardings = sh.param_shardings(params, mesh222)
    flat = {sh.tree_path(k): v for k, v in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    shapes = {sh.tree_path(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert shapes == contract_shapes(arch, tied)
    for path, sharding in flat.items():
        assert sharding.spec == expected_spec(path), path


def _batch(seed: int = 0, batch: int = 8, seq: int = 12):
    """Token batch with left padding (rows 0-3), right padding (rows 4-5) and full rows (6-7)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(batch, seq + 1), dtype=np.int32)
    mask = np.ones((batch, seq + 1), np.int32)
    for row, n in enumerate([3, 5, 1, 7]):
        mask[row, :n] = 0
    mask[4, -4:] = 0
    mask[5, -2:] = 0
    tokens = np.where(mask == 1, tokens, 0)
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]), jnp.asarray(mask[:, :-1])


@pytest.mark.parametrize(
    "arch, tied, mesh_config",
    [
        ("llama", False, {"data": 2, "fsdp": 2, "tensor": 2}),
        ("qwen2", False, {"fsdp": 8}),
        ("qwen3", True, {"data": 2, "fsdp": 2, "tensor": 2}),
    ],
)
def test_sharded_token_logprobs_match_single_device(arch, tied, mesh_config):
    from flax import nnx

    from jaxrl_mismatch.models.scoring import token_logprobs
    from jaxrl_mismatch.models.model import Transformer
    from jaxrl_mismatch.precision import policy

    cfg = tiny_config(arch, tied)
    model = Transformer(cfg, policy("fp32"), rngs=nnx.Rngs(1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    input_ids, targets, mask = _batch()

    def forward(params, input_ids, targets, mask):
        return token_logprobs(nnx.merge(graphdef, params, rest), input_ids, targets, mask, chunk_size=5)

    one_device = jax.devices()[0]
    ref_logp, ref_ent = jax.jit(forward)(*jax.device_put((params, input_ids, targets, mask), one_device))
    assert ref_logp.sharding.device_set == {one_device}

    mesh = sh.make_mesh(mesh_config)
    p_sh, b_sh = sh.param_shardings(params, mesh), sh.batch_sharding(mesh)
    sharded_params = jax.device_put(params, p_sh)
    sharded_forward = jax.jit(forward, in_shardings=(p_sh, b_sh, b_sh, b_sh), out_shardings=(b_sh, b_sh))
    logp, ent = sharded_forward(sharded_params, *jax.device_put((input_ids, targets, mask), b_sh))

    # The parameters really are split: q kernel over fsdp x tensor, embedding over tensor x fsdp.
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
    q = sharded_params["layers"][0]["attn"]["q_proj"]["kernel"][...]
    assert q.sharding.spec == P("fsdp", "tensor")
    assert {s.data.shape for s in q.addressable_shards} == {(D // fsdp, H * HD // tensor)}
    down = sharded_params["layers"][1]["mlp"]["down_proj"]["kernel"][...]
    assert {s.data.shape for s in down.addressable_shards} == {(F // tensor, D // fsdp)}
    emb = sharded_params["embed"]["embedding"][...]
    assert emb.sharding.spec == P("tensor", "fsdp")
    assert {s.data.shape for s in emb.addressable_shards} == {(V // tensor, D // fsdp)}
    assert logp.sharding.spec == P(("data", "fsdp"), None) and len(logp.sharding.device_set) == 8

    np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=0)
    valid = np.asarray(mask, bool)
    assert np.all(np.asarray(ref_logp)[valid] < 0) and np.all(np.asarray(ref_logp)[~valid] == 0)


def test_shard_model_places_params_in_place():
    from flax import nnx

    from jaxrl_mismatch.models.model import Transformer
    from jaxrl_mismatch.precision import policy

    model = Transformer(tiny_config("qwen2", False), policy("fp32"), rngs=nnx.Rngs(2))
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))

    mesh = sh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert sh.shard_model(model, mesh) is model
    params = nnx.state(model, nnx.Param)
    for keys, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = sh.tree_path(keys)
        assert leaf.sharding.mesh is mesh and leaf.sharding.spec == expected_spec(path), path
    bias = model.layers[0].attn.k_proj.bias[...]
    assert {s.data.shape for s in bias.addressable_shards} == {(HKV * HD // 2,)}
    jax.tree.map(np.testing.assert_array_equal, params, before)  # moved, not changed
