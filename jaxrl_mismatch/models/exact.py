"""The batch-invariant ("exact") log-prob computation shared bit for bit by the trainer and the built-in engine.

Why: the VeXact review isolates the training–inference mismatch by making rollout and training produce
*identical* log-probs. Two things break that in an ordinary stack: (1) the engine computes a different
program (KV-cache decode: one query at a time, other matmul shapes), and (2) neither side is
batch-invariant — a row's values depend on the shapes it was computed in (batch size, padded length),
because kernels pick tilings and reduction orders by shape (verl #6280; on an H100 in bf16 34 % of a
row's tokens moved by >10 % between batch 1 and 8).

How: every row is computed *alone* (`lax.map` over rows, batch 1), right-padded to a canonical length
that depends only on the row's prompt length and the request's `max_tokens` (`canonical_length`, a
geometric ladder of ≤ 1.25× steps), and
the LM head runs over fixed chunks of `EXACT_CHUNK` positions aligned at 0. So every kernel sees the same
shapes whatever else is in the batch, however the batch is padded or split into microbatches. Positions
after the one being scored cannot change it: the causal mask gives them a softmax weight of exactly 0 (the
masked score is float32's minimum, whose exp underflows to 0) and 0 · v = 0. The engine samples token t
from the log-softmax this very function computes for position t (`rollout/exact_sampler.py`: a full forward
of the row per token; `rollout/spec_exact.py`: one forward per row verifying a KV-cache draft — timed in
benchmarks/exact_engine.py), so μ and the trainer's π(θ_old) are the same bits.

Limits: exactness holds on one device per row (a single-device or data-parallel trainer mesh); FSDP or
tensor parallelism split reductions across devices and change their order. On a data-parallel mesh the rows
are split over the devices (`jax.shard_map`, `models.sharding.split_rows`): each device its own rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jaxrl_mismatch.models.attention import CHUNKED_MIN_SEQ
from jaxrl_mismatch.models.model import Transformer, positions_from_mask
from jaxrl_mismatch.models.scoring import target_scores
from jaxrl_mismatch.models.sharding import row_shards, split_rows

EXACT_CHUNK = 16  # LM-head positions per chunk: small, so the engine's one-position head wastes little


LADDER_STEPS = 4  # canonical lengths per doubling of prompt + max_tokens (consecutive ones ≤ 1.25× apart)


def canonical_length(prompt_len: int, max_tokens: int) -> int:
    """The padded length a row of this prompt length and response budget is computed at: n = prompt_len +
    max_tokens rounded up on a geometric ladder, to a multiple of max(`EXACT_CHUNK`, 2^⌊log2(n−1)⌋ / `LADDER_STEPS`)
    — 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, … — the float-like ladder of 2 mantissa bits.

    Why this ladder: every exact program (scorer, samplers, the update's exact forward) computes a row at this
    length, so padding is wasted work on every row and each length is one more compiled shape (one more
    `lax.switch` branch in the update, `train.exact_forward.candidate_lengths`; one more verify program in the
    engine). Powers of two waste up to 50 % (~30 % on average: 78 → 128 in benchmarks/exact_engine.py);
    multiples of 16 waste < 16 positions but compile seq_len / 16 shapes (256 for 4k rows); this ladder pads
    by < 25 % past 64 (~8 % on average) and compiles ≤ `LADDER_STEPS` shapes per doubling (6 for prompts of
    1–4096 tokens with max_tokens 2048). Every value is a multiple of `EXACT_CHUNK` (the head's chunk); the
    attention kernels (`xla`, and `chunked` from `CHUNKED_MIN_SEQ` on, which pads its query blocks itself)
    take any length. The map is monotone and idempotent: the smallest ladder value ≥ n."""
    n = max(1, int(prompt_len) + int(max_tokens))
    step = max(EXACT_CHUNK, (1 << max(0, (n - 1).bit_length() - 1)) // LADDER_STEPS)
    return -(-n // step) * step


def prompt_lengths(attention_mask: Int[Array, "b s"] | np.ndarray, response_mask: Float[Array, "b t"] | np.ndarray
                   ) -> Int[Array, "b"] | np.ndarray:
    """Each row's prompt length as the exact programs take it: its first response target's index + 1, or its
    whole length when it has no response. With `max_tokens`, it fixes the row's canonical length.

    One rule for the host (numpy in, numpy out: the scorer, the learner's bound check) and for the update's
    exact forward inside jit (jax arrays or tracers in, jnp out), so the two cannot pick different lengths."""
    xp = jnp if isinstance(attention_mask, jax.Array) or isinstance(response_mask, jax.Array) else np
    attention_mask, response_mask = xp.asarray(attention_mask), xp.asarray(response_mask)
    n_valid = xp.sum(attention_mask, axis=1).astype(xp.int32)
    responds = response_mask > 0
    return xp.where(responds.any(axis=1), xp.argmax(responds, axis=1) + 1, n_valid)


def chunk_logprobs(model: Transformer, hidden: Float[Array, "chunk d"], temperature: float | Array
                   ) -> Float[Array, "chunk vocab"]:
    """log softmax(logits / T) of one `EXACT_CHUNK` of positions, as float32: the one head every exact program
    (scorer, samplers, the update's exact forward) runs, with the same shapes and casts, so all of them compute
    the same bits.

    The logits keep the policy's `logits_dtype` rounding, but the division and the log-softmax run in float32
    (unlike the ordinary trainer head, `models.scoring.logprobs_from_logits`): the samplers draw token t with
    `categorical(log p_t)`, which renormalises what it is given, so the reported μ is the probability the
    token was drawn with only if exp(log p_t) sums to 1. A bf16 log-softmax sums to 1 ± 1e-2 (fp16 ± 2e-3),
    and at a vocabulary over 65,504 its fp16 sum can overflow to inf.

    `logits / T` divides by a full array behind an optimization barrier: XLA's simplifier may rewrite a
    division by a broadcast scalar into a multiplication by its reciprocal in one program and not in another
    (it did in the speculative sampler's verify program, not in the scorer), and x·(1/T) ≠ x/T in the last
    bit unless 1/T is exact (T = 1, 0.5; not 0.7). The barrier leaves it a division everywhere."""
    logits = model.logits(hidden[None])[0].astype(jnp.float32)
    t = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), logits.shape))
    return jax.nn.log_softmax(logits / t, axis=-1)


def row_hidden(model: Transformer, tokens: Int[Array, " length"], n_valid: Int[Array, ""]) -> Float[Array, "length d"]:
    """Final hidden states of one right-padded row whose first `n_valid` tokens are real.

    Attention runs through a kernel whose reduction order depends on the row's shape only (xla, or chunked
    for long rows), never cuDNN's padding mask, whose tiling follows the per-row length and could let
    later (masked) tokens move earlier positions' bits."""
    length = tokens.shape[0]
    mask = (jnp.arange(length) < n_valid).astype(jnp.int32)[None]
    impl = "chunked" if length >= CHUNKED_MIN_SEQ else "xla"
    return model(tokens[None], positions_from_mask(mask), mask, attention_impl=impl)[0]


def row_scores(model: Transformer, tokens: Int[Array, " length"], n_valid: Int[Array, ""],
               temperature: float | Array, kept: Int[Array, " length_minus_1"] | None = None, *,
               entropy: bool = False) -> tuple[Float[Array, " length_minus_1"], Float[Array, " length_minus_1"] | None]:
    """(log π(tokens[t+1] | tokens[:t+1]) for t < length-1 of one row, and with `entropy` the entropy of each
    position's distribution, else None), 0 past `n_valid`; with `kept` (top-k/top-p), renormalised over the
    `kept[t]` most likely tokens. The head runs per `EXACT_CHUNK` (`chunk_logprobs`, float32), the target's
    score through `models.scoring.target_scores`, the trainer's."""
    length = tokens.shape[0]
    if length % EXACT_CHUNK:
        raise ValueError(f"exact rows must be a multiple of {EXACT_CHUNK} long, got {length}")
    hidden = row_hidden(model, tokens, n_valid).reshape(length // EXACT_CHUNK, EXACT_CHUNK, -1)
    targets = jnp.concatenate([tokens[1:], jnp.zeros((1,), tokens.dtype)]).reshape(length // EXACT_CHUNK, EXACT_CHUNK)

    def chunk(args):
        h, t, k = args
        return target_scores(chunk_logprobs(model, h, temperature), t, k, entropy=entropy)

    ks = None if kept is None else jnp.pad(kept, (0, 1)).reshape(length // EXACT_CHUNK, EXACT_CHUNK)
    logp, ent = jax.lax.map(chunk, (hidden, targets, ks))
    valid = jnp.arange(length - 1) + 1 < n_valid
    logp = jnp.where(valid, logp.reshape(length)[:-1], 0.0)
    return logp, None if ent is None else jnp.where(valid, ent.reshape(length)[:-1], 0.0)


def next_token_logprobs(model: Transformer, tokens: Int[Array, " length"], n_valid: Int[Array, ""],
                        temperature: float | Array) -> Float[Array, " vocab"]:
    """log π(· | tokens[:n_valid]): the distribution of the next token, computed exactly as `row_scores`
    computes the log-prob of the token at position n_valid (same forward, same head chunk)."""
    hidden = row_hidden(model, tokens, n_valid)
    pos = n_valid - 1
    start = (pos // EXACT_CHUNK) * EXACT_CHUNK
    chunk = jax.lax.dynamic_slice_in_dim(hidden, start, EXACT_CHUNK, axis=0)
    return chunk_logprobs(model, chunk, temperature)[pos - start]


def exact_token_logprobs(model: Transformer, tokens: Int[Array, "rows length"], n_valid: Int[Array, " rows"],
                         temperature: float | Array, kept: Int[Array, "rows length_minus_1"] | None = None
                         ) -> Float[Array, "rows length_minus_1"]:
    """`row_scores`' log-probs of every row, each computed alone (`lax.map`, batch 1): batch-invariant by
    construction."""
    return jax.lax.map(lambda a: row_scores(model, a[0], a[1], temperature, a[2])[0], (tokens, n_valid, kept))


EXACT_BLOCK = 8  # rows per device per jitted call of the trainer's scorer (any value gives the same bits)


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh"))
def _score_block(graphdef, params, tokens, n_valid, temperature, kept=None, mesh=None):
    def rows(params, tokens, n_valid, temperature, kept):
        return exact_token_logprobs(nnx.merge(graphdef, params), tokens, n_valid, temperature, kept)

    rows = split_rows(rows, mesh, tokens.shape[0], (False, True, True, False, True))  # each device its own rows
    return rows(params, tokens, n_valid, temperature, kept)


def score_exact(graphdef: nnx.GraphDef, params, tokens: np.ndarray, attention_mask: np.ndarray,
                response_mask: np.ndarray, *, max_tokens: int, temperature: float,
                kept: np.ndarray | None = None, mesh: Mesh | None = None) -> np.ndarray:
    """Host driver of the trainer's exact scorer: log π(y_t) of a right-padded batch `[B, S]` as `[B, S-1]`,
    each row computed at its canonical length (from its prompt length, i.e. its first response target,
    and the rollout's `max_tokens`), in blocks of `EXACT_BLOCK` rows per device. Equal, bit for bit, to the
    log-probs the engine returned for the same rows in exact mode — with top-k/top-p too, given the engine's
    kept-set sizes `kept` `[B, S-1]` (`RolloutBatch.kept_count`). `mesh`: a data-parallel mesh holding `params`
    (`models.sharding.row_shards`) scores a block's rows split over its devices."""
    tokens, attention_mask, response_mask = (np.asarray(a) for a in (tokens, attention_mask, response_mask))
    b, s = tokens.shape
    n_valid = attention_mask.sum(axis=1).astype(np.int32)
    prompt_len = prompt_lengths(attention_mask, response_mask)
    lengths = np.array([canonical_length(p, max_tokens) for p in prompt_len])
    if np.any(n_valid > lengths):
        r = int(np.argmax(n_valid > lengths))
        raise ValueError(f"row {r}: {n_valid[r]} tokens exceed prompt {prompt_len[r]} + max_tokens {max_tokens}")
    shards = row_shards(mesh)
    block_rows = EXACT_BLOCK * shards
    out = np.zeros((b, s - 1), np.float32)
    for length in np.unique(lengths):
        rows = np.flatnonzero(lengths == length)
        for start in range(0, len(rows), block_rows):
            block = rows[start:start + block_rows]
            ids = np.zeros((block_rows, length), np.int32)
            n = np.zeros((block_rows,), np.int32)
            width = min(s, length)
            ids[: len(block), :width] = tokens[block, :width]
            n[: len(block)] = n_valid[block]
            k = None
            if kept is not None:
                k = np.zeros((block_rows, length - 1), np.int32)
                k[: len(block), : width - 1] = np.asarray(kept)[block, : width - 1]
                k = jnp.asarray(k)
            logp = np.asarray(_score_block(graphdef, params, jnp.asarray(ids), jnp.asarray(n), np.float32(temperature),
                                           k, mesh=mesh if shards > 1 else None))
            out[block, : width - 1] = logp[: len(block), : width - 1]
    return out * response_mask
