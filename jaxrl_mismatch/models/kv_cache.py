"""Key/value cache for the built-in rollout engine: prefill a left-padded prompt batch, then decode.

Prompts are left-padded so that every row's last prompt token sits in the same cache slot and one
shared write index serves the whole batch; each row keeps its own RoPE position (its count of real
tokens), so padding never shifts positions (same convention as `positions_from_mask`). Cached keys are
stored after RoPE, so a decode step only rotates the new token.

Everything is a pure function of a pytree cache, so `prefill` and `decode_step` jit (with the model
split by `nnx.split` and merged inside) and the cache can be donated between steps.
The caller sizes `max_len` ≥ prompt length + new tokens: writes past the end are clamped by XLA to
the last slot (a jitted step cannot raise), which would corrupt the newest entries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrl_mismatch.models.config import ModelConfig
from jaxrl_mismatch.models.model import Transformer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer keys/values `[B, T, Hkv, hd]` plus the bookkeeping shared by all layers."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    key_mask: Bool[Array, "batch max_len"]  # slot holds a real token
    index: Int[Array, ""]  # next slot to write (same for all rows)
    next_position: Int[Array, " batch"]  # RoPE position of each row's next token

    @property
    def max_len(self) -> int:
        return self.key_mask.shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache; `dtype` is normally the policy's compute dtype."""
    shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    layers = range(cfg.num_hidden_layers)
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in layers),
        v=tuple(jnp.zeros(shape, dtype) for _ in layers),
        key_mask=jnp.zeros((batch, max_len), bool),
        index=jnp.zeros((), jnp.int32),
        next_position=jnp.zeros((batch,), jnp.int32),
    )


def _step(model: Transformer, input_ids, new_mask, cache: KVCache):
    """Write `input_ids` (valid where `new_mask`) at the cache's index; hidden states and new cache."""
    s = input_ids.shape[1]
    new_mask = new_mask.astype(bool)
    offsets = jnp.maximum(jnp.cumsum(new_mask.astype(jnp.int32), axis=1) - 1, 0)
    positions = cache.next_position[:, None] + offsets
    key_mask = jax.lax.dynamic_update_slice_in_dim(cache.key_mask, new_mask, cache.index, axis=1)
    hidden, kv = model.forward_cached(input_ids, positions, key_mask, list(zip(cache.k, cache.v)), cache.index)
    new_cache = KVCache(
        k=tuple(k for k, _ in kv),
        v=tuple(v for _, v in kv),
        key_mask=key_mask,
        index=cache.index + s,
        next_position=cache.next_position + new_mask.sum(axis=1, dtype=jnp.int32),
    )
    return hidden, new_cache


def prefill(
    model: Transformer,
    input_ids: Int[Array, "batch prompt"],
    attention_mask: Int[Array, "batch prompt"],
    cache: KVCache,
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    """Run left-padded prompts through the model, filling the cache; logits of the last prompt token."""
    hidden, cache = _step(model, input_ids, attention_mask, cache)
    return model.logits(hidden[:, -1, :]), cache


def decode_step(
    model: Transformer, token: Int[Array, " batch"], cache: KVCache
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    """Append one token per row; logits for the token after it."""
    hidden, cache = _step(model, token[:, None], jnp.ones((token.shape[0], 1), bool), cache)
    return model.logits(hidden[:, 0, :]), cache
