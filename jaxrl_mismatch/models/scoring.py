"""The one scorer: log π(y_t), the entropy of π(·|y_<t) and what the MoE routers did, teacher-forced.

Every place that turns a policy's weights into per-token log-probs goes through here — the trainer's θ_old
and reference forwards (`train.step.make_prepare_fn`), the update's θ forward (`make_update_fn`), exact mode
(`models.exact`, `train.exact_forward`, the exact samplers) and the offline mismatch analysis
(`jobs/analyze_rollouts.py`, `jobs/attribute.py`) — so the tool that measures the training–inference mismatch
scores exactly as the trainer trains. Two layers:

- `head_logprobs` (`logprobs_from_logits`) + `target_scores`: the LM head, softmax(logits / T) in the policy's
  logits dtype, the target's log-prob, the entropy, and top-k/top-p renormalisation over the engine's kept set.
  The batch-invariant per-row programs of `models.exact` share `target_scores` but run their own head
  (`exact.chunk_logprobs`: the division and log-softmax in float32, because their samplers draw from what they
  report), so exact mode's π is the exact scorer's, not this head's: the two differ by the logits dtype's rounding.
- `token_logprobs` / `logprobs_from_hidden` / `score_tokens` / `make_scorer`: the batched forward.

Memory: with Qwen's ~152k vocabulary, a batch of 64 × 4k tokens has 4e10 logits (160 GB in float32), far
more than the transformer's activations. The LM head and the log-softmax therefore run over sequence
chunks inside `lax.map`, and each chunk is wrapped in `jax.checkpoint` so the backward pass recomputes
that chunk's logits instead of storing them: peak memory is one chunk's `[B, C, V]` in both passes.
`tests/models/test_logprobs_memory.py` checks this on the compiled program's memory analysis.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jaxrl_mismatch.models import sharding as shd
from jaxrl_mismatch.models.model import Transformer, positions_from_mask, positions_from_segments
from jaxrl_mismatch.models.moe import RouterOutput, routing_dtype
from jaxrl_mismatch.models.truncation import truncate_to_count, truncated_entropy


def logprobs_from_logits(logits: Float[Array, "*lead vocab"], temperature: float | Array
                         ) -> Float[Array, "*lead vocab"]:
    """log softmax(logits / T) in the logits' dtype — the policy's `logits_dtype` (its rounding is part of what
    the precision policy controls).

    `temperature` scores the distribution an engine sampling at T drew from, so the trainer's π and the
    engine's μ describe the same distribution (FP16 paper §3.5)."""
    logits = logits / jnp.asarray(temperature, logits.dtype)  # x / 1 = x exactly: T = 1 costs no bits
    return jax.nn.log_softmax(logits, axis=-1)


def head_logprobs(model: Transformer, hidden: Float[Array, "*lead hidden"], temperature: float | Array
                  ) -> Float[Array, "*lead vocab"]:
    """`logprobs_from_logits` of the LM head applied to final hidden states."""
    return logprobs_from_logits(model.logits(hidden), temperature)


def target_scores(logp_all: Float[Array, "*lead vocab"], targets: Int[Array, "*lead"],
                  kept: Int[Array, "*lead"] | None = None, *, entropy: bool = True
                  ) -> tuple[Float[Array, "*lead"], Float[Array, "*lead"] | None]:
    """(log π(target), entropy of π), float32, from a log-distribution; `entropy=False` leaves the entropy out
    of the program (None). `kept` (top-k/top-p rollouts): per target, the engine's kept-set size; π is
    renormalised over the `kept` most likely tokens of its own distribution (`models.truncation`; 0 = the
    whole vocabulary), the target always kept.

    Where the float32 cast goes is part of the program's bits: in a fused bf16/fp16 program XLA may drop a
    rounding whose result is cast up at once (excess precision), so the target is gathered in the given dtype
    and then cast (a caller that wants the cast first, as the exact programs do, passes float32)."""
    if kept is not None:
        logp_all = truncate_to_count(logp_all.astype(jnp.float32), kept, targets)
        logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
        return logp, truncated_entropy(logp_all) if entropy else None
    logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0].astype(jnp.float32)
    if not entropy:
        return logp, None
    logp_all = logp_all.astype(jnp.float32)
    return logp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


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

    Callers pass `input_ids = tokens[:, :-1]`, `targets = tokens[:, 1:]` and the input's attention
    mask. Values at padded input positions (attention_mask == 0) are 0, so they never leak into a
    masked sum. The log-softmax runs in `policy.logits_dtype`; the gather and the entropy sum are in float32.

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
    """The LM-head part of `token_logprobs` (`head_logprobs` + `target_scores` over sequence chunks), for
    callers that already have the final hidden states."""
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
        return target_scores(head_logprobs(nnx.merge(graphdef, state), h, temperature), t, k)

    if k_chunks is None:
        logp, entropy = jax.lax.map(lambda xs: chunk(state, *xs, None), (h_chunks, t_chunks))
    else:
        logp, entropy = jax.lax.map(lambda xs: chunk(state, *xs), (h_chunks, t_chunks, k_chunks))
    logp = logp.transpose(1, 0, 2).reshape(b, n * c)[:, :s]
    entropy = entropy.transpose(1, 0, 2).reshape(b, n * c)[:, :s]
    valid = attention_mask > 0  # also segment ids
    return jnp.where(valid, logp, 0.0), jnp.where(valid, entropy, 0.0)


class Scores(NamedTuple):
    """What `score_tokens` returns: per target `tokens[:, 1:]`, and the routers over the inputs `tokens[:, :-1]`."""

    logp: Float[Array, "b t"]
    entropy: Float[Array, "b t"]
    router: RouterOutput | None  # None for a dense model


def score_tokens(
    graphdef: nnx.GraphDef, params: Any, tokens: Int[Array, "b s"], attention_mask: Int[Array, "b s"], *,
    chunk_size: int = 256, temperature: float = 1.0, routing: Int[Array, "b s layers k"] | None = None,
    kept: Int[Array, "b t"] | None = None,
) -> Scores:
    """The trainer's teacher-forced forward: (log π(y_t), entropy, router outputs) of every target `tokens[:, 1:]`.

    The θ_old and reference forwards of `prepare`, the update's θ forward, the asynchronous behaviour scorer
    and `analyze` all call this. `temperature`: the rollout's (π scores softmax(logits / T), what μ sampled);
    `kept`: the engine's top-k/top-p kept-set sizes, renormalising π over the same support; `routing` (aligned
    with `tokens`, like `RolloutBatch.routing`) replays those experts for the inputs (routing replay R3)."""
    model = nnx.merge(graphdef, params)
    ids, mask = tokens[:, :-1], attention_mask[:, :-1]
    hidden, router = model.forward_routed(ids, positions_from_mask(mask), mask,
                                          routing=None if routing is None else routing[:, :-1])
    logp, entropy = logprobs_from_hidden(model, hidden, tokens[:, 1:], mask, chunk_size=chunk_size,
                                         temperature=temperature, kept=kept)
    return Scores(logp, entropy, router)


def make_scorer(graphdef: nnx.GraphDef, mesh: Mesh | None = None, *, chunk_size: int = 256,
                temperature: float = 1.0, routed: bool = False):
    """`score_tokens` jitted: `fn(params, tokens, attention_mask, kept=None) -> (logp, entropy)`, each `[B, S-1]`
    float32, sharded like the batch on `mesh` (None: wherever jit puts them). Params keep their sharding.

    `routed` (a MoE policy): a third output, the routers' own top-k over the inputs `tokens[:, :-1]`,
    `[B, S-1, sparse layers, k]` in the engines' narrow type (`models.moe.routing_dtype`): what the asynchronous
    behaviour scorer compares with θ_old's and the engine's routing (`metrics/moe.py`)."""

    def fn(params, tokens, attention_mask, kept=None):
        s = score_tokens(graphdef, params, tokens, attention_mask, chunk_size=chunk_size, temperature=temperature,
                         kept=kept)
        if not routed:
            return s.logp, s.entropy
        if s.router is None:
            raise ValueError("make_scorer(routed=True) needs a mixture-of-experts policy; this one has no router")
        return s.logp, s.entropy, s.router.router_ids.astype(routing_dtype(s.router.load.shape[-1]))

    if mesh is None:
        return jax.jit(fn)
    out_sh = shd.batch_sharding(mesh)
    return jax.jit(fn, out_shardings=(out_sh,) * (3 if routed else 2))
