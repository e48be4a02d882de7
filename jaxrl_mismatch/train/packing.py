"""Sequence packing for the step's forwards: many short (prompt + response) rows of an RL batch in fewer rows.

RL batches are very uneven: a group of 8 samples may hold a 12-token and a 60-token response, and every row
is padded to the batch's bucketed length, so most of the compute of the θ_old forward and of the update
runs on padding. Packing places whole sequences one after another in rows of a fixed length; each packed
token carries a **segment id** (1, 2, … within its row, 0 on padding) and a **position** counted from 0
within its sequence. The model attends only within a segment (`models.attention`: query i sees key j iff
same segment and j ≤ i) and rotates by those positions, so a packed sequence's log-probs equal its
unpacked ones (`tests/train/test_packing.py`, fp32, ≤ 1e-5).

The trainer packs when `trainer.packing = True`, twice per step: `Learner.prepare` packs the whole batch
(one group per batch shard) for the θ_old and reference forwards, and `Learner.optimize` packs each
minibatch (one group per microbatch) for the update's θ forward — planned on the host from the rollout's
tokens (`packed_layout`) while the minibatch's other fields stay on the device (`train/minibatches.py`).
Both forwards (`train.step.forward_packed_logprobs`) do what this sketch shows (host side, then inside jit):

    packed = pack_rows(batch.tokens, batch.attention_mask, num_groups=microbatches).rows  # numpy, host
    # in the jitted update/prepare, per microbatch (or with num_groups for the whole batch):
    logp_p, ent_p = token_logprobs(model, packed.tokens[:, :-1], packed.tokens[:, 1:], None,
                                   segment_ids=packed.segment_ids[:, :-1], positions=packed.positions[:, :-1])
    logp = unpack_targets(logp_p, packed.unpack_index, packed.unpack_valid)          # [B, S-1] again
    entropy = unpack_targets(ent_p, packed.unpack_index, packed.unpack_valid)

after which the objective runs unchanged on the unpacked `[B, S-1]` layout (masks, advantages, μ, sequence
aggregations all as before). Only the transformer runs packed.

**Groups.** `num_groups = G` packs rows [g·B/G, (g+1)·B/G) into packed rows [g·P/G, (g+1)·P/G) and makes
`unpack_index` local to its group, so splitting every array into G equal leading blocks (the step's
`_split_microbatches`) keeps each microbatch's sequences and their packed rows together: inside one
microbatch `unpack_targets(..., num_groups=1)` is right. For the whole batch at once pass `num_groups=G`.
With data parallelism, G = microbatches × data-parallel devices keeps every gather on its device.

**Few shapes.** The packed row length is the unpacked one unless `length` is given; the row count per
group is the most any group needs, rounded up to `rows_multiple` and to one of `row_buckets` steps of the
group's unpacked row count (or exactly `rows_per_group`, raising if the sequences do not fit). First-fit
decreasing never needs more rows than sequences, so a run compiles at most `row_buckets` packed shapes per
bucketed length (the trainer's default 8 wastes at most 1/8 of the unpacked slots to rounding; without
buckets nearly every batch would be a new shape and a new compilation). Empty rows are all padding.

Each input row must hold one contiguous sequence (right-, left- or un-padded), as `data.batching.pad_rows`
produces. Placement is first-fit decreasing (Johnson 1973), at most 11/9·OPT + 1 rows per group.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxrl_mismatch.train.batch import PackedRows, RolloutBatch


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """`pack_rows`'s result: the packed layout and where each original row's sequence went.

    rows: the layout the θ forwards consume (`train.batch.PackedRows`, what `pack_batch` puts in
        `RolloutBatch.packed`): `[P, L]` tokens / segment ids / positions and the `[B, S-1]` unpack index.
    row, offset, length: `[B]` host bookkeeping — the group-local packed row and slot of each original row's
        sequence and its length in tokens (0: an empty row, not placed).
    """

    rows: PackedRows
    row: np.ndarray
    offset: np.ndarray
    length: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.rows.tokens.shape[0])

    def padding_stats(self, unpacked_shape: tuple[int, int]) -> dict[str, float]:
        """Token slots before and after packing, and the share of padding in each."""
        real = int(self.length.sum())
        before = int(unpacked_shape[0] * unpacked_shape[1])
        after = int(self.rows.tokens.size)
        return {
            "real_tokens": real, "slots_unpacked": before, "slots_packed": after,
            "padding_unpacked": 1.0 - real / before, "padding_packed": 1.0 - real / after,
            "slots_saved": 1.0 - after / before, "rows_unpacked": int(unpacked_shape[0]), "rows_packed": self.num_rows,
        }


def _first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(row, offset) per item and the number of rows, placing the longest items first."""
    row = np.full(len(lengths), -1, np.int64)
    offset = np.zeros(len(lengths), np.int64)
    free: list[int] = []  # remaining capacity per open row
    for i in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        n = int(lengths[i])
        if n == 0:
            continue
        for r, room in enumerate(free):
            if room >= n:
                break
        else:
            r = len(free)
            free.append(capacity)
        row[i], offset[i] = r, capacity - free[r]
        free[r] -= n
    return row, offset, len(free)


def pack_rows(
    tokens: Int[np.ndarray, "batch seq"],
    attention_mask: Int[np.ndarray, "batch seq"],
    *,
    length: int | None = None,
    num_groups: int = 1,
    rows_multiple: int = 1,
    row_buckets: int | None = None,
    rows_per_group: int | None = None,
    pad_id: int = 0,
) -> PackedBatch:
    """Pack the sequences of a padded batch into rows of `length` tokens (default: the batch's own length).

    Rows per group: what first-fit decreasing needs, rounded up to a multiple of `rows_multiple` and, with
    `row_buckets` = k, of ⌈(B/G) / k⌉ — at most k row counts per batch shape, so a jitted consumer compiles
    at most k programs per bucketed length instead of one for nearly every batch; exactly `rows_per_group`
    when given.

    Raises:
        ValueError: naming the row, if a row's real tokens are not contiguous or longer than `length`; if
            the batch does not split into `num_groups`; if the sequences need more than `rows_per_group`.
    """
    tokens, mask = np.asarray(tokens), np.asarray(attention_mask) > 0
    b, s = tokens.shape
    length = s if length is None else int(length)
    if num_groups < 1 or b % num_groups:
        raise ValueError(f"pack_rows: batch of {b} rows does not split into num_groups={num_groups}")
    n = mask.sum(axis=1)
    start = np.argmax(mask, axis=1)
    contiguous = mask.sum(axis=1) == np.array([mask[i, start[i]:start[i] + n[i]].sum() for i in range(b)])
    if not contiguous.all():
        bad = int(np.flatnonzero(~contiguous)[0])
        raise ValueError(f"pack_rows: row {bad} has padding between its tokens (one contiguous sequence per row)")
    if n.max(initial=0) > length:
        bad = int(np.argmax(n))
        raise ValueError(f"pack_rows: row {bad} has {n[bad]} tokens, more than the packed length {length}")

    bg = b // num_groups
    placements = [_first_fit_decreasing(n[g * bg:(g + 1) * bg], length) for g in range(num_groups)]
    need = max(p[2] for p in placements)
    quantum = math.lcm(rows_multiple, -(-bg // row_buckets)) if row_buckets else rows_multiple
    rows = -(-max(need, 1) // quantum) * quantum
    if rows_per_group is not None:
        if need > rows_per_group:
            raise ValueError(f"pack_rows: the sequences need {need} rows per group, rows_per_group={rows_per_group}")
        rows = rows_per_group

    out_tokens = np.full((num_groups * rows, length), pad_id, tokens.dtype)
    seg = np.zeros((num_groups * rows, length), np.int32)
    pos = np.zeros((num_groups * rows, length), np.int32)
    row = np.concatenate([p[0] for p in placements]).astype(np.int32)
    offset = np.concatenate([p[1] for p in placements]).astype(np.int32)
    index = np.zeros((b, s - 1), np.int32)
    valid = np.zeros((b, s - 1), bool)
    next_segment = np.ones(num_groups * rows, np.int32)
    for i in np.argsort(offset, kind="stable"):  # by offset: segment ids increase along each row
        if n[i] == 0:
            continue
        g = i // bg
        r_global = g * rows + row[i]
        o, k, st = int(offset[i]), int(n[i]), int(start[i])
        out_tokens[r_global, o:o + k] = tokens[i, st:st + k]
        seg[r_global, o:o + k] = next_segment[r_global]
        next_segment[r_global] += 1
        pos[r_global, o:o + k] = np.arange(k)
        # unpacked target t in [st, st + k - 1) <-> packed target o + (t - st) of group-local row `row[i]`
        t = np.arange(st, st + k - 1)
        index[i, t] = row[i] * (length - 1) + o + (t - st)
        valid[i, t] = True
    layout = PackedRows(tokens=out_tokens, segment_ids=seg, positions=pos, unpack_index=index, unpack_valid=valid,
                        num_groups=num_groups)
    return PackedBatch(rows=layout, row=row, offset=offset, length=n.astype(np.int32))


def unpack_targets(
    packed_values: Float[Array, "rows length_minus_1"],
    unpack_index: Int[Array, "batch seq_minus_1"],
    unpack_valid: Bool[Array, "batch seq_minus_1"],
    *,
    num_groups: int = 1,
) -> Float[Array, "batch seq_minus_1"]:
    """Per-target values of packed rows (e.g. `token_logprobs` on the packed batch) in the original `[B, S-1]`
    layout, 0 where `unpack_valid` is False. numpy or jax arrays; a gather, so it runs inside jit."""
    xp = _namespace(packed_values)
    g = num_groups
    flat = packed_values.reshape(g, -1)
    idx = unpack_index.reshape(g, -1)
    out = xp.take_along_axis(flat, idx, axis=1).reshape(unpack_index.shape)
    return xp.where(unpack_valid, out, xp.zeros((), out.dtype))


def pack_targets(values: Float[np.ndarray, "batch seq_minus_1"], packed: PackedRows) -> np.ndarray:
    """The inverse of `unpack_targets` on the host: an unpacked per-target array (response mask, advantages,
    μ, …) in the packed `[P, L-1]` layout, 0 where no unpacked target maps (padding, sequence ends)."""
    values = np.asarray(values)
    g = packed.num_groups
    p, length = packed.tokens.shape
    out = np.zeros((g, (p // g) * (length - 1)), values.dtype)
    idx = packed.unpack_index.reshape(g, -1)
    valid = packed.unpack_valid.reshape(g, -1)
    vals = values.reshape(g, -1)
    for k in range(g):
        out[k, idx[k][valid[k]]] = vals[k][valid[k]]
    return out.reshape(p, length - 1)


def _namespace(x):
    if isinstance(x, np.ndarray):
        return np
    import jax.numpy as jnp

    return jnp


def pack_batch(batch: RolloutBatch, *, num_groups: int, shards: int = 1, row_buckets: int | None = 8,
               microbatches: bool = False) -> RolloutBatch:
    """`batch` (a host `RolloutBatch`) with `packed` set: its rows packed in `num_groups` groups, with a
    packed row count that `shards` (the devices the batch is split over, `models.sharding.batch_axes`) divides
    and that takes one of `row_buckets` values per batch shape (`pack_rows`): every new packed shape is a new
    compilation of the step, and the number of rows a batch needs changes from batch to batch.

    For the update, one group per microbatch (`microbatches=True`: each microbatch's sequences and packed rows
    split together, and each microbatch is spread over all the shards, so each group's row count is a multiple
    of `shards`); for `prepare`'s whole batch, one group per shard (each device's rows pack among themselves, so
    the unpacking gather stays on the device). The θ forwards then run on the packed rows and unpack log π
    and entropy to `[B, S-1]` (`train.step`); everything else in the batch keeps its unpacked layout."""
    return batch.replace(packed=packed_layout(np.asarray(batch.tokens), np.asarray(batch.attention_mask),
                                              num_groups=num_groups, shards=shards, row_buckets=row_buckets,
                                              microbatches=microbatches))


def packed_layout(tokens: Int[np.ndarray, "batch seq"], attention_mask: Int[np.ndarray, "batch seq"], *,
                  num_groups: int, shards: int = 1, row_buckets: int | None = 8,
                  microbatches: bool = False) -> PackedRows:
    """`pack_batch`'s layout from the rows' tokens alone: what `Learner.optimize` plans for a minibatch of
    a prepared batch that stays on the device (the host keeps the rollout's tokens, not the prepared fields).

    `microbatches`: the update splits the groups into microbatches and spreads each over all `shards`
    (`train.step._split_rows`), so every group's rows must split evenly over them; a microbatch that did not
    was left unconstrained, gathered, and computed in full on every device (measured: 8 devices, 4
    microbatches, 12 packed rows each, 2.9× the FLOPs per device of a 16-row layout). Otherwise whole groups sit
    on the shards and only the total must split."""
    rows_multiple = shards if microbatches else shards // math.gcd(num_groups, shards)
    p = pack_rows(tokens, attention_mask, num_groups=num_groups, rows_multiple=rows_multiple, row_buckets=row_buckets)
    return p.rows.replace(tokens=p.rows.tokens.astype(np.int32))
