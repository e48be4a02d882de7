"""`Learner`: the policy being trained — its train state on the mesh and the jitted functions of a step.

The loop hands it a host `RolloutBatch` and gets host numbers back: `step` = `prepare` (θ_old forward,
diagnostics, step metrics — one jitted call) + `optimize` (PPO epochs × minibatches of the jitted update,
statistics combined over all of them), with the prepared batch on the device throughout (each minibatch is
gathered there, `train/minibatches.py`) and the step's metrics fetched from the device once, at its end;
`set_lr_scale` (the controller's multiplier, no retrace) and `hf_weights` (the weights to push, in HF
naming). It reads only its typed part of the run config (`train/learner_config.py`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_mismatch import precision
from jaxrl_mismatch.metrics import StatsAccumulator
from jaxrl_mismatch.models import load_hf, params_to_hf
from jaxrl_mismatch.models.exact import score_exact
from jaxrl_mismatch.models.scoring import make_scorer
from jaxrl_mismatch.models.sharding import batch_axes, make_mesh
from jaxrl_mismatch.schedules import configured_hyperparams, get_lr, set_hyperparams, set_lr_scale
from jaxrl_mismatch.train import distributed
from jaxrl_mismatch.train.batch import RolloutBatch
from jaxrl_mismatch.train.behaviour import BehaviourScorer
from jaxrl_mismatch.train.exact_forward import ExactForward, check_prompt_lengths
from jaxrl_mismatch.train.learner_config import LearnerConfig
from jaxrl_mismatch.train.minibatches import jit_take_rows, minibatch_order, place_rows
from jaxrl_mismatch.train.packed_scoring import make_packed_scorer
from jaxrl_mismatch.train.packing import pack_batch, packed_layout
from jaxrl_mismatch.train.row_scoring import score_rows, score_rows_routed
from jaxrl_mismatch.train.state import TrainState, abstract_state_of, init_state, split_model
from jaxrl_mismatch.train.step import (
    jit_prepare,
    jit_update,
    make_prepare_fn,
    make_update_fn,
    place_batch,
    place_state,
)


class Learner:
    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        self.mesh = cfg.mesh
        self.policy = policy = precision.policy(cfg.precision, fp32_lm_head=cfg.fp32_lm_head, param_dtype="float32")
        self.model_cfg, model = load_hf(cfg.model_path, policy=policy, mesh=self.mesh,
                                        scan_layers=cfg.scan_layers, attention_impl=cfg.attention_impl)
        # The exact scorer is the engine's computation: no recomputation boundaries, and no mesh (the engine's MoE
        # experts run the plain function, not expert-parallel; on several processes it scores local arrays).
        model.remat, model.mesh = False, None
        self._exact_graphdef = split_model(model)[0]
        model.mesh = self.mesh
        # The exact scorer's rows split over the devices holding the weights it is given: the trainer's mesh on one
        # process; on several, `gather_params` hands it host arrays, scored on this process's own devices.
        self._score_mesh = self.mesh if jax.process_count() == 1 else make_mesh({"data": -1}, jax.local_devices())
        model.remat = cfg.remat_policy
        graphdef, params = split_model(model)
        self._graphdef = graphdef
        self.objective = cfg.objective
        # π is scored at the rollout temperature: the distribution μ actually sampled from.
        kw = dict(chunk_size=cfg.chunk_size, temperature=cfg.temperature)
        # The update's π(θ) by the exact scorer's program (trainer.exact_forward): what the update is compiled with.
        self._exact_forward_spec = (ExactForward(self._exact_graphdef, cfg.max_tokens, cfg.max_prompt_len, self.mesh)
                                    if cfg.exact_forward else None)
        self._update_fn = make_update_fn(graphdef, cfg.optimizer, self.objective, num_microbatches=cfg.microbatches,
                                         max_grad_norm=cfg.max_grad_norm, **kw, mesh=self.mesh,
                                         exact_forward=self._exact_forward_spec)
        self._update = None  # jitted on the first minibatch (needs its pytree structure)
        self._take_rows = jit_take_rows(self.mesh)
        moe_layers = tuple(self.model_cfg.sparse_layers) if self.model_cfg.is_moe else ()
        # A MoE policy's π_behav forward (not exact mode's scorer, never packed: `config_checks`) also returns
        # its routing at the row's version, which splits moe/router_disagree_* (metrics/moe.py).
        self._routed_behaviour = self.model_cfg.is_moe and not cfg.packing and not cfg.scores_exactly
        self._prepare = jit_prepare(make_prepare_fn(graphdef, self.objective, routing_replay=cfg.routing_replay,
                                                    moe_layers=moe_layers, row_blocks=cfg.microbatches,
                                                    mesh=self.mesh, split_routing=self._routed_behaviour
                                                    and cfg.max_staleness > 0, **kw), self.mesh)
        self.state: TrainState = place_state(
            init_state(params, cfg.optimizer, precision.loss_scale_for(policy), seed=cfg.seed), self.mesh)
        self._configured_hparams = configured_hyperparams(self.state.opt_state)  # set again on resume (load_state)
        self.ref_params = jax.tree.map(jnp.copy, self.state.params) if self.objective.kl_coef else None
        self.minibatch_rows = cfg.minibatch_rows
        self._batch_shards = math.prod(self.mesh.shape[a] for a in batch_axes(self.mesh))  # what splits the batch
        # Asynchronous rollouts: π_behav of stale rows, scored like π(θ_old) (train/behaviour.py).
        self._forward = None
        if cfg.max_staleness:  # packed: no forward on padding (a MoE policy is never packed)
            self._forward = (make_packed_scorer(graphdef, self.mesh, **kw) if cfg.packing else
                             make_scorer(graphdef, self.mesh, **kw, routed=self._routed_behaviour))
        self.behaviour = BehaviourScorer(cfg.max_staleness, self._score)

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """(sparse layers, k) of a MoE policy's routing arrays; None for a dense policy."""
        cfg = self.model_cfg
        return (len(cfg.sparse_layers), cfg.num_experts_per_tok) if cfg.is_moe else None

    # -- a step ----------------------------------------------------------------------------------------
    def step(self, batch: RolloutBatch, *, seed: int, minibatch_seed: int) -> dict[str, float]:
        """The learner's side of an RL step: `prepare` (with `seed`), then `optimize` (with `minibatch_seed`)
        on the prepared batch where it lies, on the device; the step's metrics cross to the host once, at the
        end (the minibatches' packing is planned from `batch`'s host tokens meanwhile)."""
        self._check_rows(batch.num_rows)
        prepared, metrics = self._prepare_on_device(batch, seed)
        stats = self._updates(prepared, minibatch_seed, host_batch=batch)
        metrics, stats = jax.device_get((metrics, stats))
        return {**_floats(metrics), **_combine(stats)}

    def prepare(self, batch: RolloutBatch, seed: int) -> tuple[RolloutBatch, dict[str, float]]:
        """`step`'s first half: the prepared batch (on the device) and the step's θ-independent metrics."""
        prepared, metrics = self._prepare_on_device(batch, seed)
        return prepared, _floats(jax.device_get(metrics))

    def optimize(self, batch: RolloutBatch, seed: int, *, host_batch: RolloutBatch | None = None) -> dict[str, float]:
        """`step`'s second half on `prepare`'s batch: `ppo_epochs` passes of `minibatches` optimizer steps,
        statistics over all of them. `host_batch`: the host batch it was prepared from, whose tokens plan the
        packing (default: the tokens are fetched once)."""
        return _combine(jax.device_get(self._updates(batch, seed, host_batch=host_batch)))

    def _prepare_on_device(self, batch: RolloutBatch, seed: int) -> tuple[RolloutBatch, dict[str, jax.Array]]:
        """π(θ_old) (+ π_ref) and the diagnostics' weights filled in; the step's θ-independent metrics, both
        left on the device.

        In exact mode π(θ_old) comes from the batch-invariant scorer the engine sampled with
        (`models.exact.score_exact`), so it equals μ bit for bit when no mismatch is injected.
        A MoE batch's `routing` (the engine's experts) is checked here: the model clips ids into range, so an
        id it cannot have chosen must fail loudly rather than be replayed as another expert."""
        if batch.routing is not None:
            self._check_routing(np.asarray(batch.routing))
        if self._exact_forward_spec is not None:  # the update's exact forward: compiled for prompts up to a bound
            check_prompt_lengths(batch.attention_mask, batch.response_mask, self._exact_forward_spec.max_prompt_len)
        if batch.version_lag is not None and (behav := self.behaviour.behaviour(batch)) is not None:
            batch = batch.replace(behav_logp=behav[0], behav_routing=behav[1])
        if self.objective.cfg.proximal == "bypass":  # μ is π_prox: no θ_old forward (objectives/decoupled.py)
            batch = batch.replace(old_logp=batch.rollout_logp)
        elif self.cfg.scores_exactly:
            batch = batch.replace(old_logp=score_exact(
                self._exact_graphdef, distributed.gather_params(self.state.params), batch.tokens, batch.attention_mask,
                batch.response_mask, max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature,
                kept=batch.kept_count, mesh=self._score_mesh))
        if self.cfg.packing and (batch.old_logp is None or self.ref_params is not None):
            # θ_old / reference forwards on packed rows: one group per batch shard keeps each device's rows local.
            # The update needs other groups (one per microbatch of a reshuffled minibatch): `prepare` drops these.
            batch = pack_batch(batch, num_groups=self._batch_shards, shards=self._batch_shards)
        key = jax.random.key_data(jax.random.key(seed))
        return self._prepare(self.state.params, self.ref_params, place_batch(batch, self.mesh), key)

    def _score(self, params, batch: RolloutBatch, rows: np.ndarray):
        """log π(y_t) of the targets of `rows` ([B] bool) under `params`, masked, on the host (0 in other rows):
        the exact scorer in exact mode, else the teacher-forced forward (what `prepare` computes for π(θ_old)),
        over the engine's top-k/top-p support when it truncated; only those rows are computed. A MoE policy's
        teacher-forced forward also gives its routers' top-k: then (log-probs, routing `[B, S-1, L, k]`)."""
        kept = None if batch.kept_count is None else np.asarray(batch.kept_count)
        response = np.asarray(batch.response_mask)
        if self.cfg.scores_exactly:  # batch-invariant: a subset's rows are bit for bit the whole batch's
            idx, out = np.flatnonzero(rows), np.zeros(response.shape, np.float32)
            tokens, mask = np.asarray(batch.tokens)[idx], np.asarray(batch.attention_mask)[idx]
            out[idx] = score_exact(self._exact_graphdef, distributed.gather_params(params), tokens, mask, response[idx],
                                   max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature,
                                   kept=None if kept is None else kept[idx], mesh=self._score_mesh)
            return out
        tokens, mask = np.asarray(batch.tokens), np.asarray(batch.attention_mask)
        if self._routed_behaviour:
            logp, routing = score_rows_routed(self._forward, params, tokens, mask, rows, kept=kept,
                                              multiple=self._batch_shards)
            return logp * response, routing
        return score_rows(self._forward, params, tokens, mask, rows, kept=kept, packed=self.cfg.packing,
                          multiple=self._batch_shards) * response

    def _check_routing(self, routing: np.ndarray) -> None:
        shape, experts = self.routing_shape, self.model_cfg.num_experts
        if shape is None or routing.shape[2:] != shape:
            raise ValueError(f"routing: the engine's routing has shape {routing.shape}, the policy needs "
                             f"[B, S, {shape[0] if shape else 0}, {shape[1] if shape else 0}] (sparse layers, top-k)")
        if routing.size and (routing.min() < 0 or routing.max() >= experts):
            raise ValueError(f"routing: expert ids in [{routing.min()}, {routing.max()}] outside [0, {experts}) "
                             "of the policy (does the server run another model?)")

    def _updates(self, batch: RolloutBatch, seed: int, *,
                 host_batch: RolloutBatch | None) -> list[dict[str, jax.Array]]:
        """Dispatch the step's updates on the device batch `batch`; their statistics, still on the device.

        Each minibatch is gathered from `batch` on the device; only its row indices and (packing) its packed
        layout go up. With `host_batch` (or without packing) nothing here waits for the device."""
        cfg, n, out = self.cfg, batch.num_rows, []
        self._check_rows(n)
        if cfg.packing:  # the layout needs the rows' tokens: the host has them (the rollout's), or fetch once
            src = host_batch if host_batch is not None else batch
            tokens, mask = (distributed.to_host(x) if isinstance(x, jax.Array) else np.asarray(x)
                            for x in (src.tokens, src.attention_mask))
        for epoch in range(cfg.ppo_epochs):
            order = minibatch_order(seed, epoch, n, cfg.minibatches)
            for m in range(cfg.minibatches):
                rows = order[m * self.minibatch_rows:(m + 1) * self.minibatch_rows]
                whole = len(rows) == n and cfg.minibatches == 1
                mb = batch if whole else self._take_rows(batch, place_rows(rows, self.mesh))
                if cfg.packing:  # one group per microbatch; the packed rows split evenly over the batch shards
                    mb = mb.replace(packed=place_batch(packed_layout(
                        tokens[rows], mask[rows], num_groups=cfg.microbatches, shards=self._batch_shards,
                        microbatches=True), self.mesh))
                if self._update is None:
                    self._update = jit_update(self._update_fn, self.state, mb, self.mesh)
                self.state, stats = self._update(self.state, mb)
                out.append(stats)
        return out

    def _check_rows(self, n: int) -> None:
        """The step's minibatches are `minibatch_rows` each: a batch of another size would train a prefix of
        itself (more rows) or a short last minibatch (fewer), silently; refused before any work instead."""
        want = self.minibatch_rows * self.cfg.minibatches
        if n != want:
            raise ValueError(f"Learner: the batch has {n} rows, but a step takes {want} "
                             f"({self.cfg.minibatches} minibatches of {self.minibatch_rows} rows: "
                             "batch.prompts_per_step × rollout.group_size)")

    # -- host controls -----------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The LR of the most recent update (schedule × lr_scale); before any update, of the first."""
        return float(get_lr(self.state.opt_state))

    def set_lr_scale(self, scale: float) -> None:
        self.state = self.state.replace(opt_state=set_lr_scale(self.state.opt_state, scale, self.mesh))

    def reset_loss_scale(self) -> None:
        """This precision's initial loss scale (S = 2^15 for fp16, the no-op S = 1 otherwise), in place of the
        restored one: a checkpoint of another precision carries its S, which is not this run's (fp32's S = 1 would
        leave fp16 gradients unscaled until S had doubled 15 times, 200 steps apart)."""
        fresh = precision.loss_scale_for(self.policy)
        self.state = self.state.replace(loss_scale=jax.tree.map(lambda new, old: jax.device_put(new, old.sharding),
                                                                fresh, self.state.loss_scale))

    def hf_weights(self) -> dict[str, np.ndarray]:
        """HF-named host tensors of the current policy (every process joins the gather on multi-host)."""
        return params_to_hf(distributed.gather_params(self.state.params), self.model_cfg)

    def abstract_state(self):
        return abstract_state_of(self.state)

    def load_state(self, state: TrainState) -> None:
        """Adopt a restored state. The optimizer's host-settable hyperparameters (a constant LR, b1, b2, eps,
        weight_decay) live in the Optax state, so the configured values are set again: a resume that accepted a
        changed `optim.lr` or `optim.weight_decay` trains with the new value (the controller's `lr_scale` and a
        scheduled LR come from the checkpoint)."""
        self.state = state.replace(opt_state=set_hyperparams(state.opt_state, self.mesh, **self._configured_hparams))


def _floats(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def _combine(stats: list[dict]) -> dict[str, float]:
    """The step's update metrics from each update's fetched statistics (`metrics.StatsAccumulator`)."""
    acc = StatsAccumulator()
    for s in stats:
        acc.add(s)
    return acc.result()
