"""Scanned layers (`Transformer(scan_layers=True)`): same model as the unrolled loop, same HF names, same
sharding rules, and a program whose size does not grow with depth."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl_mismatch.models import (
    ModelConfig, Transformer, decode_step, hf_to_params, init_cache, load_hf, params_to_hf, prefill, save_hf,
    token_logprobs,
)
from jaxrl_mismatch.models import sharding as sh
from jaxrl_mismatch.precision import policy
from tests.models.hf_tiny import hf_token_logprobs, make_hf_model, padded_batch, real_positions

VOCAB = 96


def _cfg(layers: int = 3, arch: str = "Qwen3ForCausalLM", tied: bool = False) -> ModelConfig:
    return ModelConfig.from_hf(dict(
        architectures=[arch], vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4, tie_word_embeddings=tied,
    ))


def _pair(layers: int = 3, **kw) -> tuple[Transformer, Transformer]:
    """Unrolled and scanned models drawn from the same seed (hence the same weights)."""
    cfg = _cfg(layers)
    return (Transformer(cfg, policy("fp32"), rngs=nnx.Rngs(7), **kw),
            Transformer(cfg, policy("fp32"), rngs=nnx.Rngs(7), scan_layers=True, **kw))


def _host(tree):
    """On the host first: `params_to_hf` slices stacked device arrays layer by layer on the device (the bounded-
    memory weight sync, tested on sharded params below), an eager program per shape that a comparison need not pay."""
    return jax.tree.map(np.asarray, tree)


def _hf(model) -> dict[str, np.ndarray]:
    return params_to_hf(_host(nnx.state(model, nnx.Param)), model.cfg)


def _batch(seed=0, b=4, s=13):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, (b, s + 1)).astype(np.int32)
    mask = np.ones((b, s + 1), np.int32)
    mask[1, :4] = 0  # left padding
    mask[2, -5:] = 0  # right padding
    return jnp.asarray(tokens * mask), jnp.asarray(mask)


def _loss_and_grad(model):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p, tokens, mask):
        lp, ent = token_logprobs(nnx.merge(graphdef, p), tokens[:, :-1], tokens[:, 1:], mask[:, :-1], chunk_size=8)
        return -jnp.sum(lp * mask[:, 1:]) / jnp.sum(mask[:, 1:]) + 0.01 * jnp.mean(ent), lp

    return jax.jit(jax.value_and_grad(loss, has_aux=True)), params


def test_scanned_layout_has_stacked_params_with_the_same_hf_names():
    unrolled, scanned = _pair()
    paths = {sh.tree_path(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(nnx.state(scanned, nnx.Param))}
    assert paths["layers/attn/q_proj/kernel"] == (3, 32, 32)
    assert paths["layers/input_norm/scale"] == (3, 32)
    assert not any(re.match(r"layers/\d", p) for p in paths)
    a, b = _hf(unrolled), _hf(scanned)
    assert set(a) == set(b) and "model.layers.2.mlp.down_proj.weight" in b
    for name in a:  # same seed -> same weights, layer by layer
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture(scope="module")
def unrolled_reference():
    """(model, (loss, logp), grads) of the unrolled model without remat, computed once."""
    unrolled, _ = _pair()
    tokens, mask = _batch()
    fn, params = _loss_and_grad(unrolled)
    return unrolled, *fn(params, tokens, mask)


@pytest.mark.parametrize("remat", ["none", "full", "save_dots", "offload"])
def test_scanned_equals_unrolled_logprobs_and_gradients(unrolled_reference, remat):
    unrolled, (l0, lp0), g0 = unrolled_reference
    _, scanned = _pair(remat=remat)
    tokens, mask = _batch()
    (l1, lp1), g1 = (lambda f, p: f(p, tokens, mask))(*_loss_and_grad(scanned))
    np.testing.assert_allclose(lp1, lp0, atol=1e-6, rtol=0)
    np.testing.assert_allclose(float(l1), float(l0), atol=1e-6, rtol=0)
    # Per-layer names on both sides.
    ga, gb = params_to_hf(_host(g0), unrolled.cfg), params_to_hf(_host(g1), scanned.cfg)
    assert set(ga) == set(gb)
    assert max(np.abs(x).max() for x in ga.values()) > 1e-3  # the gradients are not trivially zero
    for name in ga:
        np.testing.assert_allclose(gb[name], ga[name], atol=1e-6, rtol=1e-5, err_msg=name)


def test_remat_policy_is_checked():
    with pytest.raises(ValueError, match=r"remat='some'.*'save_dots'"):
        Transformer(_cfg(), policy("fp32"), remat="some")
    with pytest.raises(ValueError, match=r"attention_impl='flash'"):
        Transformer(_cfg(), policy("fp32"), attention_impl="flash")


def test_program_size_does_not_grow_with_depth():
    """The lowered forward+backward of the scanned model is the same program for 2 and 8 layers (one
    scanned body), while the unrolled one repeats every layer."""
    tokens, mask = _batch()

    def hlo_ops(layers: int, scan: bool) -> int:
        model = Transformer(_cfg(layers), policy("fp32"), rngs=nnx.Rngs(0), scan_layers=scan, remat="full")
        fn, params = _loss_and_grad(model)
        text = fn.lower(params, tokens, mask).as_text()
        return sum(1 for line in text.splitlines() if " = " in line)

    scanned = hlo_ops(2, True), hlo_ops(8, True)
    unrolled = hlo_ops(2, False), hlo_ops(8, False)
    print({"scanned (2, 8 layers)": scanned, "unrolled (2, 8 layers)": unrolled})
    assert scanned[1] == scanned[0]
    assert unrolled[1] > 2.5 * unrolled[0]


def test_scanned_kv_cache_decode_matches_unrolled():
    unrolled, scanned = _pair()
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, VOCAB, (2, 6)).astype(np.int32)
    mask = np.ones((2, 6), np.int32)
    mask[0, :2] = 0

    def generate(model):
        graphdef, state = nnx.split(model)

        @jax.jit
        def run(state, prompt, mask):
            m = nnx.merge(graphdef, state)
            cache = init_cache(m.cfg, 2, 16, block=4)
            logits, cache = prefill(m, prompt, mask, cache)
            out = [logits]
            for _ in range(5):
                logits, cache = decode_step(m, jnp.argmax(logits, -1).astype(jnp.int32), cache)
                out.append(logits)
            return jnp.stack(out, 1)

        return np.asarray(run(state, prompt, mask))

    np.testing.assert_allclose(generate(scanned), generate(unrolled), atol=1e-5, rtol=0)


def test_hf_round_trip_scanned(tmp_path):
    """transformers checkpoint -> scanned model (parity with transformers) -> save -> reload in both layouts."""
    hf = make_hf_model("qwen2", tied=False, seed=21)
    hf.save_pretrained(tmp_path / "hf")
    cfg, scanned = load_hf(tmp_path / "hf", policy=policy("fp32"), scan_layers=True)
    assert scanned.scan_layers and scanned.layers.attn.q_proj.kernel[...].shape[0] == cfg.num_hidden_layers
    tokens, mask = padded_batch(seed=2)
    graphdef, state = nnx.split(scanned)
    f = jax.jit(lambda s, a, b, c: token_logprobs(nnx.merge(graphdef, s), a, b, c, chunk_size=8)[0])
    ours = np.asarray(f(state, tokens[:, :-1], tokens[:, 1:], mask[:, :-1]), np.float64)
    err = np.abs(ours - hf_token_logprobs(hf, tokens, mask))[real_positions(mask)].max()
    assert err <= 2e-5, f"scanned model vs transformers: max |Δ logp| = {err:.3g}"

    save_hf(scanned, cfg, tmp_path / "ours", max_shard_bytes=60_000)
    _, back_unrolled = load_hf(tmp_path / "ours", policy=policy("fp32"))
    _, back_scanned = load_hf(tmp_path / "ours", policy=policy("fp32"), scan_layers=True)
    ref = {k: v.numpy() for k, v in hf.state_dict().items()}
    for model in (back_unrolled, back_scanned):
        got = _hf(model)
        assert set(got) == set(ref)
        for name in ref:
            assert np.array_equal(got[name], ref[name]), name


@pytest.mark.parametrize("impl", ["auto", "chunked"])
def test_scanned_sharded_equals_one_device_and_wire_round_trip(impl):
    _, scanned = _pair(attention_impl=impl, attention_block=4)
    graphdef, params, rest = nnx.split(scanned, nnx.Param, ...)
    tokens, mask = _batch(b=8)

    def forward(params, tokens, mask):
        return token_logprobs(nnx.merge(graphdef, params, rest), tokens[:, :-1], tokens[:, 1:], mask[:, :-1],
                              chunk_size=8)[0]

    one = jax.devices()[0]
    ref = jax.jit(forward)(*jax.device_put((params, tokens, mask), one))
    mesh = sh.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    p_sh, b_sh = sh.param_shardings(params, mesh), sh.batch_sharding(mesh)
    placed = jax.device_put(params, p_sh)
    q = placed["layers"]["attn"]["q_proj"]["kernel"][...]
    assert q.sharding.spec == P(None, "fsdp", "tensor")
    assert {s.data.shape for s in q.addressable_shards} == {(3, 16, 16)}  # layer axis whole, D and H·hd split
    assert placed["layers"]["mlp"]["down_proj"]["kernel"][...].sharding.spec == P(None, "tensor", "fsdp")
    assert placed["layers"]["input_norm"]["scale"][...].sharding.spec == P(None, None)
    got = jax.jit(forward, in_shardings=(p_sh, b_sh, b_sh), out_shardings=b_sh)(
        placed, *jax.device_put((tokens, mask), b_sh))
    assert len(got.sharding.device_set) == 8
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)

    # Weight sync: per-layer HF names on the wire, back onto the live stacked, sharded parameters.
    wire = params_to_hf(placed, scanned.cfg)
    assert wire["model.layers.1.self_attn.q_proj.weight"].shape == (32, 32)
    back = hf_to_params(wire, scanned.cfg, placed)
    for x, y in zip(jax.tree.leaves(placed), jax.tree.leaves(back)):
        assert y.sharding == x.sharding and np.array_equal(np.asarray(x), np.asarray(y))
