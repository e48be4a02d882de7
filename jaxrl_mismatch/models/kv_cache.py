"""Key/value cache for the built-in rollout engine: prefill a left-padded prompt batch, then decode.

Prompts are left-padded so that every row's last prompt token sits in the same cache slot and one
shared write index serves the whole batch; each row keeps its own RoPE position (its count of real
tokens), so padding never shifts positions (same convention as `positions_from_mask`). Cached keys are
stored after RoPE, so a decode step only rotates the new token.

Keys and values of all layers are one stacked array `[layers, batch, max_len, kv_heads, head_dim]`
each, for the unrolled and the scanned (`scan_layers`) model alike: a decode step writes its slot in
place and reads only the filled prefix, in blocks of `block` slots (`attention.cached_attention`), so
its cost grows with the filled length, not with `max_len`. Prefill attends over the prompt alone
(`Transformer.forward_prefill`, the training forward's attention kernels) and writes the cache from slot 0.

Everything is a pure function of a pytree cache, so `prefill` and `decode_step` jit (with the model
split by `nnx.split` and merged inside) and the cache can be donated between steps. `decode_loop` is the one
token-by-token loop over them (the rollout engine's sampler, the exact sampler's draft, the warm start's
evaluation); each caller brings only its choice of token.
The caller sizes `max_len` ≥ prompt length + new tokens (`init_cache` rounds it up to a whole number of
blocks): writes past the end are clamped by XLA to the last slot (a jitted step cannot raise), which would
corrupt the newest entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrl_mismatch.models.config import ModelConfig
from jaxrl_mismatch.models.model import Transformer

DECODE_BLOCK = 256  # cache slots per block read by a decode step (the granularity of "filled length")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Stacked keys/values `[L, B, T, Hkv, hd]` plus the bookkeeping shared by all layers."""

    k: Float[Array, "layers batch max_len kv_heads head_dim"]
    v: Float[Array, "layers batch max_len kv_heads head_dim"]
    key_mask: Bool[Array, "batch max_len"]  # slot holds a real token
    index: Int[Array, ""]  # next slot to write (same for all rows)
    next_position: Int[Array, " batch"]  # RoPE position of each row's next token
    block: int = dataclasses.field(default=DECODE_BLOCK, metadata=dict(static=True))  # decode read granularity

    @property
    def max_len(self) -> int:
        return self.key_mask.shape[1]


def left_pad(rows: list[list[int]], pad_id: int = 0, *, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Prompt id lists as the left-padded (ids, mask) int32 arrays `prefill` expects, `width` columns (default:
    the longest row). Host-side: the engine, the warm start's evaluation and `attribute` pad with it."""
    width = max(len(r) for r in rows) if width is None else width
    ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, block: int = DECODE_BLOCK) -> KVCache:
    """An empty cache of at least `max_len` slots; `dtype` is normally the policy's compute dtype.

    The length is rounded up to a multiple of the decode block (`min(block, max_len)`), so every block a
    decode step reads lies inside the cache.
    """
    if max_len < 1 or block < 1:
        raise ValueError(f"init_cache needs max_len >= 1 and block >= 1, got {max_len}, {block}")
    block = min(block, max_len)
    length = -(-max_len // block) * block
    shape = (cfg.num_hidden_layers, batch, length, cfg.num_key_value_heads, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        key_mask=jnp.zeros((batch, length), bool),
        index=jnp.zeros((), jnp.int32),
        next_position=jnp.zeros((batch,), jnp.int32),
        block=block,
    )


def prefill(
    model: Transformer,
    input_ids: Int[Array, "batch prompt"],
    attention_mask: Int[Array, "batch prompt"],
    cache: KVCache,
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    """Run left-padded prompts through the model into an empty cache (slots [0, prompt), whatever the
    cache held before); logits of the last prompt token."""
    mask = attention_mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
    hidden, (k, v) = model.forward_prefill(input_ids, positions, mask.astype(jnp.int32))
    s = input_ids.shape[1]
    new_cache = dataclasses.replace(
        cache,
        k=jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, 0, 0, 0, 0)),
        v=jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, 0, 0, 0, 0)),
        key_mask=jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(cache.key_mask), mask, 0, axis=1),
        index=jnp.asarray(s, jnp.int32),
        next_position=mask.sum(axis=1, dtype=jnp.int32),
    )
    return model.logits(hidden[:, -1, :]), new_cache


def distinct_rows(rows: Sequence[Sequence[int]]) -> tuple[list[int], np.ndarray]:
    """Host-side: the index of the first occurrence of each distinct token row (in first-use order), and for every
    row the position of its row among those. Samplers prefill the distinct rows once (`select_rows`)."""
    position: dict[tuple[int, ...], int] = {}
    first: list[int] = []
    src = np.empty((len(rows),), np.int32)
    for k, r in enumerate(rows):
        key = tuple(r)
        if key not in position:
            position[key] = len(first)
            first.append(k)
        src[k] = position[key]
    return first, src


def bucket(n: int, minimum: int = 1) -> int:
    """`n` rounded up to a power of two, at least `minimum`: the sizes (rows, prompt width, new tokens) the
    engines' programs are compiled for — few distinct shapes, at most 2x padding."""
    return max(minimum, 1 << max(0, (int(n) - 1).bit_length()))


def prefill_inputs(rows: Sequence[Sequence[int]], *, batch: int, width: int, share: bool = True
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Host-side: `prefill`'s left-padded (ids, mask) for the token `rows` that `batch` decode rows (the first
    len(rows), then padding) continue. With `share` and a repeated row, only the distinct rows are prefilled and
    `row_src[r]` names row r's (padding rows: 0), for `select_rows`; else every row is, and `row_src` is None.
    Prefill rows are padded to a power of two, each padding row one token 0 so no row is fully masked."""
    first, src = distinct_rows(rows)
    shared = share and len(first) < len(rows)
    prefilled = [rows[k] for k in first] if shared else list(rows)
    ids = np.zeros((bucket(len(prefilled)), width), np.int32)
    mask = np.zeros_like(ids)
    mask[:, -1] = 1
    ids[:len(prefilled)], mask[:len(prefilled)] = left_pad(prefilled, width=width)
    if not shared:
        return ids, mask, None
    row_src = np.zeros((batch,), np.int32)
    row_src[:len(rows)] = src
    return ids, mask, row_src


def select_rows(cache: KVCache, rows: Int[Array, " new_batch"]) -> KVCache:
    """The cache of batch rows `rows` (repeats allowed): n samples of one prompt decode from copies of the
    prompt's single prefill. Slots and the write index are shared by all rows, so only the rows move."""
    return dataclasses.replace(cache, k=cache.k[:, rows], v=cache.v[:, rows], key_mask=cache.key_mask[rows],
                               next_position=cache.next_position[rows])


def decode_step(
    model: Transformer, token: Int[Array, " batch"], cache: KVCache
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    """Append one token per row; logits for the token after it."""
    positions = cache.next_position[:, None]
    key_mask = jax.lax.dynamic_update_slice_in_dim(
        cache.key_mask, jnp.ones((token.shape[0], 1), bool), cache.index, axis=1)
    hidden, k, v = model.forward_cached(token[:, None], positions, cache.k, cache.v, key_mask, cache.index,
                                        block=cache.block)
    new_cache = dataclasses.replace(
        cache, k=k, v=v, key_mask=key_mask, index=cache.index + 1, next_position=cache.next_position + 1)
    return model.logits(hidden[:, 0, :]), new_cache


def decode_loop(
    model: Transformer,
    logits: Float[Array, "batch vocab"],
    cache: KVCache,
    pick: Callable[[Int[Array, ""], Float[Array, "batch vocab"]], tuple[Int[Array, " batch"], dict[str, Array]]],
    *,
    new_len: int,
    max_tokens: Int[Array, ""] | Int[Array, " batch"] | int,
    stop_ids: Int[Array, " stops"],
    pad_id: int = 0,
    records: dict[str, Array] | None = None,
    observe: Callable[[], dict[str, Array]] | None = None,
) -> tuple[Int[Array, "batch new_len"], dict[str, Array], Int[Array, " batch"], Bool[Array, " batch"]]:
    """The one per-token decode loop after `prefill`: every sampler that extends prompts through the cache runs it.

    Step t: `pick(t, logits)` chooses each row's token (and values to record about the choice); a row that has
    ended gets `pad_id` instead; the tokens go through `decode_step`. A row ends on a token in `stop_ids` or
    after `max_tokens` tokens (a scalar or one limit per row; at most `new_len`, the width of the outputs); the
    loop (a `lax.while_loop`) ends when every row has, so a batch that stops early does not pay for `new_len`.

    `records`: zero buffers `[batch, new_len, ...]` by name; column t of each is set from the values `pick`
    returns, or `observe()` reads after the decode step (e.g. what the model recorded about the token it just
    consumed), and stays zero for rows that had ended.

    Returns (tokens `[batch, new_len]`, padded with `pad_id`; the filled `records`; lengths; stopped: the row
    ended on a stop id, not on its limit).
    """
    rows = logits.shape[0]
    limit = jnp.broadcast_to(jnp.asarray(max_tokens, jnp.int32), (rows,))
    records = {} if records is None else records

    def cond(carry):
        t, done = carry[0], carry[4]
        return (t < new_len) & ~jnp.all(done)

    def body(carry):
        t, logits, cache, tokens, done, stopped, lengths, records = carry
        token, values = pick(t, logits)
        token = jnp.where(done, pad_id, token)
        tokens = tokens.at[:, t].set(token)
        lengths = lengths + (~done).astype(jnp.int32)
        hit = jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
        logits, cache = decode_step(model, token, cache)
        if observe is not None:
            values = {**values, **observe()}

        def put(name, buf):
            v = values[name]
            keep = jnp.reshape(done, (rows,) + (1,) * (v.ndim - 1))
            return buf.at[:, t].set(jnp.where(keep, jnp.zeros_like(v), v).astype(buf.dtype))

        records = {name: put(name, buf) for name, buf in records.items()}
        stopped = stopped | (hit & ~done)
        done = done | hit | (lengths >= limit)
        return t + 1, logits, cache, tokens, done, stopped, lengths, records

    init = (jnp.zeros((), jnp.int32), logits, cache, jnp.full((rows, new_len), pad_id, jnp.int32), limit <= 0,
            jnp.zeros((rows,), bool), jnp.zeros((rows,), jnp.int32), records)
    _, _, _, tokens, _, stopped, lengths, records = jax.lax.while_loop(cond, body, init)
    return tokens, records, lengths, stopped
