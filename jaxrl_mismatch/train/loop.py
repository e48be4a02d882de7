"""The RL loop: push weights → rollouts → batch → prepare (θ_old) → PPO updates → controller → log,
validate, checkpoint.

`Trainer` only sequences its parts: `Learner` (state and jitted functions), `TaskData` (prompts, rewards),
`RolloutSession` (server, versions, recovery), the controller and the checkpointer. Every host object
with state (prompt order, controller, weight version) saves a plain value in the checkpoint, so a stopped
run resumes where it was. A step's weights are pushed at its start, so a failure anywhere before its
update leaves the previous step's state and data position intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import logging
import os
import shutil
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from jaxrl_mismatch.models.hf_io import ModelFilesError
from jaxrl_mismatch.objectives import compute_advantages
from jaxrl_mismatch.rollout import (EngineInfo, EngineMismatchError, NonFiniteLogprobsError, RetryPolicy, RolloutError,
                                    SamplingSpec)
from jaxrl_mismatch.rollout.mismatch_schedule import mismatch_scale, rollout_mismatch
from jaxrl_mismatch.rollout.session import RolloutSession
from jaxrl_mismatch.runlog import RunWriter
from jaxrl_mismatch.schedules import MissingMetricError
from jaxrl_mismatch.train import distributed
from jaxrl_mismatch.train.batch import RolloutBatch, rollout_fields
from jaxrl_mismatch.train.checkpoint import (Checkpointer, CheckpointDamagedError, CheckpointMismatchError,
                                             require_meta)
from jaxrl_mismatch.train.collect import STAT_KEYS, collect, evaluate, overlong_penalty, to_batch
from jaxrl_mismatch.train.config import ConfigError
from jaxrl_mismatch.train.config_resume import config_changes
from jaxrl_mismatch.train.learner import Learner
from jaxrl_mismatch.train.learner_config import learner_config
from jaxrl_mismatch.train.optimizer import build_controller
from jaxrl_mismatch.train.rollout_producer import LockedSession, Produced, RolloutProducer
from jaxrl_mismatch.train.runlock import RunDirLock
from jaxrl_mismatch.train.task_data import TaskData
from jaxrl_mismatch.usage import UsageError, listing

log = logging.getLogger(__name__)
VAL_KEYS = ("val/accuracy", "val/greedy_accuracy")
# Asynchronous rollouts: which batch a step trained on (its index and first prompt's position in the prompt
# order, epoch × records + index), batches dropped beyond the bound so far, and the two sides' times.
ASYNC_STAT_KEYS = ("rollout/batch_index", "rollout/prompt_position", "rollout/dropped_batches",
                   "time/rollout_wait_s", "time/generate_s")


# What `_save` writes into every checkpoint's meta, and a resume reads back ("controller" may be None).
RUN_META_FIELDS: dict[str, type] = {"step": int, "weight_version": int, "data": dict, "config": dict}


def check_context(c: ml_collections.ConfigDict, longest_prompt: int, max_position_embeddings: int) -> None:
    """ConfigError naming `rollout.max_tokens` unless the task's longest prompt and a whole response fit the context
    the server serves (`rollout.max_model_len`, else the model's): the server refused the first rollout, after the
    run directory, its lock and checkpoints folder were made and, on a large model, after the model had loaded."""
    context, name = ((c.rollout.max_model_len, "rollout.max_model_len") if c.rollout.max_model_len else
                     (max_position_embeddings, f"{c.model.path}'s max_position_embeddings"))
    _check_fits(longest_prompt, c.rollout.max_tokens, context, f"{name} {context}", "use shorter prompts")


def _check_fits(longest_prompt: int, max_tokens: int, context: int, described: str, remedy: str) -> None:
    """ConfigError naming `rollout.max_tokens` when the longest prompt + a whole response exceed `context`
    (`described`: the context as the message names it)."""
    if longest_prompt + max_tokens > context:
        raise ConfigError(f"config.rollout.max_tokens: the task's longest prompt ({longest_prompt} tokens) + "
                          f"max_tokens ({max_tokens}) exceeds {described}; lower rollout.max_tokens or {remedy}")


def check_servers(r: ml_collections.ConfigDict, infos: list[EngineInfo], where: str,
                  longest_prompt: int | None = None) -> None:
    """ConfigError unless every server serves what the config's `rollout` section asks for: its weight quantization,
    with top-k/top-p each token's kept-set size (an attached vLLM server returns log-probs renormalised over the
    kept set without it, and π over the full vocabulary would bias every ratio by the kept mass), its engine and its
    precision (an attached server started with another `--dtype` made μ another precision's than the run records:
    an FP16 run measured a BF16 mismatch), the `max_model_len` the config names, and a context that holds the
    task's longest prompt and a whole response (`check_context` knows only the config's and the model's: an
    attached server with a shorter one refused the first rollout, after the model had loaded)."""
    for i in infos:
        if r.max_model_len and i.max_model_len != r.max_model_len:
            raise ConfigError(f"config.rollout.max_model_len: {r.max_model_len}, but {where} serves "
                              f"{i.max_model_len} (serve --max-model-len {r.max_model_len})")
        if longest_prompt is not None:
            _check_fits(longest_prompt, r.max_tokens, i.max_model_len,
                        f"the max_model_len {i.max_model_len} {where} serves", "serve a longer context")
        if i.quantize != r.quantize:
            raise ConfigError(f"config.rollout.quantize: {r.quantize!r}, but {where} serves {i.quantize!r} weights "
                              f"(serve --quantize {r.quantize})")
        if (r.top_p < 1.0 or r.top_k > 0) and "kept_counts" not in i.options:
            field = "rollout.top_p" if r.top_p < 1.0 else "rollout.top_k"
            raise ConfigError(f"config.{field}: needs a rollout engine that returns each token's kept-set size (the "
                              f"jax engine), but {where} ({i.engine} engine) does not; the trainer could not "
                              "renormalise π over the tokens μ was sampled from")
        if i.engine != r.engine:
            raise ConfigError(f"config.rollout.engine: {r.engine!r}, but {where} is a {i.engine!r} server "
                              f"(set --config.rollout.engine={i.engine}, or serve --engine {r.engine})")
        if i.dtype != r.dtype:
            raise ConfigError(f"config.rollout.dtype: {r.dtype!r}, but {where} serves in {i.dtype!r} (set "
                              f"--config.rollout.dtype={i.dtype}, or serve --dtype {r.dtype})")


# What a rollout server serves that decides μ: every server of a run must serve the same, at the start and when
# one comes back (restarted by its session or its own supervisor, or rejoining a fleet).
SERVED_FIELDS = ("architecture", "vocab_size", "dtype", "engine", "quantize", "max_model_len", "options")


def served_differences(a: EngineInfo, b: EngineInfo) -> list[str]:
    """`field: a → b` for each of SERVED_FIELDS the two servers differ in (options compared as sets)."""
    out = []
    for field in SERVED_FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        if field == "options":
            x, y = sorted(x), sorted(y)
        if x != y:
            out.append(f"{field}: {x!r} → {y!r}")
    return out


class RolloutFailure(RuntimeError):
    """The rollout server failed for good; a resumable checkpoint was written (see the message)."""


class Trainer:
    def __init__(self, c: ml_collections.ConfigDict, *, accept_config_changes: bool = False) -> None:
        """`c` has passed `config_checks.validate` and `check_paths` (where it was read: `jobs/train.py`)."""
        self.c, self.accept_config_changes = c, accept_config_changes
        self.is_lead = jax.process_index() == 0
        created = _missing_dirs(c.run_dir)  # what this command creates: removed again if it stops on bad input
        self._created = created
        os.makedirs(c.run_dir, exist_ok=True)
        # Before anything touches the directory (the checkpointer tidies it): one trainer per run_dir.
        self.lock = RunDirLock(c.run_dir).acquire() if self.is_lead else None
        try:
            self._build(c)
        except UsageError:
            # A usage error (a prompt longer than task.max_prompt_len, ...) left nothing worth keeping in a run
            # directory this command created: its lock and empty folders go, so a rerun starts as before.
            self._forget_start()
            raise

    def _build(self, c: ml_collections.ConfigDict) -> None:
        try:
            self.learner = Learner(learner_config(c))
        except ModelFilesError as e:  # a damaged or incomplete base model: one line naming the field and file
            raise ConfigError(f"config.model.path: {e}") from None
        # A MoE policy sampled by the built-in engine brings the engine's routing into the batch (routing
        # replay R3, and the moe/router_disagree_* metrics for any replay mode); vLLM does not return it.
        self.collect_routing = (self.learner.routing_shape is not None and c.rollout.engine == "jax"
                                and not c.rollout.exact)
        # Process 0 first: a file task's dataset is built (once, under a lock) in a directory all processes share.
        self.data = distributed.lead_first(self.is_lead, lambda: TaskData(c, self.learner.model_cfg.vocab_size))
        check_context(c, self.data.longest_prompt, self.learner.model_cfg.max_position_embeddings)
        self.controller = build_controller(c.controller)
        self.ckpt = Checkpointer(os.path.join(c.run_dir, "checkpoints"), max_to_keep=c.checkpoint.keep)
        self.step = 0
        self._version = 0  # the weight version where no session counts it: restored, or on processes > 0
        self._dropped = 0  # asynchronous batches dropped before the resumed position (restored)
        self._pushed_step: int | None = None  # the step whose weights the server serves
        # the restored step was applied but its validation was not (a rollout failure in it): done at the resume
        self._eval_pending = False
        self.session: RolloutSession | None = None
        self.producer: RolloutProducer | None = None  # rollout.max_staleness > 0 (process 0 only)
        self.writer: RunWriter | None = None
        self.stop_requested = False  # set by a signal handler; honoured between steps

    # -- the run -------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to `config.steps`. A rollout failure that cannot be recovered, or a stop request (SIGTERM),
        ends the run between steps with a checkpoint of the last finished step: rerunning resumes it."""
        c = self.c
        self._restore()
        if self.is_lead:
            try:
                self.session = self._open_session()
            except (RolloutError, UsageError) as e:  # nothing trained: the run (if any) stays at its checkpoint
                self._forget_start()
                if isinstance(e, UsageError):  # a token file that is missing or empty, ...
                    raise
                raise RolloutFailure(f"rollout server unavailable at the start (step {self.step}): {e}; nothing "
                                     "was trained or written; fix the server and rerun the same command") from e
            if c.rollout.max_staleness:
                self.session = LockedSession(self.session)
                self.producer = RolloutProducer(
                    self._produce, max_staleness=c.rollout.max_staleness, fixed=c.rollout.fixed_staleness,
                    start_index=self.step + self._dropped, last_index=c.steps - 1 + self._dropped,
                    data_state=lambda: self.data.prompts.state, dropped=self._dropped)
            self.writer = RunWriter(c.run_dir, resume_from_step=self.step or None, tensorboard=c.log.tensorboard)
        summary: dict[str, Any] = {"start_step": self.step, "stopped_early": False}
        progress = _Progress(c, self.step)
        data_start: tuple[dict, int] | None = None  # (data position, batch index) of a step in flight (None: none)
        unwritten: dict | None = None  # the record of an applied step, until it is written
        try:
            self._push()
            if self.step == 0:
                summary["initial"] = self._evaluate()
                self._write(-1, {**summary["initial"], "lr": self.learner.lr})
                progress.note(-1, summary["initial"])
            if self._eval_pending:  # the resumed step's validation, which a rollout failure interrupted
                val = self._evaluate()
                record = self.writer.amend(self.step - 1, val) if self.writer is not None else val
                self._eval_pending = False
                progress.note(self.step - 1, val)
                summary["final"] = {k: v for k, v in record.items() if k.startswith(("val/", "reward/"))}
            stopping = False
            while self.step < c.steps:
                # every process stops at the same step (the signal may reach them one by one): else one would
                # enter the stop's collective checkpoint save while another gathers the next step's batch
                if distributed.any_process(self.stop_requested):
                    stopping = True
                    break
                data_start = self._data_position()
                metrics = unwritten = self.train_step()
                data_start = None  # the step is applied: the current data position is its successor's
                last = self.step == c.steps
                if (c.eval.every and self.step % c.eval.every == 0) or last:
                    self._eval_pending = True  # until it is done: a rollout failure leaves it to the resume
                    self._push()  # "after step N" measures step N's update (the next step's push is then skipped)
                    val = self._evaluate()
                    self._eval_pending = False
                    metrics.update(val)
                    progress.note(self.step - 1, val)
                self._write(self.step - 1, metrics)
                unwritten = None
                progress.update(metrics)
                if (c.checkpoint.every and self.step % c.checkpoint.every == 0) or last:
                    self._save()
                summary["final"] = {k: v for k, v in metrics.items() if k.startswith(("val/", "reward/"))}
            if stopping:
                self._save()
                summary["stopped_early"] = True
        except (RolloutError, NonFiniteLogprobsError, distributed.LeadFailure) as e:
            # Save the last applied step. A step that failed before its update rewinds the data position
            # to where it started, so a rerun repeats it exactly; an applied step keeps its record.
            if unwritten is not None:
                self._write(self.step - 1, unwritten)
            self._save(data_start)
            self.ckpt.wait()
            where = self.session.describe() if self.session is not None else "the rollout server"
            raise RolloutFailure(
                f"rollout failed at step {self.step}: {e}\nA resumable checkpoint of step {self.step} is in "
                f"{os.path.join(c.run_dir, 'checkpoints')}; fix the server ({where}) and rerun the same command "
                f"to resume.") from e
        finally:
            progress.close()
        summary["end_step"] = self.step
        return summary

    def train_step(self) -> dict[str, float]:
        """One RL step on the weights pushed at its start; returns its metrics record."""
        t0 = time.perf_counter()
        self._push()
        asynchronous = bool(self.c.rollout.max_staleness)
        arrays, stats = distributed.lead_computes(
            self.is_lead, self._take_rollout if asynchronous else self._rollout,
            rollout_fields(with_routing=self.collect_routing,
                           with_kept=self.c.rollout.top_p < 1.0 or self.c.rollout.top_k > 0) + ("sample_version",),
            STAT_KEYS + ("rollout/mismatch_scale",) + (ASYNC_STAT_KEYS if asynchronous else ()))
        versions = arrays.pop("sample_version")
        batch = RolloutBatch(**arrays)
        batch = batch.replace(version_lag=(self.version - versions).astype(np.int32))
        t_rollout = time.perf_counter() - t0
        metrics = self.learner.step(batch, seed=self._seed("diagnostics"), minibatch_seed=self._seed("minibatches"))
        metrics.update(stats)  # incl. rollout/mismatch_scale: the strength the batch was sampled with
        metrics["lr"] = self.learner.lr
        if self.controller is not None:
            # The controller sees step s's metrics; the scale it returns drives the next step's updates.
            try:
                scale = self.controller.update(self.step, metrics)
            except MissingMetricError as e:  # a typo in the config: one line naming the field, not a KeyError
                near = difflib.get_close_matches(e.metric, e.available, n=1)
                raise ConfigError(f"config.controller.kwargs.{e.field}: {e.metric!r} is not a metric of a training step"
                                  + (f"; did you mean {near[0]!r}?" if near else f" (they are {listing(e.available)})")
                                  ) from None
            self.learner.set_lr_scale(scale)
            metrics.update({f"controller/{k}": float(v) for k, v in self.controller.metrics().items()})
        self.step += 1
        metrics.update({"rollout/weight_version": float(self.version), "time/rollout_s": t_rollout,
                        "time/update_s": time.perf_counter() - t0 - t_rollout, "time/step_s": time.perf_counter() - t0})
        return metrics

    @property
    def version(self) -> int:
        """The weight version the rollout server serves. Counted in one place: the rollout session on process 0
        (started at the checkpoint's version, one up per push); processes without a session keep the value
        each push broadcasts (and, before the session opens, the restored one)."""
        return self.session.version if self.session is not None else self._version

    def _forget_start(self) -> None:
        """A start that stopped on bad input or an unreachable server before any step, in a run directory this
        command created: its lock, empty folders and dataset build go, so a rerun starts as before (the rerun
        refused the directory, "not written by train", for the dataset build it held)."""
        if not self._created or getattr(self, "step", 0):
            return
        built = os.path.join(self.c.run_dir, "tfds")
        if not self.c.task.data_dir and os.path.isdir(built) and not os.path.islink(built):
            shutil.rmtree(built)  # the task's dataset, built by this start in the directory it created
        if self.lock is not None:  # removed while held: released first, another trainer could take it meanwhile
            self.lock.remove()
            self.lock = None
        _remove_created(self.c.run_dir, self._created)

    def close(self) -> None:
        try:
            if self.producer is not None:
                self.producer.close()
            self.ckpt.close()  # releases orbax's threads even after a failed save (already reported)
            if self.writer is not None:
                self.writer.close()
            if self.session is not None:
                self.session.close()
        finally:
            if self.lock is not None:
                self.lock.release()

    # -- parts of a step -----------------------------------------------------------------------------
    def _push(self) -> None:
        """Make the server serve the current weights (once per step; the first push also covers a resume)."""
        if self._pushed_step == self.step:
            return
        weights = self.learner.hf_weights()  # every process joins the gather (multi-host); process 0 pushes

        def push() -> dict[str, float]:
            # The producer lives on process 0: its error (before_push re-raises it) must reach the other
            # processes through on_lead too, or they wait in its broadcast while process 0 saves (a collective).
            if self.producer is not None:
                self.producer.before_push()
            return {"version": float(self.session.push(weights))}

        version = int(distributed.on_lead(self.is_lead, push, ("version",))["version"])
        if self.session is None:  # process > 0: the lead's session counted it
            self._version = version
        self._pushed_step = self.step
        self.learner.behaviour.remember(self.version, self.learner.state.params)
        if self.producer is not None:
            self.producer.pushed()

    def _produce(self, index: int, data_start: dict) -> Produced:
        """Batch `index` on the producer thread: step `index`'s seeds, the prompts that come next."""
        arrays, stats = self._rollout(index)
        return Produced(index=index, arrays=arrays, stats=stats, data_start=data_start, generate_s=0.0)

    def _take_rollout(self) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The next produced batch within `rollout.max_staleness` of the current version (process 0 only)."""
        t0 = time.perf_counter()
        while True:
            item = self.producer.take()
            if self.version - item.oldest_version <= self.c.rollout.max_staleness:
                break
            self.producer.drop(item, self.version)
        d = item.data_start
        return item.arrays, {**item.stats, "rollout/batch_index": float(item.index),
                             "rollout/prompt_position": float(d["epoch"] * d["num_records"] + d["index"]),
                             "rollout/dropped_batches": float(self.producer.dropped),
                             "time/rollout_wait_s": time.perf_counter() - t0, "time/generate_s": item.generate_s}

    def _data_position(self) -> tuple[dict, int]:
        """(the prompt position of the next step's batch, its batch index): with a producer, the oldest batch not
        yet trained on (a resume regenerates what was in flight), whose index is ahead of the step by the batches
        dropped before it."""
        if self.producer is not None:
            return self.producer.resume_state()
        return self.data.prompts.state, self.step

    def _rollout(self, index: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """(the rollout fields of step `index`'s batch (default: this step) and each row's weight version as
        "sample_version" [B], rollout statistics); process 0 only."""
        c = self.c
        step = self.step if index is None else index
        collected = collect(self.session, self.data.next_prompts,
                            lambda rnd: self._spec(self._seed("rollout", rnd, step=step), step),
                            self.data.reward, num_groups=c.batch.prompts_per_step,
                            dynamic_sampling=c.batch.dynamic_sampling,
                            max_oversample_rounds=c.batch.max_oversample_rounds, penalty_fn=self._penalty_fn())

        kind = self.learner.objective.cfg.advantages

        def advantages(rewards, group_ids, num_groups):
            return np.asarray(compute_advantages(kind, rewards, group_ids, num_groups))

        batch = to_batch(collected.groups, advantages, pad_id=self.data.pad_id, with_routing=self.collect_routing,
                         truncated=self.c.rollout.top_p < 1.0 or self.c.rollout.top_k > 0)
        versions = np.array([cm.weight_version for g in collected.groups for cm in g.completions], np.int32)
        # The strength travels with the batch: after a dropped batch the producer's indices run ahead of the
        # trainer's step, and the logged scale must be the one the batch was sampled with.
        stats = {**collected.stats, "rollout/mismatch_scale": self._mismatch_scale(step)}
        return {**batch.arrays(), "sample_version": versions}, stats

    def _penalty_fn(self) -> Callable[[int], float] | None:
        """The training rollouts' length penalty (`task.overlong_buffer_len`, DAPO eq. 13), or None when off."""
        t = self.c.task
        if not t.overlong_buffer_len:
            return None
        return functools.partial(overlong_penalty, max_tokens=self.c.rollout.max_tokens,
                                 buffer_len=t.overlong_buffer_len, factor=t.overlong_penalty_factor)

    def _spec(self, seed: int, step: int) -> SamplingSpec:
        """Step `step`'s training rollout sampling: the configured exact mode and injected mismatch apply here
        (and not to validation, which measures the policy itself). The mismatch strength follows the step the
        batch is made for, which the asynchronous producer runs ahead of the trainer's step."""
        r = self.c.rollout
        return SamplingSpec(n=r.group_size, max_tokens=r.max_tokens, temperature=r.temperature, seed=seed,
                            top_p=r.top_p, top_k=r.top_k, stop_token_ids=self.data.stop_ids, exact=r.exact, return_routing=self.collect_routing,
                            **rollout_mismatch(r, step))

    def _mismatch_scale(self, step: int) -> float:
        """Step `step`'s strength of the configured mismatch (rollout/mismatch_schedule.py)."""
        r = self.c.rollout
        return mismatch_scale(step, r.mismatch_onset_step, r.mismatch_ramp_steps)

    def _evaluate(self) -> dict[str, float]:
        return distributed.on_lead(self.is_lead, self._evaluate_on_lead, VAL_KEYS)

    def _evaluate_on_lead(self) -> dict[str, float]:
        c, d, seed = self.c, self.data, self._seed("eval")
        runs = [("val/accuracy", c.eval.k, c.eval.temperature)] + ([("val/greedy_accuracy", 1, 0.0)] if c.eval.greedy else [])
        return {name: evaluate(self.session, d.val_ids, d.val_answers, d.reward, k=k, temperature=t,
                               max_tokens=c.rollout.max_tokens, stop_token_ids=d.stop_ids, seed=seed,
                               quantize_strength=self._eval_quantize_strength)
                for name, k, t in runs}

    def _seed(self, purpose: str, *extra: int, step: int | None = None) -> int:
        """Independent seeds per purpose and step (rollouts, eval, minibatch order, diagnostics)."""
        tag = int.from_bytes(purpose.encode()[:8].ljust(8, b"\0"), "little")
        step = self.step if step is None else step
        return int(np.random.SeedSequence([self.c.seed, tag, step, *extra]).generate_state(1, np.uint64)[0] >> 2)

    # -- session, checkpoints, log -------------------------------------------------------------------
    def _open_session(self) -> RolloutSession:
        r = self.c.rollout
        timeouts = dict(timeout_s=r.push_timeout_s, generate_timeout_s=r.generate_timeout_s,
                        ready_timeout_s=r.startup_timeout_s, start_version=self._version,
                        weight_transport=r.weight_transport, retry=RetryPolicy.within(r.retry_s))
        addresses = [a.strip() for a in r.address.split(",") if a.strip()]
        if len(addresses) > 1 or r.num_servers > 1:  # a fleet: spread requests, fail over (rollout/fleet.py)
            from jaxrl_mismatch.rollout.fleet import RolloutFleet

            if addresses:
                session = RolloutFleet.attach(addresses, token=_read_token(r.token_file),
                                              stall_timeout_s=r.stall_timeout_s, **timeouts)
            else:
                session = RolloutFleet.launch(r.num_servers, work_dir=self.c.run_dir, engine=r.engine,
                                              model=self.c.model.path, dtype=r.dtype, max_model_len=r.max_model_len,
                                              quantize=r.quantize, restart=r.restart_on_failure,
                                              stall_timeout_s=r.stall_timeout_s, **timeouts)
        elif r.address:
            session = RolloutSession.attach(r.address, token=_read_token(r.token_file), **timeouts)
        else:
            session = RolloutSession.launch(work_dir=self.c.run_dir, engine=r.engine, model=self.c.model.path,
                                            dtype=r.dtype, max_model_len=r.max_model_len, quantize=r.quantize,
                                            restart=r.restart_on_failure, **timeouts)
        try:
            cfg = self.learner.model_cfg
            session.check_compatible(architecture=cfg.architecture, vocab_size=cfg.vocab_size,
                                     tokenizer_vocab_size=self.data.tok.vocab_size)
            infos = session.infos() if hasattr(session, "infos") else [session.info()]  # a fleet: every live server
            info = infos[0]
            for k, other in enumerate(infos[1:], start=1):
                if diff := served_differences(info, other):
                    raise ConfigError(f"config.rollout.address: the servers do not serve the same (server 0 vs {k}: "
                                      f"{'; '.join(diff)}); a mixed fleet would mix μ")
            check_servers(r, infos, session.describe(), self.data.longest_prompt)
            # Validation measures the trainer's policy: full-precision weights where the engines can serve them.
            self._eval_quantize_strength = 0.0 if all("quantize_strength" in i.options for i in infos) else 1.0
            if self.collect_routing and "routing" not in info.options:
                raise ConfigError(f"config.rollout.engine: 'jax' with a MoE policy needs the server's 'routing' "
                                  f"option, but {session.describe()} ({info.engine} engine) does not offer it; set "
                                  "rollout.engine to the server's engine (routing_replay 'R3' needs the jax engine)")
        except BaseException:
            session.close()
            raise

        def check_returning(client) -> None:
            # A server that comes back must serve what this one did at the start; the push and the batch would
            # otherwise take it in (a push is accepted whatever its quantization, and floats are cast to its dtype).
            if diff := served_differences(info, client.info()):
                raise EngineMismatchError(f"rollout server at {client.target} came back serving something else than "
                                          f"at the start ({'; '.join(diff)}); it is not used")

        session.set_server_check(check_returning)
        return session

    def _restore(self) -> None:
        latest = self.ckpt.latest_step()
        if latest is None:
            check_fresh_start(self.c.run_dir, self.ckpt.directory)
            return
        if not self.c.resume:
            raise ConfigError(f"config.resume: False but {self.ckpt.directory} holds checkpoints (latest step "
                              f"{latest}); use a new run_dir or move them aside")
        # A damaged newest checkpoint is moved aside (one warning) and the next older one restored.
        _, (state, meta) = self.ckpt.newest_good(self._read_checkpoint)
        self.learner.load_state(state)
        self.step, self._version = int(meta["step"]), int(meta["weight_version"])
        self._dropped = int(meta.get("dropped_batches", 0))  # checkpoints from before the field: none counted
        self._eval_pending = bool(meta.get("eval_pending", False))
        if meta.get("pushed_step") == self.step and self._version > 0:
            # The checkpoint's own weights were pushed (for the validation after its last step) as weight_version:
            # the resume's push serves them again under that version, as the uninterrupted run's next push does.
            self._version -= 1
        try:
            self.data.prompts.restore(meta["data"])
        except ValueError as e:  # another dataset size (task.num_train changed) or a damaged position
            raise ConfigError(f"config.task: cannot continue the checkpoint's prompt order: {e} (use a new run_dir "
                              "to train on another prompt set)") from None
        changes = config_changes(meta["config"], self.c.to_dict())  # accepted (`_read_checkpoint` refused others)
        if any(ch.startswith("trainer.precision:") for ch in changes):
            self.learner.reset_loss_scale()
            log.warning("config.trainer.precision changed since the checkpoint: the loss scale starts afresh at %g",
                        float(self.learner.state.loss_scale.scale))
        saved_controller = meta.get("controller")
        if not any(ch.startswith("controller.") for ch in changes):
            if self.controller is not None and saved_controller is not None:
                try:
                    self.controller.load_state_dict(saved_controller)
                except ValueError as e:  # a state this code cannot continue (an older controller rule's)
                    self.learner.set_lr_scale(1.0)
                    log.warning("config.controller: the checkpoint's controller state cannot continue (%s): the LR "
                                "multiplier is reset to 1.0 and the controller starts afresh at step %d",
                                " ".join(str(e).split()), self.step)
        elif self._same_controller(saved_controller):
            # Only the config's text changed (a default written out, say): the controller it builds is the saved
            # one, so its state and the multiplier it left continue, as in an uninterrupted run.
            log.warning("config.controller's text changed since the checkpoint but it builds the same controller: "
                        "its state and LR multiplier continue")
        else:
            # Another controller's state cannot continue this one, and the multiplier the old one left in the
            # optimizer state is not the new one's: the configured controller starts afresh at scale 1.0.
            self.learner.set_lr_scale(1.0)
            log.warning("config.controller changed since the checkpoint: the LR multiplier is reset to 1.0 and the "
                        "controller starts afresh at step %d", self.step)
        log.info("resumed from step %d (weight version %d)", self.step, self.version)
        if self.step > self.c.steps:
            log.warning("config.steps=%d is lower than the %d steps this run has done; nothing to train "
                        "(raise config.steps to continue)", self.c.steps, self.step)

    def _same_controller(self, saved: dict | None) -> bool:
        """Whether the configured controller is the one whose state `saved` holds (same kind and built config):
        then that state is loaded into it. Anything else (another kind or config, no controller on either side)
        is False and changes nothing (`load_state_dict` loads all or nothing)."""
        if self.controller is None or saved is None:
            return False
        try:
            self.controller.load_state_dict(saved)
        except ValueError:
            return False
        return True

    def _read_checkpoint(self, step: int) -> tuple[Any, dict]:
        where = os.path.join(self.ckpt.directory, str(step))
        meta = require_meta(self.ckpt.read_meta(step), where, RUN_META_FIELDS)
        if not isinstance(meta.get("controller"), (dict, type(None))):
            raise CheckpointDamagedError(f"{where}: its meta's 'controller' is not a JSON object")
        changes = config_changes(meta["config"], self.c.to_dict())
        if changes and not self.accept_config_changes:
            raise ConfigError(
                f"config: {self.c.run_dir} was started with another config; resuming would change "
                f"{len(changes)} field(s): " + "; ".join(changes)
                + ". Pass --accept-config-changes to continue with the new values, or use a new run_dir")
        if changes:
            log.warning("resuming with %d changed config field(s): %s", len(changes), "; ".join(changes))
        try:
            return self.ckpt.restore(step, abstract_state=self.learner.abstract_state())
        except CheckpointMismatchError as e:  # another model at model.path, or an accepted change of optimizer
            changed = ", ".join(change.split(":", 1)[0] for change in changes)
            raise ConfigError(
                f"{where}: does not fit this run's model and optimizer state"
                + (f" (changed since it was written: {changed})" if changed else "")
                + f": {' '.join(str(e).split())[:300]}; resume with the model and optimizer it was written with, "
                "or use a new run_dir") from None

    def _save(self, position: tuple[dict, int] | None = None) -> None:
        data_state, index = position if position is not None else self._data_position()
        meta = {
            "step": self.step,
            "data": data_state,
            "dropped_batches": index - self.step,  # the resumed producer's indices continue from step + this
            "controller": self.controller.state_dict() if self.controller is not None else None,
            "weight_version": self.version,
            "pushed_step": self._pushed_step,  # the step whose weights `weight_version` is (None: none pushed)
            "eval_pending": self._eval_pending,  # the step's validation is still to do (the resume does it)
            "config": self.c.to_dict(),
            # model.path as given may be relative to where train ran: `export` finds the base from anywhere
            "model_dir": os.path.abspath(self.c.model.path),
            # what the weights compute with: `export --base` of another base of the same shapes is refused by it
            "model_config": dataclasses.asdict(self.learner.model_cfg),
        }
        self.ckpt.save(self.step, self.learner.state, meta, force=True)
        self.ckpt.wait()  # a failed write stops the run here, before the next step (CheckpointSaveError)

    def _write(self, step: int, record: dict[str, float]) -> None:
        if self.writer is not None:
            self.writer.write(step, record)


def check_fresh_start(run_dir: str, ckpt_dir: str) -> None:
    """A run directory with no checkpoint to restore starts at step 0 (its earlier metrics.jsonl is kept aside by
    `RunWriter`, renamed). Refused, one line naming the directory, when `checkpoints/` holds steps set aside as
    damaged: the user reruns to resume after "no checkpoint can be restored", and the rerun silently started
    over (it deleted the earlier metrics.jsonl, then). A run killed before its first checkpoint starts over."""
    from jaxrl_mismatch.train.checkpoint import CheckpointDamagedError

    damaged = sorted(n for n in os.listdir(ckpt_dir) if ".damaged-" in n) if os.path.isdir(ckpt_dir) else []
    if damaged:
        raise CheckpointDamagedError(
            f"{run_dir}: no checkpoint can be restored (the damaged ones were moved aside: {listing(damaged)}); "
            "starting over would replace this run's metrics.jsonl and report; use a new run_dir or restore the "
            "checkpoints from a backup")


def _missing_dirs(path: str) -> list[str]:
    """The folders `os.makedirs(path)` will create, deepest first."""
    missing, p = [], os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    return missing


# The folders a start makes in its run directory before the first step (the checkpointer's), removed when empty.
_START_FOLDERS = ("checkpoints",)


def _remove_created(run_dir: str, created: list[str]) -> None:
    """Remove the empty folders a stopped start made (`created`, deepest first: the run directory and the parents
    makedirs created, and `_START_FOLDERS` in it); the lock went before (`RunDirLock.remove`). A folder holding
    anything, a user's empty folder included, keeps it and the folders above it (every empty subfolder was
    removed before, whoever had made it)."""
    if not created:
        return
    for name in _START_FOLDERS:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(created[0], name))
    for d in created:  # the run directory, then the parents makedirs created, while each is empty
        try:
            os.rmdir(d)
        except OSError:
            break


def _read_token(token_file: str) -> str:
    """The shared token of an external server: `rollout.token_file`, else $JAXRL_ROLLOUT_TOKEN."""
    from jaxrl_mismatch.rollout.protocol import TOKEN_ENV, read_token

    if token_file and not os.path.isfile(token_file):
        raise ConfigError(f"config.rollout.token_file: {token_file} does not exist")
    try:
        return read_token(token_file, file_label=f"config.rollout.token_file: {token_file}",
                          env_label=f"${TOKEN_ENV} (config.rollout.token_file is unset)",
                          missing=f"config.rollout.token_file: an external rollout server (rollout.address) needs the "
                                  f"shared token for weight pushes; set rollout.token_file or ${TOKEN_ENV}")
    except ValueError as e:
        raise ConfigError(str(e)) from None


class _Progress:
    """tqdm bar with reward / LR / mismatch; validation results printed as their own lines."""

    def __init__(self, c: ml_collections.ConfigDict, start: int) -> None:
        self.bar = None
        if c.log.progress and jax.process_index() == 0:
            from tqdm import tqdm

            self.bar = tqdm(total=c.steps, initial=start, desc="rl", unit="step", dynamic_ncols=True)

    def update(self, m: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({"reward": f"{m.get('reward/mean', float('nan')):.3f}", "lr": f"{m.get('lr', float('nan')):.2e}",
                                  "log_ppl_abs_diff": f"{m.get('mismatch/log_ppl_abs_diff', float('nan')):.1e}"},
                                 refresh=False)

    def note(self, step: int, val: dict[str, float]) -> None:
        if jax.process_index() != 0 or not val:
            return
        where = "before training" if step < 0 else f"after step {step}"
        line = f"validation {where}: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(val.items()))
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
