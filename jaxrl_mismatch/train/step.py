"""The pure, sharded policy update and the θ_old forward.

`update(state, batch) -> (state, metrics)` is jitted once with explicit NamedShardings and a donated
state. Inside it: gradient accumulation over microbatches with `lax.scan` (the objective divides by a
normaliser computed once over the whole minibatch, so the accumulated gradient equals the whole-batch
gradient), FP16 dynamic loss scaling (a non-finite step is skipped and counted — for every precision,
so a NaN never reaches the params), global-norm clipping inside the Optax chain, and the step's
measurements (big_vision style): grad norm raw / after clipping / per response token (LR paper Fig. 3),
update and param norms, loss scale, and the objective's loss and mismatch metrics.

The learning rate is not an argument: it lives in the Optax state as an `inject_hyperparams`
float32 set by the host between steps (`schedules.set_lr_scale`), so a new value never retraces.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Float

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import sharding as shd
from jaxrl_mismatch.models.logprobs import token_logprobs
from jaxrl_mismatch.train.state import TrainState, state_shardings

Batch = Mapping[str, jax.Array]

# Batch layout (all leading dim B, sharded over ("data", "fsdp")):
#   tokens          int32 [B, S]    prompt + response, right padded
#   attention_mask  int32 [B, S]    1 on real tokens (left padding allowed)
#   response_mask   f32   [B, S-1]  1 where targets = tokens[:, 1:] is a response token
#   advantages      f32   [B, S-1]  per-token advantage (sequence advantage broadcast)
#   old_logp        f32   [B, S-1]  log π(y_t | θ_old), from `make_old_logprobs`
#   rollout_logp    f32   [B, S-1]  log μ(y_t | θ_old), from the rollout engine
#   ref_logp        f32   [B, S-1]  optional, reference policy for a KL penalty
BATCH_KEYS = ("tokens", "attention_mask", "response_mask", "advantages", "old_logp", "rollout_logp")


class Objective(Protocol):
    """What the step needs from a loss: a global normaliser, the microbatch loss, and batch metrics."""

    def normaliser(self, batch: Batch) -> jax.Array: ...

    def loss(self, logp: jax.Array, entropy: jax.Array, mb: Batch, normaliser: jax.Array) -> tuple[jax.Array, dict]: ...

    def metrics(self, logp: jax.Array, entropy: jax.Array, batch: Batch) -> dict[str, jax.Array]: ...


def _forward_logprobs(graphdef: nnx.GraphDef, params: Any, tokens, attention_mask, chunk_size: int,
                      temperature: float = 1.0):
    model = nnx.merge(graphdef, params)
    return token_logprobs(model, tokens[:, :-1], tokens[:, 1:], attention_mask[:, :-1], chunk_size=chunk_size,
                          temperature=temperature)


def _split_microbatches(batch: Batch, num_microbatches: int) -> Batch:
    def split(x):
        b = x.shape[0]
        if b % num_microbatches:
            raise ValueError(f"batch size {b} is not divisible by num_microbatches={num_microbatches}")
        return x.reshape((num_microbatches, b // num_microbatches) + x.shape[1:])

    return {k: split(v) for k, v in batch.items()}


def _merge_microbatches(x: jax.Array) -> jax.Array:
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def make_update_fn(
    graphdef: nnx.GraphDef,
    opt: optax.GradientTransformation,
    objective: Objective,
    *,
    num_microbatches: int = 1,
    max_grad_norm: float | None = 1.0,
    chunk_size: int = 256,
    temperature: float = 1.0,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The pure update function (not yet jitted; see `jit_update`).

    `temperature` is the rollout sampling temperature: π is scored as softmax(logits / T), the
    distribution μ sampled from, so ρ = π/μ compares like with like.
    """

    def microbatch_loss(params, mb, normaliser, scale_state):
        logp, entropy = _forward_logprobs(graphdef, params, mb["tokens"], mb["attention_mask"], chunk_size,
                                          temperature)
        loss, aux = objective.loss(logp, entropy, mb, normaliser)
        return precision.scale_loss(scale_state, loss), (loss, aux, logp, entropy)

    grad_fn = jax.grad(microbatch_loss, has_aux=True)

    def update(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        normaliser = objective.normaliser(batch)
        mbs = _split_microbatches(dict(batch), num_microbatches)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)

        # Each microbatch's loss and aux values are its additive share of the whole-batch value (the
        # objective divides by whole-batch normalisers), so sums over the scan are the batch values.
        aux_zeros = jax.tree_util.tree_map(
            lambda x: jnp.zeros(x.shape, jnp.float32),
            jax.eval_shape(lambda: grad_fn(state.params, jax.tree_util.tree_map(lambda x: x[0], mbs),
                                           normaliser, state.loss_scale)[1][1]),
        )

        def body(acc, mb):
            grads, (loss, aux, logp, entropy) = grad_fn(state.params, mb, normaliser, state.loss_scale)
            acc_grads, acc_loss, acc_aux = acc
            acc_grads = jax.tree_util.tree_map(jnp.add, acc_grads, grads)
            acc_aux = jax.tree_util.tree_map(jnp.add, acc_aux, aux)
            return (acc_grads, acc_loss + loss, acc_aux), (logp, entropy)

        init = (zeros, jnp.zeros((), jnp.float32), aux_zeros)
        (grads, loss, aux), (logp, entropy) = jax.lax.scan(body, init, mbs)
        logp, entropy = _merge_microbatches(logp), _merge_microbatches(entropy)

        grads, finite = precision.unscale_and_check(state.loss_scale, grads)
        grad_norm = optax.global_norm(grads)
        updates, new_opt_state = opt.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)

        # Skip the whole step (params, optimizer moments, step counter) on a non-finite gradient.
        params = precision.select_tree(finite, new_params, state.params)
        opt_state = precision.select_tree(finite, new_opt_state, state.opt_state)
        new_state = TrainState(
            params=params,
            opt_state=opt_state,
            loss_scale=precision.update_scale(state.loss_scale, finite),
            step=state.step + finite.astype(jnp.int32),
            rng=state.rng,
        )

        metrics = dict(objective.metrics(logp, entropy, batch))
        metrics.update(aux)
        mean_len = jnp.maximum(jnp.sum(batch["response_mask"]) / batch["response_mask"].shape[0], 1.0)
        clipped = grad_norm if max_grad_norm is None else jnp.minimum(grad_norm, max_grad_norm)
        metrics.update(
            {
                "loss/total": loss,
                "grad/norm": grad_norm,
                "grad/norm_clipped": clipped,
                # LR paper Fig. 3: clip at 1, normalise by response length, smooth on the host.
                "grad/norm_clipped_per_token": clipped / mean_len,
                "grad/update_norm": jnp.where(finite, optax.global_norm(updates), 0.0),
                "grad/param_norm": optax.global_norm(params),
                "grad/finite": finite.astype(jnp.float32),
                "loss_scale/scale": new_state.loss_scale.scale.astype(jnp.float32),
                "loss_scale/skipped_steps": new_state.loss_scale.skipped_steps.astype(jnp.float32),
            }
        )
        return new_state, metrics

    return update


def batch_shardings(batch: Batch, mesh: Mesh) -> dict[str, NamedSharding]:
    """Every batch array is split over ("data", "fsdp") on its leading (batch) dimension."""
    return {k: shd.batch_sharding(mesh, v.ndim) for k, v in batch.items()}


def jit_update(update_fn, state: TrainState, batch_example: Batch, mesh: Mesh):
    """Jit `update_fn` once with explicit in/out NamedShardings and a donated state."""
    state_sh = state_shardings(state, mesh)
    metrics_sh = shd.replicated(mesh)
    return jax.jit(
        update_fn,
        in_shardings=(state_sh, batch_shardings(batch_example, mesh)),
        out_shardings=(state_sh, metrics_sh),
        donate_argnums=(0,),
    )


def make_old_logprobs(graphdef: nnx.GraphDef, mesh: Mesh, *, chunk_size: int = 256, temperature: float = 1.0):
    """Jitted teacher-forced forward giving log π(y_t|θ) (θ_old, or a reference policy's params).

    Returns `fn(params, tokens, attention_mask) -> (logp, entropy)`, each `[B, S-1]` float32 and sharded
    like the batch. Params keep whatever sharding they already have.
    """
    out_sh = shd.batch_sharding(mesh)

    def fn(params, tokens, attention_mask) -> tuple[Float[Array, "b s"], Float[Array, "b s"]]:
        return _forward_logprobs(graphdef, params, tokens, attention_mask, chunk_size, temperature)

    return jax.jit(fn, out_shardings=(out_sh, out_sh))


def place_state(state: TrainState, mesh: Mesh) -> TrainState:
    """Put a host-built state on the mesh with its target shardings."""
    return jax.device_put(state, state_shardings(state, mesh))


def place_batch(batch: Mapping[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """Host batch → global arrays on the batch sharding.

    Every process holds the whole batch (see `train.distributed.lead_computes`) and contributes the
    shards its devices own, so this works unchanged on one host and on a multi-host mesh.
    """
    hosts = {k: np.asarray(v) for k, v in batch.items()}
    shardings = batch_shardings(hosts, mesh)
    return {k: jax.make_array_from_callback(h.shape, shardings[k], lambda idx, h=h: h[idx]) for k, h in hosts.items()}


__all__ = [
    "BATCH_KEYS",
    "Objective",
    "make_update_fn",
    "jit_update",
    "make_old_logprobs",
    "place_state",
    "place_batch",
    "batch_shardings",
]
