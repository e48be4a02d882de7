"""The train state: one pytree holding everything the update step changes.

Keeping params, optimizer state, loss-scale state, step and rng in a single pytree makes
`update(state, batch) -> (state, metrics)` a pure function that can be jitted once, donated, sharded
and checkpointed as a unit (nanodo / big_vision style).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_mismatch.models import sharding as shd


@flax.struct.dataclass
class TrainState:
    """params: the policy's nnx.Param state (fp32 master weights); opt_state: Optax state (with the
    host-set `learning_rate`/`lr_scale` hyperparameters); loss_scale: FP16 dynamic loss scale (scale 1
    for fp32/bf16, which still skip and count a non-finite step: `train/step.py`); step: optimizer steps
    taken; rng: raw uint32 key data."""

    params: Any
    opt_state: Any
    loss_scale: Any
    step: jax.Array
    rng: jax.Array


def init_state(params: Any, opt: optax.GradientTransformation, loss_scale: Any, seed: int = 0) -> TrainState:
    """Assemble a fresh state (host side; shard it with `state_shardings` + `jax.device_put`)."""
    return TrainState(
        params=params,
        opt_state=opt.init(params),
        loss_scale=loss_scale,
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.key(seed)),
    )


def state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
    """NamedShardings for every leaf of the state.

    Params follow the model's sharding rules. Optimizer moments (Adam's mu/nu) are params-shaped
    subtrees nested inside the Optax state, so a leaf whose path *ends with* a parameter path gets that
    parameter's sharding; everything else (counts, hyperparameters, loss scale, step, rng) is replicated.
    """
    param_sh = shd.param_shardings(state.params, mesh)
    by_path = {shd.tree_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(param_sh)[0]}
    replicated = shd.replicated(mesh)

    def opt_leaf(path, leaf):
        parts = shd.tree_path(path).split("/")
        if getattr(leaf, "ndim", 0) > 0:
            for i in range(len(parts)):  # the longest suffix that is a parameter path
                if "/".join(parts[i:]) in by_path:
                    return by_path["/".join(parts[i:])]
        return NamedSharding(mesh, P(*([None] * getattr(leaf, "ndim", 0))))

    return TrainState(
        params=param_sh,
        opt_state=jax.tree_util.tree_map_with_path(opt_leaf, state.opt_state),
        loss_scale=jax.tree_util.tree_map(lambda _: replicated, state.loss_scale),
        step=replicated,
        rng=NamedSharding(mesh, P(None)),
    )


def abstract_state_of(state: Any) -> Any:
    """Abstract state (shape, dtype, sharding per leaf) of a live state: what a checkpoint restores into, in
    the same layout (`Checkpointer.restore(abstract_state=...)`)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params): the static structure and the parameter pytree the pure step works on."""
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params
