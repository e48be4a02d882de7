"""A packed drop-in for `models.scoring.make_scorer`: the same `fn(params, tokens, attention_mask, kept=None)
-> (log π, entropy)` on host rows, computed on packed rows (`train/packing.py`).

Why: the asynchronous loop scores every lagged row a second time, with the weights of the row's version
(π_behav, `train/behaviour.py`), on the trainer's core. Unpacked, that forward runs on the batch's padding too
(the demo's rows are about half padding) and cost more than `prepare`'s packed θ_old forward
(`benchmarks/async_rollouts.py --part behaviour`). Packed exactly as `Learner.prepare` packs (one group per
batch shard, `row_buckets` packed shapes per bucketed length), it computes the same values (fp32: ≤ 1e-5,
`tests/train/test_packed_scoring.py`) on fewer token slots, and the same way π_prox is computed, so a row
scored with the current weights gives the same π_behav as π_prox.

`train/row_scoring.py` scores a subset of the rows through it (π_behav of one lag) by zeroing the other rows'
attention masks: only the subset's sequences are packed, into a row count bucketed on the whole batch.

Packed rows carry no top-k/top-p kept-set sizes (`config_checks` forbids packing with truncated sampling);
a call with `kept` takes the unpacked scorer.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jaxrl_mismatch.models import sharding as shd
from jaxrl_mismatch.models.scoring import make_scorer
from jaxrl_mismatch.train.packing import pack_rows
from jaxrl_mismatch.train.step import forward_packed_logprobs, place_batch

Scorer = Callable[..., tuple[Float[Array, "b t"], Float[Array, "b t"]]]


def make_packed_scorer(graphdef: nnx.GraphDef, mesh: Mesh | None = None, *, chunk_size: int = 256,
                       temperature: float = 1.0, row_buckets: int | None = 8) -> Scorer:
    """`make_scorer`'s function, packing the rows on the host first (one group per batch shard of `mesh`)."""
    unpacked = make_scorer(graphdef, mesh, chunk_size=chunk_size, temperature=temperature)
    shards = math.prod(mesh.shape[a] for a in shd.batch_axes(mesh)) if mesh is not None else 1

    def packed_fn(params, packed) -> tuple[Float[Array, "b t"], Float[Array, "b t"]]:
        return forward_packed_logprobs(graphdef, params, packed, chunk_size, temperature)

    if mesh is None:
        forward = jax.jit(packed_fn)
    else:
        out_sh = shd.batch_sharding(mesh)
        forward = jax.jit(packed_fn, out_shardings=(out_sh, out_sh))

    def fn(params: Any, tokens: Int[np.ndarray, "b s"], attention_mask: Int[np.ndarray, "b s"],
           kept: Int[np.ndarray, "b t"] | None = None) -> tuple[Float[Array, "b t"], Float[Array, "b t"]]:
        if kept is not None:
            return unpacked(params, tokens, attention_mask, kept)
        layout = pack_rows(np.asarray(tokens), np.asarray(attention_mask), num_groups=shards,
                           row_buckets=row_buckets).rows
        layout = layout.replace(tokens=layout.tokens.astype(np.int32))
        return forward(params, place_batch(layout, mesh) if mesh is not None else layout)

    return fn
