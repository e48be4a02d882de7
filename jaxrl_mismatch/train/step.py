"""The jitted, sharded pure functions of one RL step: `prepare` (θ_old forward + diagnostics + step
metrics) and `update` (one optimizer step on a minibatch).

`prepare(params, ref_params, batch, seed) -> (batch, step_metrics)` runs once per step on the whole
rollout batch: it fills `old_logp` (and `ref_logp`), applies the objective-hacking diagnostics (φ, ξ) as
`token_weight`, and computes every θ-independent metric (mismatch, corrections, lengths, surrogate J)
over all of the step's tokens — statistics of the step, not means of per-minibatch statistics.
The scoring itself — log π, entropy and the MoE routers' outputs — is `models.scoring`, the one scorer that
exact mode and `jaxrl-mismatch analyze` use too.

Mixture-of-experts policies (`models/moe.py`): the θ_old forward also returns what the routers did, which
gives the `moe/*` step metrics (`metrics/moe.py`: agreement with the engine's routing, entropy, load, ρ std
split by agreement). Routing replay (`routing_replay`): with "R3" the θ_old forward replays the engine's
routing (`batch.routing`; Ma et al. 2025 rollout routing replay), so in fp32 π(θ_old) = μ; with "R2" it routes
freely and records its own choice. Either way the experts it used go into `batch.replay_routing`, which the
θ forwards of the update replay; without replay they route freely.

`update(state, batch) -> (state, stats)` is jitted once with explicit NamedShardings and a donated state.
Inside it: gradient accumulation over microbatches with `lax.scan` (the objective divides by normalisers
computed once over the whole minibatch, so the accumulated gradient equals the whole-minibatch gradient),
FP16 dynamic loss scaling (a non-finite step is skipped and counted — for every precision, so a NaN never
reaches the params), global-norm clipping inside the Optax chain, and the step's measurements (big_vision
style): grad norm raw / after clipping / per response token (LR paper Fig. 3), update and param norms,
loss scale, and the θ-dependent statistics (PPO ratios, entropy) as sums that combine exactly over
minibatches (`metrics.StatsAccumulator`).

The learning rate is not an argument: it lives in the Optax state as an `inject_hyperparams` float32 set
by the host between steps (`schedules.set_lr_scale`), so a new value never retraces.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxrl_mismatch import precision
from jaxrl_mismatch.metrics.moe import moe_step_metrics
from jaxrl_mismatch.metrics.staleness import staleness_metrics
from jaxrl_mismatch.models import sharding as shd
from jaxrl_mismatch.models.moe import REPLAY_MODES, RouterOutput, routing_dtype
from jaxrl_mismatch.models.scoring import score_tokens, token_logprobs
from jaxrl_mismatch.train.batch import PackedRows, RolloutBatch
from jaxrl_mismatch.train.exact_forward import ExactForward, exact_forward_logprobs, exact_valued
from jaxrl_mismatch.train.packing import unpack_targets
from jaxrl_mismatch.train.state import TrainState, state_shardings


class StepLoss(Protocol):
    """What the step needs from a loss: its whole-batch constants (normalisers, weight mean, M2PO cut), the
    microbatch loss, and its statistics."""

    def batch_constants(self, batch: RolloutBatch) -> Any: ...

    def loss(self, logp: jax.Array, entropy: jax.Array, mb: RolloutBatch, consts: Any) -> tuple[jax.Array, dict]: ...

    def router_loss(self, router: RouterOutput, input_tokens: jax.Array) -> tuple[jax.Array, dict]: ...

    def update_stats(self, logp: jax.Array, entropy: jax.Array, batch: RolloutBatch) -> dict[str, jax.Array]: ...

    def step_metrics(self, batch: RolloutBatch) -> dict[str, jax.Array]: ...

    def token_weight(self, batch: RolloutBatch, seed: jax.Array) -> jax.Array | None: ...




def forward_packed_logprobs(graphdef: nnx.GraphDef, params: Any, packed: PackedRows, chunk_size: int,
                            temperature: float = 1.0) -> tuple[Float[Array, "b t"], Float[Array, "b t"]]:
    """`models.scoring.score_tokens`' (log π, entropy) computed on the packed rows (segment-aware attention,
    per-sequence positions) and unpacked to the batch's `[B, S-1]` layout: the same values, on fewer token slots
    (`train/packing.py`)."""
    model = nnx.merge(graphdef, params)
    t, seg = packed.tokens, packed.segment_ids
    logp, entropy = token_logprobs(model, t[:, :-1], t[:, 1:], None, chunk_size=chunk_size, temperature=temperature,
                                   segment_ids=seg[:, :-1], positions=packed.positions[:, :-1])
    g = packed.num_groups
    return (unpack_targets(logp, packed.unpack_index, packed.unpack_valid, num_groups=g),
            unpack_targets(entropy, packed.unpack_index, packed.unpack_valid, num_groups=g))


def _align_with_tokens(ids: Int[Array, "b t layers k"], dtype) -> Int[Array, "b s layers k"]:
    """Expert ids of the inputs `tokens[:, :-1]` → aligned with `tokens` (the last position, never an input, 0),
    as `dtype` (`models.moe.routing_dtype`: the engine's narrow ids, not int32)."""
    return jnp.pad(ids.astype(dtype), ((0, 0), (0, 1), (0, 0), (0, 0)))


def _split_microbatches(batch: RolloutBatch, n: int, mesh: Mesh | None = None) -> RolloutBatch:
    """`[n, rows / n, ...]` leaves; a packing's G groups become G / n groups per microbatch.

    With a `mesh`, each microbatch is laid out over all the batch shards (`P(None, batch axes)`). The reshape
    alone keeps the batch's contiguous row blocks where they were, so a microbatch sat on rows/n / (rows/shards)
    devices and XLA gathered it inside the scan: every device computed every microbatch in full (measured: 8
    fake devices, 8 microbatches, 7× the time of one microbatch) and no memory was saved."""
    if batch.packed is not None:
        g = batch.packed.num_groups
        if g % n:
            raise ValueError(f"a batch packed in {g} groups does not split into num_microbatches={n} "
                             "(pack one group per microbatch: train.packing.pack_batch)")
        batch = batch.replace(packed=batch.packed.replace(num_groups=g // n))
    return jax.tree.map(lambda x: _split_rows(x, n, mesh), batch)


def _split_rows(x: jax.Array, n: int, mesh: Mesh | None) -> jax.Array:
    """`[rows, ...]` → `[n, rows / n, ...]`, each block spread over the mesh's batch shards when it divides."""
    if x.shape[0] % n:
        raise ValueError(f"batch size {x.shape[0]} is not divisible by num_microbatches={n}")
    y = x.reshape((n, x.shape[0] // n) + x.shape[1:])
    shards = int(np.prod([mesh.shape[a] for a in shd.batch_axes(mesh)])) if mesh is not None else 1
    if mesh is None or n == 1 or y.shape[1] % shards:  # (a block smaller than the shards: left as it is)
        return y
    return jax.lax.with_sharding_constraint(
        y, NamedSharding(mesh, P(None, shd.batch_axes(mesh), *([None] * (y.ndim - 2)))))


def _merge_microbatches(x: jax.Array) -> jax.Array:
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _merge_router_blocks(r: RouterOutput) -> RouterOutput:
    """Row blocks' router outputs (a leading block axis) → the whole batch's: per-token arrays joined by rows, the
    sums over tokens (load, prob_sum, num_tokens) added. Routing is dropless (`models/moe.py`): each token's experts
    do not depend on the other rows, so the blocks route as the whole batch would."""
    return RouterOutput(expert_ids=_merge_microbatches(r.expert_ids), router_ids=_merge_microbatches(r.router_ids),
                        entropy=_merge_microbatches(r.entropy), load=jnp.sum(r.load, axis=0),
                        prob_sum=jnp.sum(r.prob_sum, axis=0), num_tokens=jnp.sum(r.num_tokens, axis=0))


def gradient_noise(sum_sq_micro: jax.Array, norm_big: jax.Array, num_micro: int, rows: int) -> dict[str, jax.Array]:
    """Gradient noise from the microbatch gradients the step computes anyway (LR-schedule paper §3).

    With M microbatches of b = rows/M rows, g_m sums to the minibatch gradient G_B, and M·g_m estimates it
    from b rows. McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", App. A.1, eqs. A.2–A.3)
    give unbiased estimates from two batch sizes b < B:
        |G|²  ≈ (B·|G_B|² − b·|G_b|²) / (B − b),    tr Σ ≈ (|G_b|² − |G_B|²) / (1/b − 1/B),
    with |G_b|² the mean over microbatches of ‖M·g_m‖². B_simple = tr Σ / |G|² is the noise scale in rows
    (sequences): the batch size at which gradient noise and signal are comparable. Per-step values are
    noisy (either estimate can come out negative); smooth numerator and denominator separately.
    """
    b, big = rows // num_micro, rows
    small_sq = jnp.square(num_micro) * sum_sq_micro / num_micro
    big_sq = jnp.square(norm_big)
    signal = (big * big_sq - b * small_sq) / (big - b)
    trace = (small_sq - big_sq) / (1.0 / b - 1.0 / big)
    return {"grad/noise_trace": trace, "grad/signal_sq": signal,
            "grad/noise_scale": trace / jnp.maximum(jnp.abs(signal), 1e-30) * jnp.sign(signal)}


def make_update_fn(
    graphdef: nnx.GraphDef,
    opt: optax.GradientTransformation,
    objective: StepLoss,
    *,
    num_microbatches: int = 1,
    max_grad_norm: float | None = 1.0,
    chunk_size: int = 256,
    temperature: float = 1.0,
    exact_forward: ExactForward | None = None,
    mesh: Mesh | None = None,
) -> Callable[[TrainState, RolloutBatch], tuple[TrainState, dict[str, jax.Array]]]:
    """The pure update function (not yet jitted; see `jit_update`).

    `mesh` (the one the update runs on): microbatches are spread over all its batch shards
    (`_split_microbatches`); without it a sharded batch's microbatches each run on a few devices only.

    `temperature` is the rollout sampling temperature: π is scored as softmax(logits / T), the
    distribution μ sampled from, so ρ = π/μ compares like with like.

    MoE policies: a batch with `replay_routing` (routing replay R2/R3, filled by `prepare`) has the θ forward
    use those experts; the router's load-balancing term (`objective.router_loss`) joins the loss.

    A batch with `packed` (`trainer.packing`, `train.packing.pack_batch` with one group per microbatch) runs
    the θ forward on the packed rows and unpacks log π and entropy; the objective sees the same `[B, S-1]`
    values, so the update equals the unpacked one (`tests/train/test_packed_update.py`).

    `exact_forward` (`trainer.exact_forward`; graphdef without remat, rollout max_tokens, longest prompt): log π(θ)
    is valued by the exact scorer's per-row program (`train/exact_forward.py`; the gradient is the batched
    forward's), so at θ = θ_old the ratio is exactly 1.
    """

    def microbatch_loss(params, mb, consts, input_tokens, scale_state):
        if exact_forward is not None:  # value: the exact scorer's program; gradient: the batched forward's
            if mb.packed is not None or mb.replay_routing is not None:
                raise ValueError("the exact forward scores unpacked dense rows; packing and routing replay are off")
            logp, entropy, router = score_tokens(graphdef, params, mb.tokens, mb.attention_mask, chunk_size=chunk_size,
                                                 temperature=temperature, kept=mb.kept_count)
            exact_logp, exact_entropy = exact_forward_logprobs(
                exact_forward.graphdef, jax.lax.stop_gradient(params), mb.tokens, mb.attention_mask, mb.response_mask,
                max_tokens=exact_forward.max_tokens, temperature=temperature, kept=mb.kept_count,
                max_prompt_len=exact_forward.max_prompt_len, mesh=exact_forward.mesh)
            logp, entropy = exact_valued(exact_logp, logp), exact_valued(exact_entropy, entropy)
        elif mb.packed is not None:  # sequence packing: only the transformer runs packed
            if mb.replay_routing is not None:
                raise ValueError("sequence packing does not carry MoE routing replay; use one or the other")
            (logp, entropy), router = forward_packed_logprobs(graphdef, params, mb.packed, chunk_size, temperature), None
        else:
            logp, entropy, router = score_tokens(graphdef, params, mb.tokens, mb.attention_mask, chunk_size=chunk_size,
                                                 temperature=temperature, routing=mb.replay_routing, kept=mb.kept_count)
        loss, aux = objective.loss(logp, entropy, mb, consts)
        if router is not None:
            extra, router_aux = objective.router_loss(router, input_tokens)
            loss, aux = loss + extra, {**aux, **router_aux}
        return precision.scale_loss(scale_state, loss), (loss, aux, logp, entropy)

    grad_fn = jax.grad(microbatch_loss, has_aux=True)

    def update(state: TrainState, batch: RolloutBatch) -> tuple[TrainState, dict[str, jax.Array]]:
        consts = objective.batch_constants(batch)
        input_tokens = jnp.sum(batch.attention_mask[:, :-1]).astype(jnp.float32)  # the routers' valid tokens
        mbs = _split_microbatches(batch, num_microbatches, mesh)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)

        # Each microbatch's loss and aux values are its additive share of the whole-minibatch value (the
        # objective divides by whole-minibatch normalisers), so sums over the scan are the minibatch values.
        aux_zeros = jax.tree_util.tree_map(
            lambda x: jnp.zeros(x.shape, jnp.float32),
            jax.eval_shape(lambda: grad_fn(state.params, jax.tree.map(lambda x: x[0], mbs),
                                           consts, input_tokens, state.loss_scale)[1][1]),
        )

        def body(acc, mb):
            grads, (loss, aux, logp, entropy) = grad_fn(state.params, mb, consts, input_tokens, state.loss_scale)
            acc_grads, acc_loss, acc_aux, acc_sq = acc
            acc_grads = jax.tree_util.tree_map(jnp.add, acc_grads, grads)
            acc_aux = jax.tree_util.tree_map(jnp.add, acc_aux, aux)
            # Σ_m ‖g_m‖² for the gradient-noise estimate (still loss-scaled; unscaled below).
            acc_sq = acc_sq + jnp.square(optax.tree.norm(grads))
            return (acc_grads, acc_loss + loss, acc_aux, acc_sq), (logp, entropy)

        init = (zeros, jnp.zeros((), jnp.float32), aux_zeros, jnp.zeros((), jnp.float32))
        (grads, loss, aux, sum_sq), (logp, entropy) = jax.lax.scan(body, init, mbs)
        logp, entropy = _merge_microbatches(logp), _merge_microbatches(entropy)

        scale = state.loss_scale.scale.astype(jnp.float32)
        noise = (gradient_noise(sum_sq / jnp.square(scale), optax.tree.norm(grads) / scale, num_microbatches,
                                batch.num_rows) if num_microbatches > 1 else {})
        grads, finite = precision.unscale_and_check(state.loss_scale, grads)
        grad_norm = optax.tree.norm(grads)
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

        mask = batch.response_mask
        mean_len = jnp.maximum(jnp.sum(mask) / mask.shape[0], 1.0)
        clipped = grad_norm if max_grad_norm is None else jnp.minimum(grad_norm, max_grad_norm)
        per_update = {
            "loss/total": loss,
            **aux,
            "grad/norm": grad_norm,
            "grad/norm_clipped": clipped,
            # LR paper Fig. 3: clip at 1, normalise by response length, smooth on the host.
            "grad/norm_clipped_per_token": clipped / mean_len,
            "grad/update_norm": jnp.where(finite, optax.tree.norm(updates), 0.0),
            "grad/param_norm": optax.tree.norm(params),
            "grad/finite": finite.astype(jnp.float32),
            **noise,
        }
        running = {
            "loss_scale/scale": new_state.loss_scale.scale.astype(jnp.float32),
            "loss_scale/skipped_steps": new_state.loss_scale.skipped_steps.astype(jnp.float32),
        }
        stats = dict(objective.update_stats(logp, entropy, batch))
        stats.update({f"mean:{k}": v for k, v in per_update.items()})
        stats.update({f"last:{k}": v for k, v in running.items()})
        return new_state, stats

    return update


def make_prepare_fn(graphdef: nnx.GraphDef, objective: StepLoss, *, chunk_size: int = 256,
                    temperature: float = 1.0, routing_replay: str = "off",
                    moe_layers: tuple[int, ...] = (), row_blocks: int = 1, mesh: Mesh | None = None,
                    split_routing: bool = False) -> Callable:
    """`prepare(params, ref_params, batch, seed) -> (batch, step_metrics)`; see the module docstring.

    `ref_params` None means no reference policy (no KL term). `seed` (uint32 key data) drives the
    diagnostics' random weights ξ, drawn once for the whole batch. A batch that already carries
    `old_logp` (exact mode scores it row by row on the host side) is not scored again (a MoE policy still
    runs the routed forward, for its metrics and R2). `moe_layers`: the model's sparse layer indices
    (`ModelConfig.sparse_layers`; empty for a dense model). `routing_replay`: "off" | "R2" | "R3".
    The returned batch has no `routing` (the update never reads it; R3 carries it on as `replay_routing`).
    `row_blocks` (the update's microbatch count): the unpacked θ_old and reference forwards (dense or MoE) run in
    that many blocks of rows, one after another (`lax.map`, each spread over `mesh`'s batch shards), so their
    peak is one block's `[rows / row_blocks, chunk, V]` logits, as the update's, not the whole step batch's (a
    config's 1,024-row step at Qwen3's vocabulary needed 74 GiB per device in one forward).
    A batch with `packed` (`trainer.packing`: `train.packing.pack_batch`, one group per batch shard) has its
    θ_old and reference forwards run on the packed rows (dense policies); the returned batch drops the
    packing (the update packs each minibatch anew).
    `split_routing` (a MoE policy with asynchronous rollouts whose π_behav forward returns routing): a batch with
    `version_lag` splits `moe/router_disagree_*` into staleness and precision (`metrics/moe.py`) with
    `behav_routing`, absent when no row is lagged.
    """
    if routing_replay not in REPLAY_MODES:
        raise ValueError(f"routing_replay must be one of {REPLAY_MODES}, got {routing_replay!r}")
    if routing_replay != "off" and not moe_layers:
        raise ValueError(f"routing_replay={routing_replay!r} needs a mixture-of-experts model")

    def score(p, batch: RolloutBatch, routing=None) -> tuple[Float[Array, "b t"], RouterOutput | None]:
        """log π of the batch's targets under `p` (on the packed rows when the batch carries a packing), and what
        a MoE policy's routers did (None for a dense one); `routing` is replayed (R3)."""
        if batch.packed is not None:
            return forward_packed_logprobs(graphdef, p, batch.packed, chunk_size, temperature)[0], None

        def one(tokens, mask, kept, forced):
            s = score_tokens(graphdef, p, tokens, mask, chunk_size=chunk_size, temperature=temperature,
                             routing=forced, kept=kept)
            return s.logp, s.router

        rows = (batch.tokens, batch.attention_mask, batch.kept_count, routing)
        if row_blocks == 1 or batch.tokens.shape[0] % row_blocks:
            return one(*rows)
        logp, router = jax.lax.map(lambda b: one(*b), jax.tree.map(lambda x: _split_rows(x, row_blocks, mesh), rows))
        return _merge_microbatches(logp), None if router is None else _merge_router_blocks(router)

    def prepare(params, ref_params, batch: RolloutBatch, seed: jax.Array):
        mask = batch.response_mask
        router = None
        if moe_layers:
            if batch.packed is not None:
                raise ValueError("sequence packing does not carry MoE routing; MoE policies run unpacked")
            if routing_replay == "R3" and batch.routing is None:
                raise ValueError("routing_replay='R3' needs the engine's routing in the batch (batch.routing)")
            old_logp, router = score(params, batch, batch.routing if routing_replay == "R3" else None)
            if batch.old_logp is None:  # else scored already (exact mode: `models.exact.score_exact`)
                batch = batch.replace(old_logp=old_logp * mask)
            if routing_replay != "off":  # R3: the engine's ids (as forced); R2: θ_old's own choice
                batch = batch.replace(replay_routing=_align_with_tokens(router.expert_ids,
                                                                        routing_dtype(router.load.shape[-1])))
        elif batch.old_logp is None:
            batch = batch.replace(old_logp=score(params, batch)[0] * mask)
        if ref_params is not None:
            # The reference forward routes as the update's forwards do (R2/R3: the replayed experts), so the KL
            # penalty compares parameters, not routings: at θ = θ_ref it is 0 (with free routing under R3 it was
            # not, and pulled the tokens whose routing the engine flipped towards the trainer's own).
            batch = batch.replace(ref_logp=score(ref_params, batch, batch.replay_routing)[0] * mask)
        batch = batch.replace(token_weight=objective.token_weight(batch, seed))
        metrics = objective.step_metrics(batch)
        if batch.version_lag is not None:  # staleness/* next to mismatch/* (metrics/staleness.py)
            bypass = objective.cfg.proximal == "bypass"  # old_logp is μ itself: no π_prox to split against
            metrics.update(staleness_metrics(None if bypass else batch.old_logp, batch.behav_logp,
                                             batch.rollout_logp, mask, batch.version_lag))
        if router is not None:
            # bypass: batch.old_logp is μ itself (ρ = 1 everywhere, both routing halves of ρ's spread 0); the split
            # reads the θ_old forward that just ran
            pi_old = old_logp * mask if objective.cfg.proximal == "bypass" else batch.old_logp
            metrics.update(moe_step_metrics(
                router.router_ids, router.entropy, router.load, pi_old, batch.rollout_logp, mask,
                layer_ids=moe_layers, rollout_ids=None if batch.routing is None else batch.routing[:, :-1],
                behav_ids=batch.behav_routing, version_lag=batch.version_lag if split_routing else None))
        return batch.replace(routing=None, packed=None, version_lag=None, behav_logp=None, behav_routing=None), metrics

    return prepare


def batch_shardings(batch: RolloutBatch, mesh: Mesh) -> RolloutBatch:
    """Every batch array is split over ("data", "fsdp") on its leading (batch) dimension."""
    return jax.tree.map(lambda x: shd.batch_sharding(mesh, x.ndim), batch)


def jit_update(update_fn, state: TrainState, batch_example: RolloutBatch, mesh: Mesh):
    """Jit `update_fn` once with explicit in/out NamedShardings and a donated state."""
    state_sh = state_shardings(state, mesh)
    return jax.jit(
        update_fn,
        in_shardings=(state_sh, batch_shardings(batch_example, mesh)),
        out_shardings=(state_sh, shd.replicated(mesh)),
        donate_argnums=(0,),
    )


def jit_prepare(prepare_fn, mesh: Mesh):
    """Jit `prepare_fn`: outputs sharded like the batch (arrays) and replicated (metrics); params keep theirs."""
    return jax.jit(prepare_fn, out_shardings=(shd.batch_sharding(mesh), shd.replicated(mesh)))


def place_state(state: TrainState, mesh: Mesh) -> TrainState:
    """Put a host-built state on the mesh with its target shardings."""
    return jax.device_put(state, state_shardings(state, mesh))


def place_batch(batch: RolloutBatch, mesh: Mesh) -> RolloutBatch:
    """Host batch → global arrays on the batch sharding.

    Every process holds the whole batch (see `train.distributed.lead_computes`) and contributes the
    shards its devices own, so this works unchanged on one host and on a multi-host mesh.
    """

    def place(x):
        h = np.asarray(x)
        return jax.make_array_from_callback(h.shape, shd.batch_sharding(mesh, h.ndim), lambda idx: h[idx])

    return jax.tree.map(place, batch)
