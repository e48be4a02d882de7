"""Decoder-only transformer (Llama-3, Qwen2/2.5, Qwen3) as a `flax.nnx` module.

Numerics follow the Hugging Face PyTorch reference so that π computed here and μ computed by an
inference engine on the same weights differ only by the precision policy, never by a formula:

- RMSNorm (Zhang & Sennrich 2019, eq. 4: x / sqrt(mean(x²) + ε) · g) is computed in float32 and cast
  back before the gain, exactly as HF does.
- RoPE (Su et al. 2021, RoFormer eq. 34: rotate each pair (x_i, x_{i+d/2}) by angle m·θ_i with
  θ_i = base^(-2i/d)), in HF's "rotate_half" layout; angles in float32, cos/sin cast to the compute
  dtype before the rotation. Llama-3 frequency scaling is applied to θ_i.
- Attention scores are accumulated and soft-maxed in float32, then cast to the compute dtype.
- The LM head runs in `policy.logits_dtype` (the "fp32 LM head" option when float32).

Layers are a Python loop over `nnx.List` rather than `nnx.scan` over stacked weights: the contract fixes
per-layer parameter paths (`layers/{i}/...`) that map one-to-one to HF tensor names and to the sharding
regexes, and weight sync streams tensors per layer. The price is compile time linear in depth, which is
seconds for the 24–36-layer models we target.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from jaxrl_mismatch.models.config import ModelConfig
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


def _precision(dtype) -> jax.lax.Precision:
    # float32 must mean float32: GPUs/TPUs would otherwise use TF32/bf16 passes for fp32 matmuls,
    # which is itself a training–inference mismatch.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x²) + ε) · g (Zhang & Sennrich 2019, eq. 4), normalised in float32."""

    def __init__(self, dim: int, eps: float, policy: DTypePolicy):
        self.scale = nnx.Param(jnp.ones((dim,), policy.param_dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
        return scale * normed.astype(x.dtype)


def _linear(din: int, dout: int, policy: DTypePolicy, rngs: nnx.Rngs, *, bias: bool = False, dtype=None):
    dtype = policy.compute_dtype if dtype is None else dtype
    return nnx.Linear(
        din, dout, use_bias=bias, dtype=dtype, param_dtype=policy.param_dtype,
        precision=_precision(dtype), kernel_init=_INIT, rngs=rngs,
    )


def attend(
    q: Float[Array, "batch q_len heads head_dim"],
    k: Float[Array, "batch kv_len kv_heads head_dim"],
    v: Float[Array, "batch kv_len kv_heads head_dim"],
    mask: Bool[Array, "batch q_len kv_len"],
) -> Float[Array, "batch q_len heads head_dim"]:
    """Grouped-query softmax attention (Vaswani et al. 2017, eq. 1; GQA: Ainslie et al. 2023).

    Query head h reads key/value head h // (heads / kv_heads), the grouping HF's `repeat_kv` uses.
    Fully masked rows (queries on left padding) get a uniform, finite distribution, never NaN.
    """
    b, s, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, s, kvh, h // kvh, d)
    scores = jnp.einsum(
        "bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32, precision=_precision(q.dtype)
    ) * np.float32(1.0 / np.sqrt(d))
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v, precision=_precision(v.dtype))
    return out.reshape(b, s, h, d)


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

    def __call__(self, x, positions, mask, inv_freq, kv=None, index=None):
        """x [B,S,D] → ([B,S,D], kv). With `kv=(k_cache, v_cache)` ([B,T,Hkv,hd] each), this step's
        keys/values are written at slot `index` and attention runs over the whole cache."""
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, s, self.n_kv, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if kv is not None:
            k = jax.lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv[0].dtype), index, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv[1].dtype), index, axis=1)
            kv = (k, v)
        out = attend(q, k, v, mask)
        return self.o_proj(out.reshape(b, s, self.n_heads * self.head_dim)), kv


class MLP(nnx.Module):
    """SwiGLU feed-forward: W_down (silu(x W_gate) ⊙ x W_up) (Shazeer 2020, eq. 6)."""

    def __init__(self, cfg: ModelConfig, policy: DTypePolicy, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, policy, rngs)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, policy, rngs)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, policy, rngs)

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm decoder block: x + Attn(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, cfg: ModelConfig, policy: DTypePolicy, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        self.attn = Attention(cfg, policy, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        self.mlp = MLP(cfg, policy, rngs)

    def __call__(self, x, positions, mask, inv_freq, kv=None, index=None):
        h, kv = self.attn(self.input_norm(x), positions, mask, inv_freq, kv, index)
        x = x + h
        return x + self.mlp(self.post_attn_norm(x)), kv


class Transformer(nnx.Module):
    """The policy model. `model(ids, positions, mask)` gives final-normed hidden states; `model.logits`
    applies the LM head, kept separate so `token_logprobs` can run it chunk by chunk."""

    def __init__(self, cfg: ModelConfig, policy: DTypePolicy, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.cfg, self.policy = cfg, policy
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=policy.compute_dtype, param_dtype=policy.param_dtype,
            embedding_init=_INIT, rngs=rngs,
        )
        self.layers = nnx.List([Block(cfg, policy, rngs) for _ in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, policy)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, policy, rngs, dtype=policy.logits_dtype)
        # Recompute each block's activations in the backward pass instead of storing them (training forward
        # only; `forward_cached` is never differentiated). Trades ~1/3 more FLOPs for activation memory
        # that no longer grows with depth on GPU/TPU — long-context RL on 4B+ models needs it. (XLA:CPU
        # reports no memory change for jax.checkpoint at all, so the saving is not measurable here.)
        self.remat = False

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"],
        attention_mask: Int[Array, "batch seq"],
    ) -> Float[Array, "batch seq hidden"]:
        """Final-normed hidden states under a causal mask that also hides padded keys."""
        s = input_ids.shape[1]
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))[None, :, :]
        mask = causal & attention_mask.astype(bool)[:, None, :]
        hidden, _ = self._run(input_ids, positions, mask, None, None)
        return hidden

    def forward_cached(
        self,
        input_ids: Int[Array, "batch seq"],
        positions: Int[Array, "batch seq"],
        key_mask: Bool[Array, "batch cache_len"],
        kv: list[tuple[Array, Array]],
        index: Int[Array, ""],
    ) -> tuple[Float[Array, "batch seq hidden"], list[tuple[Array, Array]]]:
        """Run `input_ids` occupying cache slots [index, index+seq); used by `kv_cache` prefill/decode.

        `key_mask` marks the valid cache slots *including* the ones written now; query at slot
        index+i sees slots ≤ index+i that are valid.
        """
        s, t = input_ids.shape[1], key_mask.shape[1]
        query_slot = index + jnp.arange(s, dtype=jnp.int32)
        causal = jnp.arange(t, dtype=jnp.int32)[None, None, :] <= query_slot[None, :, None]
        return self._run(input_ids, positions, causal & key_mask[:, None, :], kv, index)

    def _run(self, input_ids, positions, mask, kv, index):
        inv_freq = rope_inv_freq(self.cfg)
        x = self.embed(input_ids)
        new_kv = []
        if kv is None and self.remat:
            for layer in self.layers:
                graphdef, state = nnx.split(layer)

                def block(state, h, graphdef=graphdef):
                    return nnx.merge(graphdef, state)(h, positions, mask, inv_freq)[0]

                x = jax.checkpoint(block)(state, x)
            return self.final_norm(x), None
        for i, layer in enumerate(self.layers):
            x, layer_kv = layer(x, positions, mask, inv_freq, None if kv is None else kv[i], index)
            new_kv.append(layer_kv)
        return self.final_norm(x), (None if kv is None else new_kv)

    def logits(self, hidden: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        """LM head in `policy.logits_dtype` (tied: hidden · embeddingᵀ)."""
        dt = self.policy.logits_dtype
        if self.cfg.tie_word_embeddings:
            emb = self.embed.embedding[...].astype(dt)
            return jnp.einsum("...d,vd->...v", hidden.astype(dt), emb, precision=_precision(dt))
        return self.lm_head(hidden)
