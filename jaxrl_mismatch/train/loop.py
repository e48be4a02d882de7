"""The RL loop: prompts → rollouts (gRPC) → rewards → advantages → filters → π(θ_old) → PPO epochs →
metrics → controllers set the next LR → versioned weight push → validation → checkpoints.

Data flows one way; every stateful host object (prompt iterator, controller, weight version) has a
plain serialisable state that goes into the checkpoint, so a stopped run resumes where it was.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrl_mismatch import precision
from jaxrl_mismatch.data import get_task
from jaxrl_mismatch.data.batching import PromptIterator, tokenize_prompts
from jaxrl_mismatch.data.tokenizer import load_tokenizer
from jaxrl_mismatch.metrics import MetricsConfig
from jaxrl_mismatch.models import load_hf, params_to_hf
from jaxrl_mismatch.models.sharding import make_mesh
from jaxrl_mismatch.objectives import (
    compute_advantages,
    inject_mismatch,
    objective_config,
    variance_weights,
    weight_distortion,
)
from jaxrl_mismatch.rollout import NonFiniteLogprobsError, RolloutClient, RolloutError, SamplingSpec
from jaxrl_mismatch.schedules import get_lr, make_controller, set_lr_scale
from jaxrl_mismatch.train import distributed
from jaxrl_mismatch.train.checkpoint import Checkpointer, abstract_state_of
from jaxrl_mismatch.train.config import build_optimizer, validate
from jaxrl_mismatch.train.objective import PolicyObjective
from jaxrl_mismatch.train.observe import RunWriter, StepAccumulator
from jaxrl_mismatch.train.rollouts import BATCH_KEYS, STAT_KEYS, collect, evaluate, to_train_batch
from jaxrl_mismatch.train.server_proc import ManagedServer, ServerStartError
from jaxrl_mismatch.train.state import init_state, split_model
from jaxrl_mismatch.train.step import jit_update, make_old_logprobs, make_update_fn, place_batch, place_state

log = logging.getLogger(__name__)


class RolloutFailure(RuntimeError):
    """The rollout server failed for good; a resumable checkpoint was written (see the message)."""


def _task_options(c: ml_collections.ConfigDict, model_dir: str, split: str, n: int) -> dict[str, Any]:
    """Loader options of the configured task; the synthetic task reuses the warm start's spec (task.json)."""
    if c.task.name == "arithmetic":
        import json

        spec: dict[str, Any] = {}
        path = os.path.join(model_dir, "task.json")
        if os.path.exists(path):
            with open(path) as f:
                spec = json.load(f).get("spec", {})
        return {"n": n, "seed": c.seed, **spec}
    return {"files": c.task.files.to_dict(), "data_dir": c.task.data_dir or os.path.join(c.run_dir, "tfds")}


class Trainer:
    """Owns one run: model, train state, rollout client (and managed server), writers, checkpoints."""

    def __init__(self, c: ml_collections.ConfigDict) -> None:
        validate(c)
        self.c = c
        self.is_lead = jax.process_index() == 0
        os.makedirs(c.run_dir, exist_ok=True)
        # -- model and tokenizer -------------------------------------------------------------------
        self.mesh = make_mesh(c.trainer.mesh.to_dict())
        self.policy = precision.policy(c.trainer.precision, fp32_lm_head=c.trainer.fp32_lm_head, param_dtype="float32")
        self.model_cfg, model = load_hf(c.model.path, policy=self.policy, mesh=self.mesh)
        self.tok = load_tokenizer(c.model.path)
        self.tok.check_model_vocab(self.model_cfg.vocab_size)
        model.remat = bool(c.trainer.remat)
        graphdef, params = split_model(model)
        # -- optimizer, objective, step --------------------------------------------------------------
        opt = build_optimizer(c.optim)
        overrides = c.objective.overrides.to_dict()
        self.obj_cfg = objective_config(c.objective.preset, **overrides)
        objective = PolicyObjective(
            cfg=self.obj_cfg,
            # The correction/* fractions are measured against the bounds the objective really uses.
            metrics_cfg=MetricsConfig(
                eps_low=self.obj_cfg.eps_low, eps_high=self.obj_cfg.eps_high, tis_cap=self.obj_cfg.correction_cap,
                mask_low=self.obj_cfg.correction_low, mask_high=self.obj_cfg.correction_cap,
                **({"phi_delta": c.diagnostics.weight_distortion_delta,
                    "phi_pi_low": c.diagnostics.weight_distortion_pi_low}
                   if c.diagnostics.weight_distortion_delta >= 0 else {})),
            kl_coef=c.objective.kl_coef, entropy_coef=c.objective.entropy_coef,
        )
        rows = c.batch.prompts_per_step * c.rollout.group_size
        self.mb_rows = rows // c.batch.minibatches
        # π is scored at the rollout temperature: the distribution μ actually sampled from.
        self.update_fn = make_update_fn(graphdef, opt, objective, num_microbatches=c.batch.microbatches,
                                        max_grad_norm=c.optim.max_grad_norm, chunk_size=c.trainer.chunk_size,
                                        temperature=c.rollout.temperature)
        self.old_logprobs = make_old_logprobs(graphdef, self.mesh, chunk_size=c.trainer.chunk_size,
                                              temperature=c.rollout.temperature)
        self.state = place_state(init_state(params, opt, precision.loss_scale_for(self.policy), seed=c.seed), self.mesh)
        self.ref_params = jax.tree_util.tree_map(jnp.copy, self.state.params) if c.objective.kl_coef else None
        self.update = None  # jitted on the first batch (needs its layout)
        self.controller = (make_controller(c.controller.name, **c.controller.kwargs.to_dict())
                           if c.controller.name != "none" else None)
        # -- data ----------------------------------------------------------------------------------
        self.task = get_task(c.task.name)
        self.template = c.task.template or self.task.template
        train = self.task.load(c.task.train_split, **_task_options(c, c.model.path, c.task.train_split, c.task.num_train))
        val = self.task.load(c.task.val_split, **_task_options(c, c.model.path, c.task.val_split, c.task.num_val))
        if not train or not val:
            raise ValueError(f"task {c.task.name!r}: empty split (train {len(train)}, validation {len(val)})")
        # Tokenise every training prompt now: a prompt over max_prompt_len fails at start-up, not at step 900.
        ids = self._tokenize([r["prompt_text"] for r in train])
        train = [{"prompt_ids": p, "answer": r["answer"]} for p, r in zip(ids, train)]
        self.prompts = PromptIterator(train, c.batch.prompts_per_step, seed=c.seed)
        self.val_records = val[: c.task.num_val]
        self.val_ids = self._tokenize([r["prompt_text"] for r in self.val_records])
        # -- bookkeeping ---------------------------------------------------------------------------
        self.step = 0
        self.weight_version = 0
        self.ckpt = Checkpointer(os.path.join(c.run_dir, "checkpoints"), max_to_keep=c.checkpoint.keep)
        self.server: ManagedServer | None = None
        self.client: RolloutClient | None = None
        self.writer: RunWriter | None = None
        self.stop_requested = False  # set by a signal handler; honoured between steps
        self._unwritten: tuple[int, dict] | None = None  # a finished step's record not yet written

    # -- helpers -------------------------------------------------------------------------------------
    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        return tokenize_prompts(self.tok, texts, template=self.template, max_prompt_len=self.c.task.max_prompt_len)

    def _reward(self, token_ids: list[int], answer: str) -> float:
        return float(self.task.reward(self.tok.decode(token_ids), answer))

    def _next_prompts(self) -> tuple[list[list[int]], list[str]]:
        recs = self.prompts.next_batch()
        return [r["prompt_ids"] for r in recs], [r["answer"] for r in recs]

    def _seed(self, purpose: str, *extra: int) -> int:
        """Independent seeds per purpose and step (rollouts, eval, injected noise never share a stream)."""
        tag = int.from_bytes(purpose.encode()[:8].ljust(8, b"\0"), "little")
        return int(np.random.SeedSequence([self.c.seed, tag, self.step, *extra]).generate_state(1, np.uint64)[0] >> 2)

    def _hf_weights(self) -> dict[str, np.ndarray]:
        return params_to_hf(distributed.gather_params(self.state.params), self.model_cfg)

    def _spec(self, seed: int, n: int | None = None) -> SamplingSpec:
        r = self.c.rollout
        return SamplingSpec(n=n or r.group_size, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                            top_k=r.top_k, seed=seed, stop_token_ids=(self.tok.eos_id,))

    def _rollout_call(self, what: str, fn):
        """Run a client call; if the managed server died, restart it on the same port and retry once."""
        try:
            return fn()
        except RolloutError as e:
            if self.server is None or not self.c.rollout.restart_on_failure or self.server.alive():
                raise
            log.warning("rollout server died during %s (%s); restarting it on port %d", what, e, self.server.port)
            self.server.start()
            self.client.wait_until_ready(self.c.rollout.startup_timeout_s)
            return fn()  # the client notices the new server id and re-pushes the current weights first

    # -- lifecycle -----------------------------------------------------------------------------------
    def _connect(self) -> None:
        r = self.c.rollout
        if not self.is_lead:
            return
        if r.address:
            token = os.environ.get("JAXRL_ROLLOUT_TOKEN")
            if r.token_file:
                with open(r.token_file) as f:
                    token = f.read().strip()
            if not token:
                raise ValueError("config.rollout.token_file: an external rollout server (rollout.address) needs the "
                                 "shared token for weight pushes; set rollout.token_file or $JAXRL_ROLLOUT_TOKEN")
            target = r.address
        else:
            self.server = ManagedServer(engine=r.engine, model_dir=self.c.model.path, dtype=r.dtype,
                                        work_dir=self.c.run_dir, max_model_len=r.max_model_len,
                                        startup_timeout_s=r.startup_timeout_s)
            target, token = self.server.start(), self.server.token
        self.client = RolloutClient(target, token=token, timeout_s=r.push_timeout_s,
                                    generate_timeout_s=r.generate_timeout_s, wait_ready_s=r.startup_timeout_s,
                                    max_staleness=0)
        self.client.check_compatible(architecture=self.model_cfg.architecture, vocab_size=self.model_cfg.vocab_size,
                                     tokenizer_vocab_size=self.tok.vocab_size)
        # After a server restart the client re-pushes the last weights it pushed (it holds them).
        self.limits = self.client.request_limits()

    def _restore(self) -> None:
        latest = self.ckpt.latest_step()
        if latest is not None and not self.c.resume:
            raise ValueError(f"config.resume is False but {self.ckpt.directory} holds checkpoints (latest step "
                             f"{latest}); use a new run_dir or move them aside")
        if latest is None:
            return
        state, meta = self.ckpt.restore(latest, abstract_state=abstract_state_of(self.state))
        self.state = state
        self.step = int(meta["step"])
        self.prompts.restore(meta["data"])
        if self.controller is not None and meta.get("controller") is not None:
            self.controller.load_state_dict(meta["controller"])
        self.weight_version = int(meta["weight_version"])
        log.info("resumed from step %d (weight version %d)", self.step, self.weight_version)

    def _sync_weights(self) -> None:
        """Push the trainer's weights once at connect time, as a version above anything the server has seen.

        A fresh managed server holds the base checkpoint (version 0), a reused external server may hold a
        previous run's weights at a higher version, a resumed run has newer params than either: one push
        covers all three, and leaves the client holding a version >= 1 to re-push after a restart.
        """
        weights = self._hf_weights()  # every process joins the gather (multi-host)

        def push() -> dict[str, float]:
            server_version = self.client.info().weight_version
            version = max(self.weight_version, server_version) + 1
            self._rollout_call("UpdateWeights", lambda: self.client.push_weights(weights, version))
            return {"version": float(version)}

        self.weight_version = int(distributed.on_lead(self.is_lead, push, ("version",))["version"])

    def _save(self, data_state: dict | None = None) -> None:
        meta = {
            "step": self.step,
            "data": data_state if data_state is not None else self.prompts.state,
            "controller": self.controller.state_dict() if self.controller is not None else None,
            "weight_version": self.weight_version,
            "config": self.c.to_dict(),
        }
        self.ckpt.save(self.step, self.state, meta, force=True)

    def close(self) -> None:
        self.ckpt.wait()
        self.ckpt.close()
        if self.writer is not None:
            self.writer.close()
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()

    # -- one step ------------------------------------------------------------------------------------
    def _rollout_batch(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        c = self.c
        start = self.prompts.state

        def attempt():
            self.prompts.restore(start)  # a retry after a server restart samples the same prompts again
            return collect(self.client, self._next_prompts, lambda rnd: self._spec(self._seed("rollout", rnd)),
                           self._reward, num_groups=c.batch.prompts_per_step, dynamic_sampling=c.batch.dynamic_sampling,
                           max_oversample_rounds=c.batch.max_oversample_rounds, limits=self.limits)

        collected = self._rollout_call("Generate", attempt)
        tb, rewards, gids = to_train_batch(collected.groups, pad_id=self.tok.pad_id)
        seq_adv = np.asarray(compute_advantages(c.objective.advantages, jnp.asarray(rewards), jnp.asarray(gids),
                                                c.batch.prompts_per_step))
        batch = {
            "tokens": tb.tokens,
            "attention_mask": tb.attention_mask,
            "response_mask": tb.response_mask,
            "advantages": (seq_adv[:, None] * tb.response_mask).astype(np.float32),
            "rollout_logp": tb.rollout_logp,
        }
        return batch, collected.stats

    def _add_trainer_logprobs(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """π(θ_old) by a teacher-forced forward (+ the reference policy), then the diagnostics' edits of μ."""
        c, mask = self.c, batch["response_mask"]
        dev = place_batch({"tokens": batch["tokens"], "attention_mask": batch["attention_mask"]}, self.mesh)
        old_logp, _ = self.old_logprobs(self.state.params, dev["tokens"], dev["attention_mask"])
        batch["old_logp"] = distributed.to_host(old_logp) * mask
        if self.ref_params is not None:
            ref_logp, _ = self.old_logprobs(self.ref_params, dev["tokens"], dev["attention_mask"])
            batch["ref_logp"] = distributed.to_host(ref_logp) * mask
        d = c.diagnostics
        if d.zero_mismatch:
            batch["rollout_logp"] = batch["old_logp"].copy()
        if d.inject_mismatch_scale:
            seed = self._seed("inject") % (1 << 31)
            batch["rollout_logp"] = np.asarray(inject_mismatch(jnp.asarray(batch["rollout_logp"]), jnp.asarray(mask),
                                                               scale=d.inject_mismatch_scale, seed=seed))
        weight = np.ones_like(mask)
        if d.weight_distortion_delta >= 0:
            weight = weight * np.asarray(weight_distortion(jnp.asarray(batch["old_logp"]), jnp.asarray(mask),
                                                           delta=d.weight_distortion_delta, pi_low=d.weight_distortion_pi_low))
        if d.variance_sigma:
            seed = self._seed("variance") % (1 << 31)
            weight = weight * np.asarray(variance_weights(jnp.asarray(mask), sigma=d.variance_sigma, seed=seed))
        if d.weight_distortion_delta >= 0 or d.variance_sigma:
            batch["token_weight"] = weight.astype(np.float32)
        return batch

    def _optimize(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """PPO epochs × minibatches of the jitted update; metrics averaged over the updates."""
        c, acc = self.c, StepAccumulator()
        rows = batch["tokens"].shape[0]
        for epoch in range(c.batch.ppo_epochs):
            order = (np.random.default_rng([c.seed, self.step, epoch]).permutation(rows)
                     if c.batch.minibatches > 1 else np.arange(rows))
            for m in range(c.batch.minibatches):
                idx = order[m * self.mb_rows:(m + 1) * self.mb_rows]
                mb = place_batch({k: v[idx] for k, v in batch.items()}, self.mesh)
                if self.update is None:
                    self.update = jit_update(self.update_fn, self.state, mb, self.mesh)
                self.state, metrics = self.update(self.state, mb)
                acc.add(metrics)
        return acc.compute()

    def _evaluate(self) -> dict[str, float]:
        return distributed.on_lead(self.is_lead, self._evaluate_on_lead, ("val/accuracy", "val/greedy_accuracy"))

    def _evaluate_on_lead(self) -> dict[str, float]:
        c, out = self.c, {}
        answers = [r["answer"] for r in self.val_records]
        seed = self._seed("eval")
        out["val/accuracy"] = self._rollout_call("Generate", lambda: evaluate(
            self.client, self.val_ids, answers, self._reward, k=c.eval.k, temperature=c.eval.temperature,
            max_tokens=c.rollout.max_tokens, stop_token_ids=(self.tok.eos_id,), seed=seed, limits=self.limits))
        if c.eval.greedy:
            out["val/greedy_accuracy"] = self._rollout_call("Generate", lambda: evaluate(
                self.client, self.val_ids, answers, self._reward, k=1, temperature=0.0,
                max_tokens=c.rollout.max_tokens, stop_token_ids=(self.tok.eos_id,), seed=seed, limits=self.limits))
        return out

    def train_step(self) -> dict[str, float]:
        """One RL step. `self.step` advances as soon as the update is applied; the record of the finished
        step waits in `self._unwritten` until `run` writes it (also on the failure path)."""
        t0 = time.perf_counter()
        self._step_data_start = self.prompts.state
        batch, stats = distributed.lead_computes(self.is_lead, self._rollout_batch, BATCH_KEYS, STAT_KEYS)
        t_rollout = time.perf_counter() - t0
        batch = self._add_trainer_logprobs(batch)
        metrics = self._optimize(batch)
        metrics.update(stats)
        t_update = time.perf_counter() - t0 - t_rollout
        metrics["lr"] = float(get_lr(self.state.opt_state))
        if self.controller is not None:
            # The controller sees step s's metrics; the scale it returns drives the next step's update.
            scale = self.controller.update(self.step, metrics)
            metrics.update({f"controller/{k}": float(v) for k, v in self.controller.metrics().items()})
            self.state = self.state.replace(opt_state=set_lr_scale(self.state.opt_state, scale, self.mesh))
        self.step += 1
        metrics.update({"time/rollout_s": t_rollout, "time/update_s": t_update})
        self._unwritten = (self.step - 1, metrics)
        weights = self._hf_weights()  # every process joins the gather (multi-host); process 0 pushes
        version = self.weight_version + 1

        def push() -> dict[str, float]:
            self._rollout_call("UpdateWeights", lambda: self.client.push_weights(weights, version))
            return {}

        distributed.on_lead(self.is_lead, push, ())
        self.weight_version = version
        metrics.update({"time/step_s": time.perf_counter() - t0, "rollout/weight_version": float(version)})
        return metrics

    # -- the run -------------------------------------------------------------------------------------
    def _write_pending(self) -> None:
        if self._unwritten is not None and self.writer is not None:
            self.writer.write(*self._unwritten)
        self._unwritten = None

    def run(self) -> dict[str, Any]:
        """Train to `config.steps`. A rollout failure that cannot be recovered, or a stop request (SIGTERM),
        ends the run between steps with a checkpoint of the last finished step: rerunning resumes it."""
        c = self.c
        self._restore()
        self._connect()
        self._sync_weights()
        self.writer = RunWriter(c.run_dir, resume_from_step=self.step if self.step else None,
                                tensorboard=c.log.tensorboard) if self.is_lead else None
        summary: dict[str, Any] = {"start_step": self.step, "stopped_early": False}
        progress = _progress(c, self.step)
        try:
            if self.step == 0:
                first = self._evaluate()
                summary["initial"] = first
                if self.writer is not None:
                    self.writer.write(-1, {**first, "lr": float(get_lr(self.state.opt_state))})
            while self.step < c.steps and not self.stop_requested:
                metrics = self.train_step()
                last = self.step == c.steps
                if (c.eval.every and self.step % c.eval.every == 0) or last:
                    metrics.update(self._evaluate())
                self._write_pending()
                progress.update(1)
                progress.set_postfix(_postfix(metrics), refresh=False)
                if (c.checkpoint.every and self.step % c.checkpoint.every == 0) or last:
                    self._save()
                summary["final"] = {k: v for k, v in metrics.items() if k.startswith(("val/", "reward/"))}
            if self.stop_requested and self.step < c.steps:
                self._save()
                summary["stopped_early"] = True
        except (RolloutError, ServerStartError, NonFiniteLogprobsError, distributed.LeadFailure) as e:
            # A step that failed before its update keeps the data position it started from.
            data_state = None if self._unwritten is not None else getattr(self, "_step_data_start", None)
            self._write_pending()
            self._save(data_state)
            self.ckpt.wait()
            raise RolloutFailure(
                f"rollout failed at step {self.step}: {e}\n"
                f"A resumable checkpoint of step {self.step} is in {os.path.join(c.run_dir, 'checkpoints')}; "
                f"fix the server (log: {self.server.log_path if self.server else c.rollout.address}) and rerun "
                f"the same command to resume."
            ) from e
        finally:
            progress.close()
        summary["end_step"] = self.step
        return summary


def _postfix(m: dict[str, float]) -> dict[str, str]:
    out = {"reward": f"{m.get('reward/mean', float('nan')):.3f}", "lr": f"{m.get('lr', float('nan')):.2e}",
           "log_ppl_abs_diff": f"{m.get('mismatch/log_ppl_abs_diff', float('nan')):.1e}"}
    if "val/accuracy" in m:
        out["val"] = f"{m['val/accuracy']:.3f}"
    return out


def _progress(c: ml_collections.ConfigDict, start: int):
    if c.log.progress and jax.process_index() == 0:
        from tqdm import tqdm

        return tqdm(total=c.steps, initial=start, desc="rl", unit="step", dynamic_ncols=True)
    return _NoBar()


class _NoBar:
    def update(self, n):
        pass

    def set_postfix(self, *a, **k):
        pass

    def close(self):
        pass
