"""`RolloutBatch`: the one batch type from rollouts to the jitted step.

Layout (leading dim B = prompts × group size, sharded over ("data", "fsdp"); S = bucketed length):

    tokens          int32 [B, S]    prompt + response, right padded (`data.batching.pad_rows`)
    attention_mask  int32 [B, S]    1 on real tokens
    response_mask   f32   [B, S-1]  1 where targets = tokens[:, 1:] is a response token
    advantages      f32   [B, S-1]  per-token advantage (the sequence advantage broadcast over its tokens)
    rollout_logp    f32   [B, S-1]  log μ(y_t | θ_old), from the rollout engine
    old_logp        f32   [B, S-1]  log π(y_t | θ_old): filled by `Learner.prepare` (the θ_old forward)
    ref_logp        f32   [B, S-1]  reference policy, only with a KL penalty
    token_weight    f32   [B, S-1]  objective-hacking diagnostics φ (eq. 18) × ξ (eq. 21), only when on
    routing         uint8 [B, S, L, k]  MoE: the experts the engine's L sparse layers chose for each token
                                        (as model input), aligned with `tokens`; 0 on padding; uint16 past
                                        256 experts (`models.moe.routing_dtype`: 4x less than int32). Only when
                                        the engine returns it (`SamplingSpec.return_routing`); `prepare`
                                        drops it (the update never reads it)
    kept_count      int32 [B, S-1]  top-k/top-p: the engine's kept-set size when it sampled each response
                                    token (0 elsewhere = no truncation); π is renormalised over the same support
    replay_routing  uint8 [B, S, L, k]  MoE routing replay: the experts the θ forward of the update uses
                                        (R2: θ_old's own routing, R3: the engine's), filled by `prepare`
    packed          PackedRows          sequence packing (`trainer.packing`; `train/packing.py`) for the
                                        θ_old / reference forwards of `prepare` (the whole batch) and the
                                        update's θ forward (a minibatch); its `[P, L]` arrays have their own
                                        leading dim P, split like B (devices, microbatches)
    version_lag     int32 [B]       asynchronous rollouts: current weight version − the version the row's
                                    sample was generated with (`train/rollout_producer.py`); 0 when synchronous
    behav_logp      f32   [B, S-1]  log π_behav: the trainer's policy at the row's sample version (rows with
                                    lag > 0; `Learner.prepare`), for the staleness/precision split
                                    (`metrics/staleness.py`); `prepare` drops both (the update never reads them)
    behav_routing   uint8 [B, S-1, L, k]  MoE + asynchronous rollouts: the router's own top-k at the row's
                                    sample version (π_behav's routing) over the inputs `tokens[:, :-1]`, rows with
                                    lag > 0 (0 elsewhere), for the routing split of `moe/*` (`metrics/moe.py`);
                                    `prepare` drops it

The optional fields are None when absent; a pytree with None fields has no leaves there, so jit sees a
fixed structure per run. The fields without a default are what the rollout produces: multi-host
broadcast sends exactly those (`ROLLOUT_FIELDS`), plus `routing` / `kept_count` when the run has them
(`rollout_fields(with_routing=, with_kept=)`; `train.distributed.lead_computes`, which on one process is
a plain call). Every process then computes the rest itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.struct
import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrl_mismatch.data.batching import pad_rows

Rows = Any  # numpy index / slice of rows


@flax.struct.dataclass
class PackedRows:
    """The packed layout of a batch (`train.packing.pack_rows` / `pack_batch`): `P` rows of `L` tokens holding
    whole sequences, and where each unpacked target `[B, S-1]` sits among the packed ones.

    tokens, segment_ids, positions: `[P, L]` int32 packed rows; segment ids 1, 2, … per sequence in a row,
        0 on padding; positions counted from 0 within each sequence.
    unpack_index: `[B, S-1]` for original row b and target t (predicting tokens[b, t+1]), the index of the
        same target in its group's flattened packed per-target array `[P/G · (L-1)]`.
    unpack_valid: `[B, S-1]` False where (b, t) has no packed counterpart: padding, and a sequence's last
        token (its unpacked target is padding; packed, it is the next sequence's first token).
    num_groups G (static): rows [g·B/G, (g+1)·B/G) are packed into packed rows [g·P/G, (g+1)·P/G) and
    `unpack_index` counts within the group, so splitting every array into G (or a divisor of G) leading
    blocks keeps each block self-contained (microbatches; one block per device)."""

    tokens: Int[Array, "p l"]
    segment_ids: Int[Array, "p l"]
    positions: Int[Array, "p l"]
    unpack_index: Int[Array, "b t"]
    unpack_valid: Bool[Array, "b t"]
    num_groups: int = flax.struct.field(pytree_node=False, default=1)


@flax.struct.dataclass
class RolloutBatch:
    tokens: Int[Array, "b s"]
    attention_mask: Int[Array, "b s"]
    response_mask: Float[Array, "b t"]
    advantages: Float[Array, "b t"]
    rollout_logp: Float[Array, "b t"]
    old_logp: Float[Array, "b t"] | None = None
    ref_logp: Float[Array, "b t"] | None = None
    token_weight: Float[Array, "b t"] | None = None
    routing: Int[Array, "b s layers k"] | None = None
    replay_routing: Int[Array, "b s layers k"] | None = None
    packed: PackedRows | None = None
    version_lag: Int[Array, "b"] | None = None
    behav_logp: Float[Array, "b t"] | None = None
    behav_routing: Int[Array, "b t layers k"] | None = None
    kept_count: Int[Array, "b t"] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def rows(self, idx: Rows) -> RolloutBatch:
        """The batch restricted to rows `idx` (host arrays); a packing describes whole batches, so it is dropped."""
        return jax.tree.map(lambda x: x[idx], self.replace(packed=None))

    def arrays(self) -> dict[str, Any]:
        """The present fields by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


ROLLOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RolloutBatch)
                                        if f.default is dataclasses.MISSING)


def rollout_fields(*, with_routing: bool, with_kept: bool = False) -> tuple[str, ...]:
    """The fields the rollout produces and multi-host broadcast sends: `ROLLOUT_FIELDS` (+ `routing`,
    + `kept_count` with top-k/top-p)."""
    return ROLLOUT_FIELDS + (("routing",) if with_routing else ()) + (("kept_count",) if with_kept else ())


def routing_rows(routing: Sequence[np.ndarray], seq_len: int) -> np.ndarray:
    """`[B, seq_len, L, k]` of per-row `[len(prompt) + len(completion), L, k]` routings, right-padded with 0 like
    `tokens` (`data.batching.pad_rows` puts prompt + completion at the start of each row). The engines' unsigned
    ids keep their width (uint8 up to 256 experts: at the sizes MoE configs name this array is tens of GB as
    int32); any other integer type becomes int32."""
    shapes = {tuple(r.shape[1:]) for r in routing}
    if len(shapes) != 1 or any(r.ndim != 3 for r in routing):
        raise ValueError(f"routing: every completion needs a [tokens, layers, k] array of one shape, got {sorted(shapes)}")
    dtype = np.result_type(*routing)
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"routing: expert ids must be integers, got {dtype}")
    if not (np.issubdtype(dtype, np.unsignedinteger) and dtype.itemsize <= 2):
        dtype = np.dtype(np.int32)
    out = np.zeros((len(routing), seq_len, *shapes.pop()), dtype)
    for i, r in enumerate(routing):
        if r.shape[0] > seq_len:
            raise ValueError(f"routing: row {i} has {r.shape[0]} tokens > the batch's {seq_len}")
        out[i, : r.shape[0]] = r
    return out


def from_completions(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                     rollout_logp: Sequence[Sequence[float]], seq_advantages: np.ndarray, *,
                     pad_id: int, routing: Sequence[np.ndarray] | None = None,
                     kept_counts: Sequence[Sequence[int]] | None = None) -> RolloutBatch:
    """Host batch of one row per completion; `seq_advantages[i]` is broadcast over row i's response tokens;
    `routing` (MoE, `Completion.routing` of every row) becomes the `routing` field, `kept_counts`
    (`Completion.kept_counts`, top-k/top-p) the `kept_count` field, aligned with the response targets."""
    rows = pad_rows(prompt_ids, completion_ids, rollout_logp, pad_id=pad_id)
    kept = None
    if kept_counts is not None:
        kept = np.zeros(rows.response_mask.shape, np.int32)
        for i, counts in enumerate(kept_counts):
            where = np.flatnonzero(rows.response_mask[i] > 0)
            if len(counts) != len(where):
                raise ValueError(f"kept_counts: row {i} has {len(counts)} for {len(where)} response tokens")
            kept[i, where] = counts
    adv = np.asarray(seq_advantages, np.float32)[:, None] * rows.response_mask
    return RolloutBatch(tokens=rows.tokens, attention_mask=rows.attention_mask, response_mask=rows.response_mask,
                        advantages=adv.astype(np.float32), rollout_logp=rows.rollout_logp,
                        routing=None if routing is None else routing_rows(routing, rows.tokens.shape[1]),
                        kept_count=kept)
