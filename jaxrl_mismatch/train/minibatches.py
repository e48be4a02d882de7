"""A step's minibatches, cut from the prepared batch where it lives: on the device.

`Learner.prepare` leaves the step's batch on the mesh (π(θ_old), π_ref, the diagnostics' weights, …);
each PPO update takes its rows from there with a jitted gather (`jit_take_rows`). Only the row indices go
up and, with `trainer.packing`, the minibatch's packed layout, planned on the host from the rollout's tokens
(`train.packing.packed_layout`), which the host has anyway. Nothing of the prepared batch comes back to the
host during the step, and the updates' statistics stay on the device until the step fetches them once.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Int

from jaxrl_mismatch.models import sharding as shd
from jaxrl_mismatch.train.batch import RolloutBatch


def minibatch_order(seed: int, epoch: int, num_rows: int, minibatches: int) -> Int[np.ndarray, "rows"]:
    """The rows of PPO epoch `epoch` in minibatch order: a fresh permutation per epoch (one minibatch: as is)."""
    if minibatches == 1:
        return np.arange(num_rows)
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def place_rows(rows: Int[np.ndarray, "rows"], mesh: Mesh) -> jax.Array:
    """Row indices as a replicated int32 array (every process passes the same indices on multi-host)."""
    h = np.asarray(rows, np.int32)
    return jax.make_array_from_callback(h.shape, shd.replicated(mesh), lambda idx: h[idx])


def jit_take_rows(mesh: Mesh) -> Callable[[RolloutBatch, jax.Array], RolloutBatch]:
    """`take(batch, rows)`: the device batch restricted to `rows`, on the batch sharding (a gather on the
    device: the same values `RolloutBatch.rows` takes on the host). A packing describes whole batches, so the
    batch must carry none."""

    def take(batch: RolloutBatch, rows: jax.Array) -> RolloutBatch:
        if batch.packed is not None:
            raise ValueError("take_rows: a packed layout describes its whole batch; pack the minibatch instead")
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x[rows], shd.batch_sharding(mesh, x.ndim)),
                            batch)

    return jax.jit(take)
