"""Qwen3-MoE (issue 11): parity with transformers' `Qwen3MoeForCausalLM`, HF I/O and weight sync, the
dropless grouped dispatch, routing replay, scanned layers, decode, and the load-balancing loss.

Each checkpoint is a tiny random HF model (`moe_tiny.py`, every parameter redrawn) saved with
`save_pretrained` (per-expert tensor names on disk) and loaded with `load_hf`. Measured on this CPU
(2026-11): fp32 max |Δ log p| vs transformers ≈ 1e-6 on left/right/un-padded rows; aux loss equal to 1e-7.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open
from tests.models.hf_tiny import hf_token_logprobs, padded_batch, positions, real_positions
from tests.models.moe_tiny import make_moe_model, tiny_moe_config

from jaxrl_mismatch.models import ModelConfig, Transformer, load_hf, positions_from_mask, save_hf, token_logprobs
from jaxrl_mismatch.models.hf_io import check_model_files, hf_to_params, params_to_hf
from jaxrl_mismatch.models.kv_cache import decode_step, init_cache, prefill
from jaxrl_mismatch.models.moe import grouped_experts, load_balancing_loss, route
from jaxrl_mismatch.precision import policy

# (tied, HF config overrides): all layers sparse with renormalised top-k; a dense middle layer
# (mlp_only_layers) without renormalisation; every second layer sparse (decoder_sparse_step = 2).
VARIANTS = {
    "all_sparse": {},
    "mlp_only_layers": dict(mlp_only_layers=[1], norm_topk_prob=False),
    "sparse_step_2": dict(decoder_sparse_step=2, num_experts_per_tok=3),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(variant: str, tied: bool):
        if (variant, tied) not in cache:
            hf = make_moe_model(tied, seed=3 * list(VARIANTS).index(variant) + int(tied), **VARIANTS[variant])
            d = tmp_path_factory.mktemp(f"moe_{variant}_{tied}")
            hf.save_pretrained(d)
            cache[variant, tied] = d, hf
        return cache[variant, tied]

    return get


# One jitted function for the file: a model of a layout seen before (another load of the same checkpoint, a
# round trip) reuses its program instead of compiling a new closure's.
_token_logprobs = jax.jit(lambda m, a, b, c: token_logprobs(m, a, b, c, chunk_size=5))
# The MoE forward as one program (op by op it compiles one small program per op and shape).
_forward_routed = jax.jit(lambda m, tokens, pos, mask, routing: m.forward_routed(tokens, pos, mask, routing=routing))


def _logprobs(model, tokens, mask):
    logp, _ = _token_logprobs(model, tokens[:, :-1], tokens[:, 1:], mask[:, :-1])
    return np.asarray(logp, np.float64)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_logprobs_match_transformers(checkpoints, variant, tied):
    d, hf = checkpoints(variant, tied)
    cfg, model = load_hf(d, policy=policy("fp32"))
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.tie_word_embeddings == tied
    want_sparse = [i for i in range(3) if hf.model.layers[i].mlp.__class__.__name__ == "Qwen3MoeSparseMoeBlock"]
    assert list(cfg.sparse_layers) == want_sparse
    tokens, mask = padded_batch(seed=1)  # full, left-padded and right-padded rows
    ref = hf_token_logprobs(hf, tokens, mask)
    err = np.abs(_logprobs(model, tokens, mask) - ref)[real_positions(mask)].max()
    assert err <= 2e-5, f"{variant} tied={tied}: max |Δ logp| = {err:.3g}"


@pytest.mark.parametrize("variant", ["all_sparse", "mlp_only_layers"])
def test_load_balancing_loss_matches_transformers(checkpoints, variant):
    """Switch Transformer eqs. 4–6 as HF's `load_balancing_loss_func` computes them (padding masked)."""
    d, hf = checkpoints(variant, False)
    _, model = load_hf(d, policy=policy("fp32"))
    tokens, mask = padded_batch(seed=2)
    with torch.no_grad():
        out = hf(input_ids=torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(mask).long(),
                 position_ids=torch.from_numpy(positions(mask)).long(), output_router_logits=True)
    _, router = _forward_routed(model, tokens, positions_from_mask(mask), mask, None)
    assert router.expert_ids.shape == (4, tokens.shape[1], len(model.cfg.sparse_layers), 2)
    np.testing.assert_allclose(float(jax.jit(load_balancing_loss)(router)), float(out.aux_loss), rtol=1e-5)
    # The router's choices equal HF's top-k on the real tokens (first sparse layer).
    logits = out.router_logits[0].reshape(4, tokens.shape[1], -1)
    hf_top = torch.topk(torch.softmax(logits, -1), 2, dim=-1).indices.numpy()
    ours = np.asarray(router.router_ids[:, :, 0])
    real = mask == 1
    assert np.array_equal(np.sort(ours, -1)[real], np.sort(hf_top, -1)[real])


def test_checkpoint_round_trip_and_weight_sync(checkpoints, tmp_path):
    """save_hf writes HF's per-expert names (transformers loads them back to the same log-probs);
    params_to_hf / hf_to_params (the weight-sync wire format) round-trip exactly."""
    d, hf = checkpoints("mlp_only_layers", False)
    cfg, model = load_hf(d, policy=policy("fp32"))
    check_model_files(d, cfg)  # the headers-only check a job runs first agrees with load_hf on HF's MoE names
    save_hf(model, cfg, tmp_path / "out")
    with safe_open(str(d / "model.safetensors"), "np") as a, safe_open(str(tmp_path / "out/model.safetensors"), "np") as b:
        names = set(a.keys())
        assert names == set(b.keys())
        for name in names:
            np.testing.assert_array_equal(a.get_tensor(name), b.get_tensor(name), err_msg=name)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    tokens, mask = padded_batch(seed=3)
    real = real_positions(mask)
    np.testing.assert_allclose(hf_token_logprobs(again, tokens, mask)[real], hf_token_logprobs(hf, tokens, mask)[real],
                               atol=1e-6)

    params = nnx.state(model, nnx.Param)
    wire = params_to_hf(params, cfg)
    assert wire["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (32, 64)
    assert wire["model.layers.0.mlp.gate.weight"].shape == (8, 64)
    back = hf_to_params(wire, cfg, params)
    jax.tree.map(np.testing.assert_array_equal, back, params)
    wire.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight'"):
        hf_to_params(wire, cfg, params)


@pytest.mark.slow
def test_scanned_layers_equal_unrolled_and_mixed_layers_are_refused(checkpoints, tmp_path):
    d, _ = checkpoints("all_sparse", False)
    _, unrolled = load_hf(d, policy=policy("fp32"))
    _, scanned = load_hf(d, policy=policy("fp32"), scan_layers=True, remat="full")
    tokens, mask = padded_batch(seed=4)
    np.testing.assert_allclose(_logprobs(scanned, tokens, mask), _logprobs(unrolled, tokens, mask), atol=1e-6)
    # Gradients too (the router gets gradients through the gate weights).
    def grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            m = nnx.merge(graphdef, p, rest)
            return jnp.sum(token_logprobs(m, tokens[:, :-1], tokens[:, 1:], mask[:, :-1], chunk_size=5)[0])

        return params_to_hf(jax.jit(jax.grad(loss))(params), model.cfg)

    g_scan, g_unroll = grads(scanned), grads(unrolled)
    assert set(g_scan) == set(g_unroll)
    for name in g_unroll:
        np.testing.assert_allclose(g_scan[name], g_unroll[name], atol=2e-5, err_msg=name)
    assert np.abs(g_unroll["model.layers.1.mlp.gate.weight"]).max() > 0
    # Round trip of the scanned layout through HF names.
    save_hf(scanned, scanned.cfg, tmp_path / "scanned")
    _, again = load_hf(tmp_path / "scanned", policy=policy("fp32"))
    np.testing.assert_array_equal(_logprobs(again, tokens, mask), _logprobs(unrolled, tokens, mask))

    d_mixed, _ = checkpoints("mlp_only_layers", False)
    with pytest.raises(ValueError, match="scan_layers=True needs every layer of one kind.*sparse: \\[0, 2\\]"):
        load_hf(d_mixed, policy=policy("fp32"), scan_layers=True)


def _naive_moe(x, ids, gates, wg, wu, wd):
    """Σ_slots g · SwiGLU_e(x), token by token in float64 (the definition, no sorting)."""
    x, gates = np.asarray(x, np.float64), np.asarray(gates, np.float64)
    wg, wu, wd = (np.asarray(w, np.float64) for w in (wg, wu, wd))
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            a = x[n] @ wg[e]
            out[n] += gates[n, j] * ((a / (1 + np.exp(-a))) * (x[n] @ wu[e])) @ wd[e]
    return out


_grouped_experts = jax.jit(grouped_experts)  # as the model runs it, one program for every call below


def test_grouped_dispatch_is_dropless_and_never_materialises_token_expert_ffn():
    rng = np.random.default_rng(0)
    n, d, f, e, k = 24, 6, 10, 5, 2
    x = rng.normal(size=(n, d)).astype(np.float32)
    wg, wu = (rng.normal(size=(e, d, f)).astype(np.float32) * 0.5 for _ in range(2))
    wd = rng.normal(size=(e, f, d)).astype(np.float32) * 0.5
    gates = rng.uniform(size=(n, k)).astype(np.float32)
    for ids in (rng.integers(0, e, size=(n, k)),  # random
                np.stack([np.zeros(n), np.ones(n)], 1),  # every token on experts 0 and 1: no capacity, no drops
                np.full((n, k), 4)):  # both slots on the same expert
        ids = jnp.asarray(ids, jnp.int32)
        y = _grouped_experts(x, ids, gates, wg, wu, wd)
        np.testing.assert_allclose(np.asarray(y), _naive_moe(x, np.asarray(ids), gates, wg, wu, wd), rtol=2e-5,
                                   atol=2e-5)
    # Ids of another device's experts (outside [0, e)) contribute nothing.
    ids = jnp.asarray(rng.integers(-3, e + 3, size=(n, k)), jnp.int32)
    local = (np.asarray(ids) >= 0) & (np.asarray(ids) < e)
    ref = _naive_moe(x, np.where(local, ids, 0), gates * local, wg, wu, wd)
    np.testing.assert_allclose(np.asarray(_grouped_experts(x, ids, gates, wg, wu, wd)), ref, rtol=2e-5, atol=2e-5)

    # No intermediate of the forward or backward has N·E·F elements (the dense one-hot formulation's size).
    jaxpr = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(grouped_experts(x, ids, gates, w, wu, wd))))(wg)
    sizes = []

    def walk(jx):
        for eqn in jx.eqns:
            sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert max(sizes) < n * e * f, max(sizes)


def test_route_topk_and_replay_semantics():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(7, 6)), jnp.float32)
    p = np.asarray(jax.nn.softmax(logits, -1), np.float64)
    ids, g, probs, own = route(logits, 3, norm_topk_prob=True)
    top = np.argsort(-p, -1)[:, :3]
    assert np.array_equal(np.asarray(ids), top) and np.array_equal(np.asarray(own), top)
    np.testing.assert_allclose(np.asarray(g), np.take_along_axis(p, top, -1) / np.take_along_axis(p, top, -1).sum(-1, keepdims=True), rtol=1e-6)
    # Replay: the selection is forced, the weights are the current p over the forced ids (renormalised).
    forced = jnp.asarray(rng.integers(0, 6, size=(7, 3)), jnp.int32)
    ids, g, _, own = route(logits, 3, norm_topk_prob=True, forced_ids=forced)
    assert np.array_equal(np.asarray(ids), np.asarray(forced)) and np.array_equal(np.asarray(own), top)
    sel = np.take_along_axis(p, np.asarray(forced), -1)
    np.testing.assert_allclose(np.asarray(g), sel / sel.sum(-1, keepdims=True), rtol=1e-6)
    _, g, _, _ = route(logits, 3, norm_topk_prob=False, forced_ids=forced)
    np.testing.assert_allclose(np.asarray(g), sel, rtol=1e-6)
    # Forced experts with no float32 probability left: gates 0, not 0 / 0 = NaN.
    _, g, _, _ = route(jnp.asarray([[120.0, 0, 0, 0]]), 2, norm_topk_prob=True, forced_ids=jnp.asarray([[1, 2]]))
    assert np.array_equal(np.asarray(g), np.zeros((1, 2), np.float32))


def test_replaying_the_own_routing_is_the_identity_and_other_routing_changes_the_output(checkpoints):
    d, _ = checkpoints("mlp_only_layers", False)
    _, model = load_hf(d, policy=policy("fp32"))
    tokens, mask = padded_batch(seed=5)
    pos = positions_from_mask(mask)
    hidden, router = _forward_routed(model, tokens, pos, mask, None)
    replayed, router2 = _forward_routed(model, tokens, pos, mask, router.expert_ids)
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(hidden))
    np.testing.assert_array_equal(np.asarray(router2.expert_ids), np.asarray(router.expert_ids))
    other = (router.expert_ids + 1) % model.cfg.num_experts
    moved, router3 = _forward_routed(model, tokens, pos, mask, other)
    assert np.array_equal(np.asarray(router3.expert_ids), np.asarray(other))
    assert np.array_equal(np.asarray(router3.router_ids[:, :, 0]), np.asarray(router.router_ids[:, :, 0]))
    assert np.abs(np.asarray(moved - hidden)).max() > 1e-3
    with pytest.raises(ValueError, match=r"routing has shape .* needs \[batch, seq, sparse layers, k\]"):
        _forward_routed(model, tokens, pos, mask, router.expert_ids[:, :, :1])


@pytest.mark.slow
def test_kv_decode_matches_full_forward_with_routing(checkpoints):
    """Prefill + cached decode give the full forward's logits and each token's routing (fp32). Every forward is
    jitted, as the engine runs them (op by op, the MoE forwards took most of this test's time)."""
    d, _ = checkpoints("mlp_only_layers", False)
    _, model = load_hf(d, policy=policy("fp32"))
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, 256, size=(2, 9)).astype(np.int32)  # numpy: slicing it compiles nothing
    mask = np.ones_like(tokens)

    @nnx.jit
    def full(model, tokens, mask):
        positions = positions_from_mask(mask)
        return model.logits(model(tokens, positions, mask)), model.forward_routed(tokens, positions, mask)[1]

    @nnx.jit(static_argnames="block")
    def cached_routing(model, token, position, k, v, key_mask, index, block):
        return model.forward_cached_routed(token, position, k, v, key_mask, index, block=block)[3]

    full_logits, full_router = full(model, tokens, mask)
    cache = init_cache(model.cfg, 2, 16)
    logits, cache = nnx.jit(prefill)(model, tokens[:, :5], mask[:, :5], cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full_logits[:, 4]), atol=1e-5)
    step = nnx.jit(decode_step)
    for t in range(5, 9):
        r = cached_routing(model, tokens[:, t:t + 1], cache.next_position[:, None], cache.k, cache.v,
                           cache.key_mask.at[:, t].set(True), cache.index, block=cache.block)
        assert np.array_equal(np.asarray(r.expert_ids[:, 0]), np.asarray(full_router.expert_ids[:, t]))
        logits, cache = step(model, tokens[:, t], cache)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(full_logits[:, t]), atol=1e-5)


def test_config_from_hf_and_refusals():
    d = tiny_moe_config(False, mlp_only_layers=[1]).to_dict()
    d["architectures"] = ["Qwen3MoeForCausalLM"]
    cfg = ModelConfig.from_hf(d)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.sparse_layers == (0, 2) and cfg.qk_norm and cfg.is_moe
    assert ModelConfig.from_hf({**cfg.to_hf(), "architectures": ["Qwen3MoeForCausalLM"]}) == cfg
    for key, value, match in (("num_experts_per_tok", 9, "num_experts_per_tok=9 must be in \\[1, num_experts=8\\]"),
                              ("moe_intermediate_size", 0, "moe_intermediate_size=0 must be >= 1"),
                              ("mlp_only_layers", [5], "mlp_only_layers=\\[5\\]: layer 5 is outside")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf({**d, key: value})
    bad = {k: v for k, v in d.items() if k not in ("num_experts", "num_local_experts")}
    with pytest.raises(ValueError, match="missing num_experts"):
        ModelConfig.from_hf(bad)
    model = nnx.eval_shape(lambda: Transformer(cfg, policy("fp32"), rngs=nnx.Rngs(0)))  # the structure, no weights
    assert [layer.sparse for layer in model.layers] == [True, False, True]
