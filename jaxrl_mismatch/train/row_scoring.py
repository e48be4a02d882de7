"""Scoring some rows of a batch at the cost of those rows, with a bounded number of compiled shapes.

Why: the asynchronous trainer scores each lagged row with the weights of its version (π_behav,
`train/behaviour.py`), one forward per distinct lag. Scoring the whole batch for each lag and keeping the
lag's rows costs one full forward per lag; a batch with lags 0/1/2 in thirds paid two full forwards for two
thirds of a batch. Here a forward sees only the rows asked for:

- **packed** (`trainer.packing`, `train/packed_scoring.py`): the other rows' attention masks are zeroed, so
  only the chosen rows' sequences are packed (`pack_rows` leaves empty rows out and unpacks them to 0). The
  packed row count is still bucketed on the *whole* batch (`row_buckets` steps of its rows per group), so
  a subset compiles no shape the whole batch could not: at most `row_buckets` per bucketed length, as before.
- **unpacked** (`models.scoring.make_scorer`, or packing with top-k/top-p kept sizes): the chosen rows are
  gathered on the host and padded, by repeating the first of them, to one of `buckets` row counts (steps
  of ⌈B / buckets⌉, multiples of the batch shards): at most `buckets` programs per batch shape instead of one
  per count.

Each row's log-probs depend on that row alone (causal attention within the row or its packed segment), so
they equal the whole-batch values within float tolerance (`tests/train/test_behaviour_rows.py`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from jaxtyping import Bool, Float, Int

from jaxrl_mismatch.train import distributed

Forward = Callable[..., tuple[Any, Any]]  # `make_scorer`'s fn(params, tokens, attention_mask, kept=None)


def bucketed_rows(n: int, total: int, *, multiple: int = 1, buckets: int = 8) -> int:
    """`n` of `total` rows rounded up to a step of lcm(`multiple`, ⌈total / buckets⌉); `total` when that is
    not smaller. At most `buckets` distinct results per `total`."""
    if n <= 0:
        return 0
    quantum = math.lcm(max(1, int(multiple)), -(-int(total) // max(1, int(buckets))))
    return min(-(-int(n) // quantum) * quantum, int(total))


def score_rows(forward: Forward, params: Any, tokens: Int[np.ndarray, "b s"], attention_mask: Int[np.ndarray, "b s"],
               rows: Bool[np.ndarray, "b"], *, kept: Int[np.ndarray, "b t"] | None = None, packed: bool = False,
               multiple: int = 1, buckets: int = 8) -> Float[np.ndarray, "b t"]:
    """log π of the targets of `rows` under `params` on the host, `[B, S-1]` float32, 0 in every other row.

    `forward`: the trainer's scorer (`make_packed_scorer`'s when `packed`, else `make_scorer`'s). `multiple`:
    the batch shards (a gathered subset's row count must split over them). See the module docstring."""
    tokens, attention_mask, rows = np.asarray(tokens), np.asarray(attention_mask), np.asarray(rows, bool)
    out = np.zeros((tokens.shape[0], tokens.shape[1] - 1), np.float32)
    if not np.any(rows):
        return out
    if packed and kept is None:  # only the chosen rows' sequences are packed; the rest unpack to 0
        logp = forward(params, tokens, np.where(rows[:, None], attention_mask, 0))[0]
        out[rows] = distributed.to_host(logp)[rows]
        return out
    logp = _gathered(forward, params, tokens, attention_mask, rows, kept, multiple, buckets, outputs=(0,))[0]
    return logp.astype(np.float32, copy=False)


def score_rows_routed(forward: Forward, params: Any, tokens: Int[np.ndarray, "b s"],
                      attention_mask: Int[np.ndarray, "b s"], rows: Bool[np.ndarray, "b"], *,
                      kept: Int[np.ndarray, "b t"] | None = None, multiple: int = 1, buckets: int = 8
                      ) -> tuple[Float[np.ndarray, "b t"], Int[np.ndarray, "b t layers k"]]:
    """`score_rows` of a MoE policy, unpacked (packed rows carry no routing), with the routers' own top-k over the
    inputs `tokens[:, :-1]` (`forward`: `make_scorer(..., routed=True)`'s), 0 in every other row."""
    tokens, attention_mask, rows = np.asarray(tokens), np.asarray(attention_mask), np.asarray(rows, bool)
    if not np.any(rows):
        raise ValueError("score_rows_routed: no row chosen (the routing's shape comes from the forward)")
    logp, ids = _gathered(forward, params, tokens, attention_mask, rows, kept, multiple, buckets, outputs=(0, 2))
    return logp.astype(np.float32, copy=False), ids


def _gathered(forward, params, tokens, attention_mask, rows, kept, multiple, buckets, *, outputs: tuple[int, ...]):
    """The `outputs` of `forward` (by position) for `rows`, `[B, ...]` on the host, 0 in every other row: the rows
    gathered and padded to a bucketed count (module docstring), or the whole batch when the bucket is. At least
    one row is chosen."""
    b = tokens.shape[0]
    idx = np.flatnonzero(rows)
    m = bucketed_rows(idx.size, b, multiple=multiple, buckets=buckets)
    if m >= b:  # the bucket is the whole batch: no gather
        take = np.arange(b)
    else:  # padded with copies of a chosen row (real tokens: no all-padding row reaches the model)
        take = np.concatenate([idx, np.full(m - idx.size, idx[0])])
    sub_kept = None if kept is None else np.asarray(kept)[take]
    got = forward(params, tokens[take], attention_mask[take], sub_kept)
    result = []
    for i in outputs:
        x = distributed.to_host(got[i])
        out = np.zeros((b, *x.shape[1:]), x.dtype)
        out[idx] = x[idx] if m >= b else x[:idx.size]
        result.append(out)
    return result
