"""Expert parallelism (issue 11): a Qwen3-MoE model on 8 fake CPU devices — data × expert, and fsdp × expert ×
tensor — gives the 1-device log-probs and gradients; expert weights really are split over `expert`; the
expert FFN runs under shard_map (all-gather of the expert group's tokens, reduce-scatter of the outputs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl_mismatch.models import ModelConfig, Transformer, token_logprobs
from jaxrl_mismatch.models import sharding as sh
from jaxrl_mismatch.models.hf_io import load_hf, params_to_hf, save_hf
from jaxrl_mismatch.precision import policy

E, D, F = 8, 16, 8


def moe_config(**overrides) -> ModelConfig:
    kw = dict(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=D, intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
              rope_theta=1e6, rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
              max_position_embeddings=64, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=F,
              norm_topk_prob=True, mlp_only_layers=(1,))
    return ModelConfig(**{**kw, **overrides})


def _batch(rows: int = 8, seq: int = 12):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, size=(rows, seq)).astype(np.int32)
    mask = np.ones((rows, seq), np.int32)
    mask[1, :3] = 0  # left padding
    mask[2, 8:] = 0  # right padding
    return jnp.asarray(tokens), jnp.asarray(mask)


def _loss(params, graphdef, rest, tokens, mask):
    model = nnx.merge(graphdef, params, rest)
    logp, _ = token_logprobs(model, tokens[:, :-1], tokens[:, 1:], mask[:, :-1], chunk_size=5)
    return jnp.sum(logp), logp


_grad = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnums=1)


def _run(model, tokens, mask, mesh=None):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if mesh is not None:  # a batch that the batch axes do not divide stays replicated (MoE falls back to XLA)
        bs = sh.batch_sharding(mesh) if tokens.shape[0] % 8 == 0 else sh.replicated(mesh)
        tokens, mask = jax.device_put(tokens, bs), jax.device_put(mask, bs)
    (_, logp), grads = _grad(params, graphdef, rest, tokens, mask)
    return np.asarray(logp), params_to_hf(grads, model.cfg), (params, graphdef, rest, tokens, mask)


@pytest.mark.parametrize("mesh_config, rows", [({"data": 2, "expert": 4}, 8), ({"fsdp": 2, "expert": 2, "tensor": 2}, 8),
                                                ({"data": 2, "expert": 4}, 6)],
                         ids=["data2_expert4", "fsdp2_expert2_tensor2", "batch_not_divisible"])
def test_expert_parallel_equals_one_device(mesh_config, rows):
    cfg = moe_config()
    tokens, mask = _batch(rows)
    ref_logp, ref_grads, _ = _run(Transformer(cfg, policy("fp32"), rngs=nnx.Rngs(1)), tokens, mask)

    mesh = sh.make_mesh(mesh_config)
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    model = sh.shard_model(Transformer(cfg, policy("fp32"), rngs=nnx.Rngs(1)), mesh)
    assert model.mesh is mesh
    logp, grads, args = _run(model, tokens, mask, mesh)

    gate = nnx.state(model, nnx.Param)["layers"][0]["mlp"]["experts"]["gate_proj"][...]
    assert gate.sharding.spec == P("expert", "fsdp", "tensor")
    n_e, n_f, n_t = mesh.shape["expert"], mesh.shape["fsdp"], mesh.shape["tensor"]
    assert {s.data.shape for s in gate.addressable_shards} == {(E // n_e, D // n_f, F // n_t)}
    assert sh.batch_sharding(mesh).spec == P(("data", "fsdp", "expert"), None)

    np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=0)
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        np.testing.assert_allclose(grads[name], ref_grads[name], atol=2e-5, rtol=0, err_msg=name)
    hlo = _grad.lower(*args).compile().as_text()
    if rows % 8 == 0:  # expert parallel: tokens gathered over the expert group, outputs reduce-scattered
        assert "reduce-scatter" in hlo and "all-gather" in hlo
    assert np.all(ref_logp[np.asarray(mask[:, :-1], bool)] < 0)


def test_rules_and_meshes_without_the_expert_axis():
    """On a mesh without `expert` the experts are replicated over it (a rule naming it reads as None); the
    3-axis meshes of dense models are unchanged."""
    mesh = sh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert sh.param_partition_spec("layers/3/mlp/experts/gate_proj", (E, D, F), mesh) == P(None, "fsdp", "tensor")
    assert sh.param_partition_spec("layers/3/mlp/experts/down_proj", (E, F, D), mesh) == P(None, "tensor", "fsdp")
    assert sh.param_partition_spec("layers/3/mlp/router/kernel", (D, E), mesh) == P("fsdp", None)
    assert sh.param_partition_spec("layers/mlp/experts/up_proj", (3, E, D, F)) == P(None, "expert", "fsdp", "tensor")
    ep = sh.make_mesh({"expert": 8})
    assert sh.param_partition_spec("layers/0/mlp/experts/gate_proj", (E, D, F), ep) == P("expert", "fsdp", "tensor")
    assert sh.param_partition_spec("layers/0/mlp/experts/gate_proj", (6, D, F), ep) == P(None, "fsdp", "tensor")
    with pytest.raises(ValueError, match=r"axis 'expert' has size 0"):
        sh.make_mesh({"data": -1, "expert": 0})


def test_a_checkpoint_loaded_onto_a_mesh_runs_its_experts_expert_parallel(tmp_path):
    """The trainer loads its policy with `load_hf(..., mesh=)`, which placed the weights but left `Transformer.mesh`
    unset: the learner's MoE layers never took the `shard_map` path (XLA partitioned the plain function)."""
    cfg = moe_config()
    save_hf(Transformer(cfg, policy("fp32"), rngs=nnx.Rngs(1)), cfg, tmp_path)
    tokens, mask = _batch(8)
    _, plain = load_hf(tmp_path, policy=policy("fp32"))
    assert plain.mesh is None
    ref_logp, ref_grads, _ = _run(plain, tokens, mask)

    mesh = sh.make_mesh({"data": 2, "expert": 4})
    _, model = load_hf(tmp_path, policy=policy("fp32"), mesh=mesh)
    assert model.mesh is mesh
    logp, grads, args = _run(model, tokens, mask, mesh)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=0)
    for name in ref_grads:
        np.testing.assert_allclose(grads[name], ref_grads[name], atol=2e-5, rtol=0, err_msg=name)
    hlo = _grad.lower(*args).compile().as_text()
    assert "reduce-scatter" in hlo and "all-gather" in hlo  # the expert group's tokens in, its outputs out
