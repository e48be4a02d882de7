"""Per-token log-probabilities and entropies without ever holding the full `[B, S, V]` logits.

With Qwen's ~152k vocabulary, a batch of 64 × 4k tokens has 4e10 logits (160 GB in float32), far
more than the transformer's activations. The LM head and the log-softmax therefore run over sequence
chunks inside `lax.map`, and each chunk is wrapped in `jax.checkpoint` so the backward pass recomputes
that chunk's logits instead of storing them: peak memory is one chunk's `[B, C, V]` in both passes.
`tests/models/test_logprobs_memory.py` checks this on the compiled program's memory analysis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxrl_mismatch.models.model import Transformer, positions_from_mask, positions_from_segments
from jaxrl_mismatch.models.truncation import truncate_to_count, truncated_entropy


def token_logprobs(
    model: Transformer,
    input_ids: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    attention_mask: Int[Array, "batch seq"],
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
    segment_ids: Int[Array, "batch seq"] | None = None,
    positions: Int[Array, "batch seq"] | None = None,
    kept: Int[Array, "batch seq"] | None = None,
) -> tuple[Float[Array, "batch seq"], Float[Array, "batch seq"]]:
    """(log π(targets[b,t] | input_ids[b,:t+1]), entropy of π(· | input_ids[b,:t+1])), float32 [B, S].

    `temperature` scores the distribution softmax(logits / T) — the one an engine sampling at T drew from
    — so that an RL trainer's π and the engine's μ describe the same distribution.

    Callers pass `input_ids = tokens[:, :-1]`, `targets = tokens[:, 1:]` and the input's attention
    mask. Values at padded input positions (attention_mask == 0) are 0, so they never leak into a
    masked sum. The log-softmax runs in `policy.logits_dtype` (its rounding is part of what the
    precision policy controls); the gather and the entropy sum are in float32.

    Packed rows (`train.packing`): pass the packed row's `segment_ids` (0 on padding, k ≥ 1 on its k-th
    sequence; `attention_mask` is then ignored) — conditioning is on the token's own sequence only,
    `input_ids[b, start:t+1]` — and optionally `positions` (default: counted from 0 within each segment).
    The value at a sequence's last token scores the next sequence's first token: meaningless, and never
    selected by the packer's unpacking.
    """
    if segment_ids is not None:
        valid = segment_ids
        positions = positions_from_segments(segment_ids) if positions is None else positions
        hidden = model(input_ids, positions, segment_ids, segment_ids=segment_ids)
    else:
        valid = attention_mask
        positions = positions_from_mask(attention_mask) if positions is None else positions
        hidden = model(input_ids, positions, attention_mask)
    return logprobs_from_hidden(model, hidden, targets, valid, chunk_size=chunk_size, temperature=temperature,
                                kept=kept)


def logprobs_from_hidden(
    model: Transformer,
    hidden: Float[Array, "batch seq hidden"],
    targets: Int[Array, "batch seq"],
    attention_mask: Int[Array, "batch seq"],
    *,
    chunk_size: int = 256,
    temperature: float = 1.0,
    kept: Int[Array, "batch seq"] | None = None,
) -> tuple[Float[Array, "batch seq"], Float[Array, "batch seq"]]:
    """The LM-head part of `token_logprobs`, for callers that already have the final hidden states.

    `kept` (top-k/top-p rollouts): per target, the engine's kept-set size; π is renormalised over the
    `kept` most likely tokens of its own distribution (`models.truncation`; 0 = the whole vocabulary)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature!r}")
    b, s, d = hidden.shape
    c = max(1, min(chunk_size, s))
    n = -(-s // c)
    pad = n * c - s
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        kept = None if kept is None else jnp.pad(kept, ((0, 0), (0, pad)))
    h_chunks = hidden.reshape(b, n, c, d).transpose(1, 0, 2, 3)
    t_chunks = targets.reshape(b, n, c).transpose(1, 0, 2)
    k_chunks = None if kept is None else kept.reshape(b, n, c).transpose(1, 0, 2)

    graphdef, state = nnx.split(model)

    @jax.checkpoint
    def chunk(state, h, t, k):
        logits = nnx.merge(graphdef, state).logits(h)
        if temperature != 1.0:
            logits = logits / jnp.asarray(temperature, logits.dtype)
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        if k is not None:
            logp_all = truncate_to_count(logp_all.astype(jnp.float32), k, t)
            logp = jnp.take_along_axis(logp_all, t[:, :, None], axis=-1)[:, :, 0]
            return logp, truncated_entropy(logp_all)
        logp = jnp.take_along_axis(logp_all, t[:, :, None], axis=-1)[:, :, 0].astype(jnp.float32)
        logp_all = logp_all.astype(jnp.float32)
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return logp, entropy

    if k_chunks is None:
        logp, entropy = jax.lax.map(lambda xs: chunk(state, *xs, None), (h_chunks, t_chunks))
    else:
        logp, entropy = jax.lax.map(lambda xs: chunk(state, *xs), (h_chunks, t_chunks, k_chunks))
    logp = logp.transpose(1, 0, 2).reshape(b, n * c)[:, :s]
    entropy = entropy.transpose(1, 0, 2).reshape(b, n * c)[:, :s]
    valid = attention_mask > 0  # also segment ids
    return jnp.where(valid, logp, 0.0), jnp.where(valid, entropy, 0.0)
