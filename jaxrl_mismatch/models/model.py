"""Decoder-only transformer (Llama-3, Qwen2/2.5, Qwen3, Qwen3-MoE) as a `flax.nnx` module.

Numerics follow the Hugging Face PyTorch reference so that π computed here and μ computed by an
inference engine on the same weights differ only by the precision policy, never by a formula:

- RMSNorm (Zhang & Sennrich 2019, eq. 4: x / sqrt(mean(x²) + ε) · g) is computed in float32 and cast
  back before the gain, exactly as HF does.
- RoPE (Su et al. 2021, RoFormer eq. 34: rotate each pair (x_i, x_{i+d/2}) by angle m·θ_i with
  θ_i = base^(-2i/d)), in HF's "rotate_half" layout; angles in float32, cos/sin cast to the compute
  dtype before the rotation. Llama-3 frequency scaling is applied to θ_i.
- Attention scores are accumulated and soft-maxed in float32, then cast to the compute dtype
  (`models/attention.py`: xla, cuDNN or chunked kernels behind one function; segment ids for padding and
  packed rows).
- The LM head runs in `policy.logits_dtype` (the "fp32 LM head" option when float32).

Layers are either a Python loop over `nnx.List` (parameter paths `layers/{i}/...`, the contract's
default) or, with `scan_layers=True`, one `Block` with stacked `[L, ...]` parameters run under `lax.scan`
(paths `layers/...`), so compile time and program size do not grow with depth. Both layouts map to the
same per-layer HF tensor names (`hf_io`) and sharding rules (`sharding`: a stacked leaf gets its layer's
spec with the layer axis replicated), so checkpoints and weight sync do not see the difference.

Mixture of experts (`Qwen3MoeForCausalLM`): each block holds a dense `MLP` or a `moe.SparseMoE` as
`cfg.is_sparse_layer` says. The forwards that return routing (`forward_routed`, `forward_prefill_routed`,
`forward_cached_routed`) also give a `moe.RouterOutput` over the sparse layers, and every full-sequence
forward takes `routing` (`[B, S, sparse layers, k]` expert ids) to replay a routing (moe.py). Scanned layers
need all layers of one kind (Qwen3-30B-A3B: all sparse); a mix is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxrl_mismatch.models.attention import DEFAULT_BLOCK, cached_attention, check_impl, matmul_precision, self_attention
from jaxrl_mismatch.models.config import ModelConfig
from jaxrl_mismatch.models.moe import RouterOutput, SparseMoE, from_scan, stack_layers
from jaxrl_mismatch.precision import DTypePolicy

_INIT = nnx.initializers.normal(0.02)  # HF's `initializer_range` default, for freshly built models


def positions_from_mask(attention_mask: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """RoPE positions that start at 0 on each row's first real token: `cumsum(mask) - 1`, clipped at 0.

    Left padding therefore does not shift positions; pad slots get position 0 (they are masked anyway).
    """
    mask = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """θ_i = base^(-2i/d) for i < d/2 (RoFormer eq. 15), with Llama-3 scaling when configured.

    Llama-3.1 scaling (`apply_scaling` in Meta's llama-models reference code; no paper equation):
    wavelengths longer than `original_max / low_freq_factor` are divided by `factor`, shorter than
    `original_max / high_freq_factor` are kept, and the band between is interpolated linearly in
    `original_max / wavelength`. Computed in float32 like the PyTorch reference.
    """
    dim = cfg.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
    if cfg.rope_scaling is None:
        return inv_freq
    s = cfg.rope_scaling
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = np.float32(2 * np.pi) / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: Float[Array, "batch seq heads head_dim"], positions: Int[Array, "batch seq"], inv_freq: np.ndarray
) -> Float[Array, "batch seq heads head_dim"]:
    """Rotate q or k by their positions (RoFormer eq. 34) in HF's half-split layout."""
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


_precision = matmul_precision  # float32 means float32 (see attention.matmul_precision)

# Per-layer rematerialisation: what each block keeps for the backward pass (`jax.checkpoint_policies`).
#   none: everything (no recomputation); full: nothing (recompute the whole block, ~1/3 more FLOPs);
#   save_dots: the outputs of the weight matmuls (recompute norms, activations, attention);
#   offload: like save_dots, but parked in pinned host memory (device memory for depth-independent cost).
REMAT_POLICIES = ("none", "full", "save_dots", "offload")


def remat_policy_name(remat: bool | str) -> str:
    """The policy name for a `Transformer.remat` value (True/False are "full"/"none", as before names)."""
    if remat is True or remat is False:
        return "full" if remat else "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r} is not one of {', '.join(map(repr, REMAT_POLICIES))} (or a bool)")
    return remat


def _checkpoint_policy(name: str):
    if name == "full":
        return None  # jax.checkpoint's default: save nothing, recompute the block
    if name == "save_dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")


def positions_from_segments(segment_ids: Int[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """RoPE positions of packed rows: each segment (a run of equal ids > 0) counts from 0; padding gets 0.

    For a 0/1 mask with one contiguous run per row this equals `positions_from_mask`.
    """
    seg = segment_ids.astype(jnp.int32)
    slots = jnp.broadcast_to(jnp.arange(seg.shape[1], dtype=jnp.int32)[None, :], seg.shape)
    prev = jnp.concatenate([jnp.zeros_like(seg[:, :1]), seg[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(seg != prev, slots, 0), axis=1)
    return jnp.where(seg > 0, slots - start, 0)


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x²) + ε) · g (Zhang & Sennrich 2019, eq. 4), normalised in float32."""

    def __init__(self, dim: int, eps: float, policy: DTypePolicy):
        self.scale = nnx.Param(jnp.ones((dim,), policy.param_dtype))
        self.eps = eps
        self.fp32 = "norm" in policy.fp32_components  # gain in float32 too, one rounding at the output

    def __call__(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        shape = (1,) * (x.ndim - 1) + (-1,)
        if getattr(self, "fp32", False):
            return (self.scale[...].astype(jnp.float32).reshape(shape) * normed).astype(x.dtype)
        scale = self.scale[...].astype(x.dtype).reshape(shape)
        return scale * normed.astype(x.dtype)


def _linear(din: int, dout: int, policy: DTypePolicy, rngs: nnx.Rngs, *, bias: bool = False, dtype=None):
    dtype = policy.compute_dtype if dtype is None else dtype
    return nnx.Linear(
        din, dout, use_bias=bias, dtype=dtype, param_dtype=policy.param_dtype,
        precision=_precision(dtype), kernel_init=_INIT, rngs=rngs,
    )



class Attention(nnx.Module):
    """Multi-head self-attention with GQA, RoPE, optional q/k/v biases (Qwen2) and q/k norms (Qwen3)."""

    def __init__(self, cfg: ModelConfig, policy: DTypePolicy, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = _linear(d, self.n_heads * hd, policy, rngs, bias=cfg.attention_bias)
        self.k_proj = _linear(d, self.n_kv * hd, policy, rngs, bias=cfg.attention_bias)
        self.v_proj = _linear(d, self.n_kv * hd, policy, rngs, bias=cfg.attention_bias)
        self.o_proj = _linear(self.n_heads * hd, d, policy, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, policy)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, policy)
        self.qk_norm = cfg.qk_norm
        self.core_dtype = policy.dtype_of("attention")  # scores, softmax and Σ p·v (precision.COMPONENTS)

    def _qkv(self, x, positions, inv_freq):
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.n_kv, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def _out(self, o):
        b, s = o.shape[:2]
        return self.o_proj(o.reshape(b, s, self.n_heads * self.head_dim))

    def __call__(self, x, positions, segment_ids, inv_freq, *, impl: str, packed: bool, block: int):
        """Full-sequence attention: (x [B,S,D] → [B,S,D], (k, v) [B,S,Hkv,hd] each, after RoPE)."""
        q, k, v = self._qkv(x, positions, inv_freq)
        dt = self.core_dtype
        o = self_attention(q.astype(dt), k.astype(dt), v.astype(dt), segment_ids, impl=impl, packed=packed, block=block)
        return self._out(o.astype(x.dtype)), (k, v)

    def decode(self, x, positions, inv_freq, cache_k, cache_v, key_mask, index, layer, *, block: int):
        """Write this step's keys/values into layer `layer` of the stacked cache at slot `index`, then
        attend over the filled prefix of the cache (`attention.cached_attention`)."""
        q, k, v = self._qkv(x, positions, inv_freq)
        at = (layer, 0, index, 0, 0)
        cache_k = jax.lax.dynamic_update_slice(cache_k, k[None].astype(cache_k.dtype), at)
        cache_v = jax.lax.dynamic_update_slice(cache_v, v[None].astype(cache_v.dtype), at)
        o = cached_attention(q.astype(self.core_dtype), cache_k, cache_v, key_mask, index, layer, block=block)
        return self._out(o.astype(x.dtype)), cache_k, cache_v


class MLP(nnx.Module):
    """SwiGLU feed-forward: W_down (silu(x W_gate) ⊙ x W_up) (Shazeer 2020, eq. 6)."""

    def __init__(self, cfg: ModelConfig, policy: DTypePolicy, rngs: nnx.Rngs):
        dt = policy.dtype_of("mlp")
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, policy, rngs, dtype=dt)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, policy, rngs, dtype=dt)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, policy, rngs, dtype=dt)

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm decoder block: x + Attn(norm(x)), then x + MLP(norm(x)) (MLP: dense or `SparseMoE`).

    Calls return `(x, kv or cache, router)`; `router` is this layer's `RouterOutput` (sparse) or None."""

    def __init__(self, cfg: ModelConfig, policy: DTypePolicy, rngs: nnx.Rngs, *, sparse: bool = False):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        self.attn = Attention(cfg, policy, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        self.sparse = bool(sparse)
        self.mlp = SparseMoE(cfg, policy, rngs) if sparse else MLP(cfg, policy, rngs)
        self.cast_ffn = bool(policy.fp32_components & {"mlp", "router"})  # keep the residual stream's dtype
        self.capture = False  # sow per-component outputs as nnx.Intermediate (`capture_intermediates`)

    def _sow(self, **values):
        if getattr(self, "capture", False):
            for name, value in values.items():
                self.sow(nnx.Intermediate, name, value)

    def _ffn(self, x, valid, forced, mesh):
        if self.sparse:
            return self.mlp(x, valid, forced, mesh)
        return self.mlp(x), None

    def __call__(self, x, positions, segment_ids, inv_freq, *, forced=None, mesh=None, **attn_kw):
        a = self.input_norm(x)
        h, kv = self.attn(a, positions, segment_ids, inv_freq, **attn_kw)
        x = x + h
        n = self.post_attn_norm(x)
        m, router = self._ffn(n, segment_ids > 0, forced, mesh)
        m = m.astype(x.dtype) if getattr(self, "cast_ffn", False) else m
        self._sow(attn_norm_out=a, attn_out=h, mlp_norm_out=n, mlp_out=m, block_out=x + m)
        return x + m, kv, router

    def decode(self, x, positions, inv_freq, cache_k, cache_v, key_mask, index, layer, *, block: int):
        a = self.input_norm(x)
        h, cache_k, cache_v = self.attn.decode(a, positions, inv_freq, cache_k, cache_v, key_mask, index, layer,
                                               block=block)
        x = x + h
        valid = jnp.ones(x.shape[:2], bool)
        n = self.post_attn_norm(x)
        m, router = self._ffn(n, valid, None, None)
        m = m.astype(x.dtype) if getattr(self, "cast_ffn", False) else m
        self._sow(attn_norm_out=a, attn_out=h, mlp_norm_out=n, mlp_out=m, block_out=x + m)
        return x + m, cache_k, cache_v, router


CAPTURED = ("attn_norm_out", "attn_out", "mlp_norm_out", "mlp_out", "block_out")  # per block, in order


def capture_intermediates(model: "Transformer", on: bool = True) -> None:
    """Make every `Block` sow `CAPTURED` (its input norm, attention, post-attention norm, MLP and block
    outputs) as `nnx.Intermediate`; run the model under `nnx.capture(fn, nnx.Intermediate)` to get them.

    Off by default, so training programs and their state are untouched. Only the unrolled layout with
    remat "none" keeps them (scan bodies and checkpointed blocks run on copies of the block)."""
    if model.scan_layers or model.remat != "none":
        raise ValueError("capture_intermediates needs scan_layers=False and remat='none'")
    for layer in model.layers:
        layer.capture = bool(on)


def _stacked_blocks(cfg: ModelConfig, policy: DTypePolicy, rngs: nnx.Rngs) -> Block:
    """One `Block` whose parameters carry a leading `[num_hidden_layers]` axis.

    The blocks are drawn one after the other from the same `rngs` as the unrolled model draws them, then
    stacked, so a scanned and an unrolled model built from the same seed hold the same weights.
    """
    kinds = {cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers)}
    if len(kinds) > 1:
        raise ValueError(
            f"scan_layers=True needs every layer of one kind, but this {cfg.architecture} mixes dense and sparse "
            f"layers (sparse: {list(cfg.sparse_layers)}; mlp_only_layers={list(cfg.mlp_only_layers)}, "
            f"decoder_sparse_step={cfg.decoder_sparse_step}); use scan_layers=False")
    sparse = kinds.pop()
    blocks = [Block(cfg, policy, rngs, sparse=sparse) for _ in range(cfg.num_hidden_layers)]
    graphdef = nnx.graphdef(blocks[0])
    states = [nnx.state(b) for b in blocks]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


class Transformer(nnx.Module):
    """The policy model. `model(ids, positions, mask)` gives final-normed hidden states; `model.logits`
    applies the LM head, kept separate so `token_logprobs` can run it chunk by chunk.

    Options (static: part of the graph definition, so a jitted function recompiles when one changes):
      scan_layers: layers as one stacked `Block` run under `lax.scan` (parameter paths `layers/...` with a
        leading layer axis) instead of `nnx.List` (`layers/{i}/...`). Compile time and program size stop
        growing with depth; HF names, sharding rules and weight sync cover both layouts.
      attention_impl: `attention.ATTENTION_IMPLS` ("auto" | "xla" | "cudnn" | "chunked").
      attention_block: query rows per block of the chunked attention.
      remat: per-block rematerialisation of the training forward, `REMAT_POLICIES` or a bool (True = "full").
        It can be reassigned after construction (the exact scorer keeps "none").
      mesh: the device mesh the parameters live on, or None. Only MoE layers use it: their expert FFN then
        runs under `shard_map` with expert parallelism (`models/moe.py`). Set by `load_hf(..., mesh=)` and
        `sharding.shard_model`; assignable.
    """

    def __init__(
        self, cfg: ModelConfig, policy: DTypePolicy, rngs: nnx.Rngs | None = None, *, scan_layers: bool = False,
        attention_impl: str = "auto", attention_block: int = DEFAULT_BLOCK, remat: bool | str = "none",
        mesh: jax.sharding.Mesh | None = None,
    ):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.cfg, self.policy = cfg, policy
        self.scan_layers = bool(scan_layers)
        self.attention_impl = check_impl(attention_impl)
        if attention_block < 1:
            raise ValueError(f"attention_block must be >= 1, got {attention_block}")
        self.attention_block = int(attention_block)
        self.remat = remat_policy_name(remat)
        self.mesh = mesh
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=policy.compute_dtype, param_dtype=policy.param_dtype,
            embedding_init=_INIT, rngs=rngs,
        )
        if self.scan_layers:
            self.layers = _stacked_blocks(cfg, policy, rngs)
        else:
            self.layers = nnx.List([Block(cfg, policy, rngs, sparse=cfg.is_sparse_layer(i))
                                    for i in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, policy, rngs, dtype=policy.logits_dtype)

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"],
        *,
        segment_ids: Int[Array, "batch seq"] | None = None,
        attention_impl: str | None = None,
        routing: Int[Array, "batch seq sparse_layers k"] | None = None,
    ) -> Float[Array, "batch seq hidden"]:
        """Final-normed hidden states under a causal mask that also hides padded keys.

        `segment_ids` (packed rows: 0 on padding, k ≥ 1 on the k-th sequence of the row) replaces
        `attention_mask` when given: a token then sees only earlier tokens of its own sequence, and
        `positions` should count from 0 within each sequence (`positions_from_segments`).
        `attention_impl` overrides the model's choice for this call. `routing` (MoE only) replays expert ids.
        """
        return self.forward_routed(input_ids, positions, attention_mask, segment_ids=segment_ids,
                                   attention_impl=attention_impl, routing=routing)[0]

    def forward_routed(
        self,
        input_ids: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"] | None,
        *,
        segment_ids: Int[Array, "batch seq"] | None = None,
        attention_impl: str | None = None,
        routing: Int[Array, "batch seq sparse_layers k"] | None = None,
    ) -> tuple[Float[Array, "batch seq hidden"], RouterOutput | None]:
        """`__call__` that also returns what the routers did (`moe.RouterOutput`; None for dense models).

        `routing[b, t, j]` forces the k experts of input token t in the j-th sparse layer (routing replay:
        the gate weights are the current router's probabilities over them, `moe.route`)."""
        packed = segment_ids is not None
        seg = (segment_ids if packed else attention_mask).astype(jnp.int32)
        kw = dict(impl=self.attention_impl if attention_impl is None else check_impl(attention_impl),
                  packed=packed, block=self.attention_block)
        hidden, _, router = self._full(self.embed(input_ids), positions, seg, kw, collect_kv=False, routing=routing)
        return hidden, router

    def forward_prefill(
        self, input_ids: Int[Array, "batch seq"], positions: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"],
    ) -> tuple[Float[Array, "batch seq hidden"], tuple[Array, Array]]:
        """`__call__` that also returns every layer's keys and values (after RoPE), stacked
        `[layers, batch, seq, kv_heads, head_dim]`: what `kv_cache.prefill` writes into an empty cache."""
        hidden, kv, _ = self.forward_prefill_routed(input_ids, positions, attention_mask)
        return hidden, kv

    def forward_prefill_routed(
        self, input_ids: Int[Array, "batch seq"], positions: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"],
    ) -> tuple[Float[Array, "batch seq hidden"], tuple[Array, Array], RouterOutput | None]:
        """`forward_prefill` plus the prompt's `RouterOutput` (None for dense models)."""
        kw = dict(impl=self.attention_impl, packed=False, block=self.attention_block)
        return self._full(self.embed(input_ids), positions, attention_mask.astype(jnp.int32), kw, collect_kv=True)

    def forward_cached(
        self,
        input_ids: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"],
        cache_k: Float[Array, "layers batch cache_len kv_heads head_dim"],
        cache_v: Float[Array, "layers batch cache_len kv_heads head_dim"],
        key_mask: Bool[Array, "batch cache_len"],
        index: Int[Array, ""],
        *,
        block: int,
    ) -> tuple[Float[Array, "batch seq hidden"], Array, Array]:
        """Run `input_ids` occupying cache slots [index, index+seq); used by `kv_cache.decode_step`.

        `key_mask` marks the valid cache slots *including* the ones written now; query at slot index+i
        sees valid slots ≤ index+i, read in blocks of `block` up to the filled length only.
        """
        return self.forward_cached_routed(input_ids, positions, cache_k, cache_v, key_mask, index, block=block)[:3]

    def forward_cached_routed(
        self,
        input_ids: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"],
        cache_k: Float[Array, "layers batch cache_len kv_heads head_dim"],
        cache_v: Float[Array, "layers batch cache_len kv_heads head_dim"],
        key_mask: Bool[Array, "batch cache_len"],
        index: Int[Array, ""],
        *,
        block: int,
    ) -> tuple[Float[Array, "batch seq hidden"], Array, Array, RouterOutput | None]:
        """`forward_cached` plus the new tokens' `RouterOutput` (None for dense models)."""
        inv_freq = rope_inv_freq(self.cfg)
        x = self.embed(input_ids)
        args = (positions, inv_freq)
        if self.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(carry, xs):
                h, ck, cv = carry
                layer_state, i = xs
                h, ck, cv, r = nnx.merge(graphdef, layer_state).decode(h, *args, ck, cv, key_mask, index, i,
                                                                       block=block)
                return (h, ck, cv), r

            layer_ids = jnp.arange(self.cfg.num_hidden_layers, dtype=jnp.int32)
            (x, cache_k, cache_v), rs = jax.lax.scan(body, (x, cache_k, cache_v), (state, layer_ids))
            router = None if rs is None else from_scan(rs)
        else:
            outs = []
            for i, layer in enumerate(self.layers):
                x, cache_k, cache_v, r = layer.decode(x, *args, cache_k, cache_v, key_mask, index, i, block=block)
                if r is not None:
                    outs.append(r)
            router = stack_layers(outs) if outs else None
        return self.final_norm(x), cache_k, cache_v, router

    def _full(self, x, positions, seg, attn_kw, *, collect_kv: bool, routing=None):
        inv_freq = rope_inv_freq(self.cfg)
        policy = "none" if collect_kv else remat_policy_name(self.remat)  # prefill is never differentiated
        mesh = self.mesh
        if routing is not None:
            want = (len(self.cfg.sparse_layers), self.cfg.num_experts_per_tok)
            if not self.cfg.is_moe or tuple(routing.shape[2:]) != want or routing.shape[:2] != x.shape[:2]:
                raise ValueError(f"routing has shape {tuple(routing.shape)}; this {self.cfg.architecture} model needs "
                                 f"[batch, seq, sparse layers, k] = {x.shape[:2] + want}")

        def run(block: Block, h, forced):
            h, kv, r = block(h, positions, seg, inv_freq, forced=forced, mesh=mesh, **attn_kw)
            return h, (kv if collect_kv else None), r

        if self.scan_layers:
            graphdef, state = nnx.split(self.layers)
            forced_xs = None if routing is None else jnp.moveaxis(routing, 2, 0)

            def body(h, xs):
                layer_state, forced = xs
                h, kv, r = run(nnx.merge(graphdef, layer_state), h, forced)
                return h, (kv, r)

            if policy != "none":
                body = jax.checkpoint(body, policy=_checkpoint_policy(policy), prevent_cse=False)
            x, (kvs, rs) = jax.lax.scan(body, x, (state, forced_xs))
            return self.final_norm(x), kvs, (None if rs is None else from_scan(rs))
        kvs, outs = [], []
        for layer in self.layers:
            forced = None
            if routing is not None and layer.sparse:
                forced = routing[:, :, len(outs)]
            if policy == "none":
                x, kv, r = run(layer, x, forced)
            else:  # one recompute region per block
                graphdef, state = nnx.split(layer)

                def block_fn(state, h, forced, graphdef=graphdef):
                    return run(nnx.merge(graphdef, state), h, forced)

                x, kv, r = jax.checkpoint(block_fn, policy=_checkpoint_policy(policy))(state, x, forced)
            kvs.append(kv)
            if r is not None:
                outs.append(r)
        router = stack_layers(outs) if outs else None
        if not collect_kv:
            return self.final_norm(x), None, router
        return self.final_norm(x), (jnp.stack([k for k, _ in kvs]), jnp.stack([v for _, v in kvs])), router

    def logits(self, hidden: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        """LM head in `policy.logits_dtype` (tied: hidden · embeddingᵀ)."""
        dt = self.policy.logits_dtype
        if self.cfg.tie_word_embeddings:
            emb = self.embed.embedding[...].astype(dt)
            return jnp.einsum("...d,vd->...v", hidden.astype(dt), emb, precision=_precision(dt))
        return self.lm_head(hidden)
