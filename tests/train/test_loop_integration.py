"""The real RL loop against a real rollout-server subprocess: a few tiny steps, resume, server death.

The base policy is made by the real warm start (a few SFT steps on the arithmetic task), so tokenizer,
checkpoint format and task spec are exactly what the demo uses.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_checks import check_paths, validate
from jaxrl_mismatch.runlog import read_jsonl
from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base_model(tiny_base_model) -> Path:
    return tiny_base_model


def tiny_config(model: Path, run_dir: Path, **rollout):
    c = base_config()
    c.run_dir = str(run_dir)
    c.steps = 3
    c.model.path = str(model)
    c.task.num_train = 200
    c.task.num_val = 8
    c.rollout.group_size = 4
    c.rollout.max_tokens = 24
    c.rollout.update(rollout)
    c.batch.prompts_per_step = 4
    c.batch.max_oversample_rounds = 1
    c.trainer.chunk_size = 16
    c.optim.lr = 1e-3
    c.controller.name = "length_triggered_decay"
    c.controller.kwargs.baseline_window = 2
    c.controller.kwargs.window = 3
    c.eval.every = 2
    c.eval.k = 2
    c.checkpoint.every = 2
    c.log.progress = False
    c.log.tensorboard = False
    c.log.report = False
    return c


def checked(c):
    """`c` validated as `jobs/train.py` validates it before building a `Trainer` (which takes it as it is)."""
    validate(c)
    check_paths(c)
    return c


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _run(c, accept_config_changes: bool = False) -> dict:
    from jaxrl_mismatch.train.loop import Trainer

    t = Trainer(checked(c), accept_config_changes=accept_config_changes)
    try:
        return t.run()
    finally:
        t.close()


@pytest.mark.slow
def test_loop_runs_checkpoints_and_resumes(base_model, tmp_path, monkeypatch):
    from jaxrl_mismatch.train.loop import Trainer

    # Validation "after step N" is of step N's update: the server serves the weights pushed after it (it used to
    # serve those pushed before, so the final validation was not of the policy saved and exported).
    evaluate, seen = Trainer._evaluate, []
    monkeypatch.setattr(Trainer, "_evaluate", lambda self: seen.append((self.step, self._pushed_step)) or evaluate(self))
    run_dir = tmp_path / "run"
    summary = _run(tiny_config(base_model, run_dir))
    assert (summary["start_step"], summary["end_step"]) == (0, 3)
    assert seen == [(0, 0), (2, 2), (3, 3)]  # (steps applied, step whose weights the server serves)
    recs = read_jsonl(str(run_dir / "metrics.jsonl"))
    steps = [r for r in recs if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        for key in ("reward/mean", "mismatch/log_ppl_abs_diff", "mismatch/rho_std", "grad/norm", "length/mean",
                    "loss/total", "lr"):
            assert _finite(r[key]), (key, r[key])
        # fp32 engine vs fp32 trainer: the mismatch is rounding-level, never zero-by-construction.
        assert r["mismatch/log_ppl_abs_diff"] < 1e-3
    # The controller watched every step: baseline = the lowest 2-step moving mean, window = the last 3.
    lengths = [r["length/mean"] for r in steps]
    assert steps[-1]["controller/baseline"] == pytest.approx(
        min((lengths[0] + lengths[1]) / 2, (lengths[1] + lengths[2]) / 2), rel=1e-5)
    assert steps[-1]["controller/windowed_mean"] == pytest.approx(sum(lengths) / 3, rel=1e-5)
    # Each step samples with the weights it pushed at its start: version 1 is the initial policy.
    assert [r["rollout/weight_version"] for r in steps] == [1.0, 2.0, 3.0]
    assert "val/accuracy" in recs[0] and "val/accuracy" in steps[1] and "val/accuracy" in steps[2]
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [2, 3]

    # Resume: the same config with more steps continues from the step-3 checkpoint.
    c = tiny_config(base_model, run_dir)
    c.steps = 5
    summary = _run(c)
    assert (summary["start_step"], summary["end_step"]) == (3, 5)
    recs = read_jsonl(str(run_dir / "metrics.jsonl"))
    steps = [r for r in recs if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4]
    # The restored controller's window spans the resume: step 3 averages the lengths of steps 1-3.
    assert steps[3]["controller/windowed_mean"] == pytest.approx(
        sum(r["length/mean"] for r in steps[1:4]) / 3, rel=1e-5)
    # Versions keep increasing after the resume push (the new managed server began at version 0).
    versions = [r["rollout/weight_version"] for r in steps]
    assert versions == sorted(versions) and len(set(versions)) == 5
    from jaxrl_mismatch.train.checkpoint import Checkpointer

    ckpt = Checkpointer(str(run_dir / "checkpoints"))
    try:
        meta = ckpt.read_meta(5)
    finally:
        ckpt.close()
    # the final validation's push (of step 4's update) is the version the checkpoint continues from
    assert meta["step"] == 5 and meta["weight_version"] == versions[-1] + 1
    assert meta["controller"]["state"]["num_observed"] == 5
    assert meta["model_dir"] == os.path.abspath(base_model)  # where `export` finds the base from any directory
    # and what the weights compute with, which `export --base` is checked against
    from jaxrl_mismatch.models.config import ModelConfig

    assert meta["model_config"]["rope_theta"] == ModelConfig.from_hf(str(base_model)).rope_theta


@pytest.mark.slow
def test_a_controller_metric_that_no_step_logs_is_a_config_error(base_model, tmp_path):
    """A typo in `controller.kwargs.metric` passed validation and ended the run after step 0 with a KeyError
    (exit 1); it is now one line naming the field and the nearest metric name."""
    from jaxrl_mismatch.train.config import ConfigError

    c = tiny_config(base_model, tmp_path / "run")
    c.steps, c.eval.every = 1, 0
    c.controller.name, c.controller.kwargs = "metric_triggered", {"metric": "mismatch/log_ppl_abs_dif",
                                                                    "threshold": 1.0}
    with pytest.raises(ConfigError, match=r"config.controller.kwargs.metric: 'mismatch/log_ppl_abs_dif' is not a "
                                          r"metric of a training step; did you mean 'mismatch/log_ppl_abs_diff'\?"):
        _run(c)


@pytest.mark.slow
def test_a_controller_changed_at_resume_starts_afresh_at_scale_one(base_model, tmp_path, caplog):
    """With --accept-config-changes, turning the controller off kept the old multiplier in the optimizer state for
    the rest of the run, and another controller's kwargs ended the resume with exit 1."""

    run_dir = tmp_path / "run"
    c = tiny_config(base_model, run_dir)
    c.steps, c.eval.every = 2, 0
    c.controller.name, c.controller.kwargs = "metric_triggered", {"metric": "length/mean", "threshold": 0.0}
    _run(c)  # alarms at step 0: half the LR from step 1 on
    assert [r["lr"] for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0] == pytest.approx([1e-3, 5e-4])
    # Only the text changes (a default written out): the same controller, so its state and the cut continue (it
    # had been reset to 1.0 and the alarm fired again: LR 1e-3 at step 2).
    c = tiny_config(base_model, run_dir)
    c.steps, c.eval.every = 3, 0
    c.controller.name = "metric_triggered"
    c.controller.kwargs = {"metric": "length/mean", "threshold": 0.0, "factor": 0.5}
    _run(c, accept_config_changes=True)
    last = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0][-1]
    assert last["step"] == 2 and last["lr"] == pytest.approx(5e-4) and last["controller/scale"] == 0.5
    # The same config, but the checkpoint's controller state is in a format this code cannot continue (the old
    # alarm rule's, format 1): it ended the resume with a traceback; now the controller starts afresh at 1.0.
    metas = [m for m in (run_dir / "checkpoints" / "3").rglob("*") if m.is_file() and m.suffix in ("", ".json")]
    patched = 0
    for m in metas:
        try:
            meta = json.loads(m.read_text())
        except (UnicodeDecodeError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("controller"), dict):
            meta["controller"].pop("format")
            m.write_text(json.dumps(meta))
            patched += 1
    assert patched == 1
    c.steps = 4
    with caplog.at_level(logging.WARNING):
        _run(c)
    assert "the checkpoint's controller state cannot continue (metric_triggered state was saved by the old" in caplog.text
    last = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0][-1]
    assert last["step"] == 3 and last["lr"] == pytest.approx(1e-3)  # afresh: multiplier 1.0, the alarm re-arms
    for name, kwargs in (("metric_triggered", {"metric": "length/mean", "threshold": 1e9}), ("none", {})):
        c = tiny_config(base_model, run_dir)
        c.steps, c.eval.every = 5 if name != "none" else 6, 0
        c.controller.name, c.controller.kwargs = name, kwargs
        _run(c, accept_config_changes=True)
        last = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0][-1]
        assert last["lr"] == pytest.approx(1e-3), (name, last)  # the configured LR, never cut by the new controller


@pytest.mark.slow
def test_server_killed_mid_run_is_restarted_and_training_goes_on(base_model, tmp_path):
    from jaxrl_mismatch.train.loop import Trainer

    t = Trainer(checked(tiny_config(base_model, tmp_path / "run")))
    try:
        t.session = t._open_session()
        m1 = t.train_step()
        server = t.session.server
        os.killpg(server.proc.pid, 9)
        server.proc.wait(timeout=10)
        m2 = t.train_step()  # the push fails, the server is restarted on the same port, weights pushed
        assert server.starts == 2 and server.alive()
        assert t.session.restarts >= 1
        assert (m1["rollout/weight_version"], m2["rollout/weight_version"]) == (1.0, 2.0)
        assert t.session.info().weight_version == 2
        assert _finite(m2["reward/mean"]) and _finite(m2["grad/norm"])
    finally:
        t.close()


def test_bad_config_names_the_field(base_model, tmp_path):
    c = tiny_config(base_model, tmp_path / "run")
    c.rollout.engine = "sglang"
    with pytest.raises(ConfigError, match=r"config\.rollout\.engine"):
        validate(c)
    c = tiny_config(base_model, tmp_path / "run")
    c.batch.minibatches = 3  # 16 rows do not split into 3 minibatches
    with pytest.raises(ConfigError, match=r"config\.batch"):
        validate(c)
    c = tiny_config(base_model, tmp_path / "run")
    c.objective.overrides.correction = "token_tiss"
    with pytest.raises(ConfigError, match=r"config\.objective.*token_tiss"):
        validate(c)


@pytest.mark.slow
def test_cli_rejects_bad_config_before_any_work(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "jaxrl_mismatch.cli", "train", "--config", str(REPO / "configs" / "tiny_cpu.py"),
         f"--config.run_dir={tmp_path / 'run'}", "--config.rollout.group_size=0"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert out.returncode == 2
    assert "config.rollout.group_size" in out.stderr
    assert not (tmp_path / "run").exists()  # nothing was started or written


@pytest.mark.vllm
def test_loop_runs_with_the_vllm_engine(tiny_base_model_h64, tmp_path):
    # vLLM's CPU attention needs head_dim >= 32: the session's hidden-64, 2-head warm start (tests/conftest.py).
    model = tiny_base_model_h64
    c = tiny_config(model, tmp_path / "run", engine="vllm")
    c.steps = 2
    summary = _run(c)
    assert summary["end_step"] == 2
    steps = [r for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl")) if r["step"] >= 0]
    assert len(steps) == 2
    for r in steps:
        assert _finite(r["reward/mean"]) and _finite(r["grad/norm"])
        # vLLM fp32 vs our fp32 trainer: measured ≲1e-5 per token (docs/rollout.md).
        assert r["mismatch/log_ppl_abs_diff"] < 1e-3
    assert [r["rollout/weight_version"] for r in steps] == [1.0, 2.0]


@pytest.mark.slow
def test_perfectible_keeps_prompts_in_the_accuracy_band(base_model, tmp_path):
    """A real policy behind a real server: the [lo, hi] run keeps exactly the prompts whose accuracy in the
    unfiltered run (same seeds, so the same samples) lies in the band."""
    from jaxrl_mismatch.jobs.perfectible import main as perfectible

    read_records = read_jsonl

    common = ["--model", str(base_model), "--num", "12", "--k", "4", "--max-tokens", "24", "--temperature", "1.5"]
    assert perfectible([*common, "--lo", "0", "--hi", "1", "--out", str(tmp_path / "all.jsonl")]) == 0
    everything = read_records(str(tmp_path / "all.jsonl"))
    assert len(everything) == 12
    assert all(r["initial_accuracy"] * 4 == int(r["initial_accuracy"] * 4) for r in everything)
    assert perfectible([*common, "--lo", "0.25", "--hi", "0.75", "--out", str(tmp_path / "band.jsonl")]) == 0
    band = read_records(str(tmp_path / "band.jsonl"))
    expected = [r["prompt_text"] for r in everything if 0.25 <= r["initial_accuracy"] <= 0.75]
    assert [r["prompt_text"] for r in band] == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.jsonl", "band.jsonl"]  # its servers' folders gone


@pytest.mark.slow
def test_external_server_lost_stops_with_resumable_checkpoint_and_resume_finishes(base_model, tmp_path):
    """An external server that dies and stays down: the run checkpoints the last finished step, raises a
    message that says how to resume, and a rerun (server back) continues without losing a step."""
    import threading
    import time

    from jaxrl_mismatch.train.loop import RolloutFailure, Trainer
    from jaxrl_mismatch.rollout.launcher import ManagedServer

    server = ManagedServer(str(tmp_path / "srv"), engine="jax", model=str(base_model), dtype="float32")
    server.start()
    run_dir = tmp_path / "run"
    c = tiny_config(base_model, run_dir, address=server.address, token_file=server.token_file)
    c.steps = 4
    c.checkpoint.every = 100  # only the failure path and the end write checkpoints
    c.rollout.retry_s = 0.5  # the default 10 s budget would find the server as dead, later

    def kill_after_first_step():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if (run_dir / "metrics.jsonl").exists() and any(r["step"] >= 0 for r in read_jsonl(str(run_dir / "metrics.jsonl"))):
                server.stop(grace_s=0)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    t = Trainer(checked(c))
    try:
        with pytest.raises(RolloutFailure, match=r"resumable checkpoint of step (\d+).*rerun the same command") as err:
            t.run()
    finally:
        t.close()
    killer.join(timeout=10)
    done = int(__import__("re").search(r"checkpoint of step (\d+)", str(err.value)).group(1))
    assert done >= 1
    # rollout.retry_s bounds the failing call's retries (the default 10 s makes 7 or 8 attempts). A call in
    # flight when the server dies can also end in one attempt with another code (CI saw one such run).
    retried = __import__("re").search(r"(UNAVAILABLE|DEADLINE_EXCEEDED) after (\d+) attempts", str(err.value))
    assert retried is None or int(retried.group(2)) <= 4, str(err.value)
    steps_logged = [r["step"] for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0]
    assert steps_logged == list(range(done))  # every finished step was logged and checkpointed

    server.start()  # the operator brings the server back (same port), then reruns the same command
    try:
        summary = _run(c)
    finally:
        server.stop()
    assert (summary["start_step"], summary["end_step"]) == (done, 4)
    steps_logged = [r["step"] for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0]
    assert steps_logged == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_rollout_failure_in_the_final_validation_is_validated_at_the_resume(base_model, tmp_path, monkeypatch):
    """A rollout failure during the validation after step N (here the last) checkpointed step N with its record
    but no validation, and the rerun, with no step left to do, ended without validating at all: the run's final
    accuracy was never measured. The checkpoint now says the validation is pending; the rerun does it first and
    adds it to step N's record (still one record per step)."""
    from jaxrl_mismatch.rollout.client import RolloutError
    from jaxrl_mismatch.train.checkpoint import Checkpointer
    from jaxrl_mismatch.train.loop import RolloutFailure, Trainer

    run_dir = tmp_path / "run"
    c = tiny_config(base_model, run_dir)
    c.steps, c.eval.every = 2, 0  # validation at the start and after the last step only
    real, calls = Trainer._evaluate_on_lead, []

    def failing_at_the_end(self):
        calls.append(self.step)
        if self.step == c.steps and calls.count(c.steps) == 1:
            raise RolloutError("rollout server lost during validation (test)")
        return real(self)

    monkeypatch.setattr(Trainer, "_evaluate_on_lead", failing_at_the_end)
    with pytest.raises(RolloutFailure, match=r"resumable checkpoint of step 2"):
        _run(c)
    rows = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0]
    assert [r["step"] for r in rows] == [0, 1] and "val/accuracy" not in rows[1]  # the step's record is kept
    ckpt = Checkpointer(str(run_dir / "checkpoints"))
    try:
        assert ckpt.latest_step() == 2 and ckpt.read_meta(2)["eval_pending"] is True
    finally:
        ckpt.close()
    summary = _run(c)  # the rerun: nothing left to train, the validation still to do
    assert (summary["start_step"], summary["end_step"]) == (2, 2) and calls == [0, 2, 2]
    assert _finite(summary["final"]["val/accuracy"])
    rows = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0]
    assert [r["step"] for r in rows] == [0, 1]  # amended in place, not a second record of step 1
    assert rows[1]["val/accuracy"] == summary["final"]["val/accuracy"] and _finite(rows[1]["loss/total"])


@pytest.mark.slow
def test_rollout_temperature_is_matched_by_the_trainer(base_model, tmp_path):
    """At T = 0.7 the engine's μ is softmax(logits / 0.7); the trainer scores π the same way, so the
    measured mismatch stays at float32 rounding (scoring at T = 1 would put it near 0.1 nats)."""
    from jaxrl_mismatch.train.loop import Trainer

    t = Trainer(checked(tiny_config(base_model, tmp_path / "run", temperature=0.7)))
    try:
        t.session = t._open_session()
        m = t.train_step()
    finally:
        t.close()
    assert m["mismatch/log_ppl_abs_diff"] < 1e-4, m["mismatch/log_ppl_abs_diff"]


@pytest.mark.slow
def test_stop_request_checkpoints_between_steps_and_resume_refuses_to_overwrite(base_model, tmp_path):
    import threading
    import time

    from jaxrl_mismatch.train.loop import Trainer

    run_dir = tmp_path / "run"
    c = tiny_config(base_model, run_dir)
    c.steps = 50
    c.checkpoint.every = 100
    t = Trainer(checked(c))

    def stop_after_first_step():  # what run.py's SIGTERM handler does
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not t.stop_requested:
            if (run_dir / "metrics.jsonl").exists() and any(r["step"] >= 0 for r in read_jsonl(str(run_dir / "metrics.jsonl"))):
                t.stop_requested = True
            time.sleep(0.05)

    threading.Thread(target=stop_after_first_step, daemon=True).start()
    try:
        summary = t.run()
    finally:
        t.close()
    assert summary["stopped_early"] and 1 <= summary["end_step"] < 50
    from jaxrl_mismatch.train.checkpoint import Checkpointer

    ckpt = Checkpointer(str(run_dir / "checkpoints"))
    try:
        assert ckpt.latest_step() == summary["end_step"]
    finally:
        ckpt.close()
    c.resume = False
    t = Trainer(checked(c))
    try:
        with pytest.raises(ValueError, match="config.resume: False"):
            t.run()
    finally:
        t.close()


def _config_file(path: Path, c) -> Path:
    """A config file whose get_config() rebuilds `c` (every field that differs from base_config)."""
    from jaxrl_mismatch.train.config import flatten

    base = flatten(base_config())
    lines = ["from jaxrl_mismatch.train.config import base_config", "", "def get_config():", "    c = base_config()"]
    for key, value in flatten(c).items():
        if base.get(key) != value:
            lines.append(f"    c.{key} = {value!r}")
    path.write_text("\n".join(lines + ["    return c", ""]))
    return path


def checkpoint_leaves(run_dir: Path, step: int) -> dict[str, object]:
    """Every leaf (parameters, optimizer state, loss scale) of checkpoint `step`, as host arrays by path."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    path = run_dir / "checkpoints" / str(step) / "state"
    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(path)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    out = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(out)[0]}


@pytest.mark.slow
def test_resume_with_changed_config_is_refused_unless_accepted(base_model, tmp_path):
    run_dir = tmp_path / "run"
    c = tiny_config(base_model, run_dir)
    c.steps = 1
    _run(c)
    cfg = _config_file(tmp_path / "cfg.py", c)
    env = child_env()
    cmd = [sys.executable, "-m", "jaxrl_mismatch.cli", "train", "--config", str(cfg), "--config.steps=2",
           "--config.optim.lr=0.005", "--config.objective.preset=dapo"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(errors) == 1
    assert "optim.lr: 0.001 → 0.005" in errors[0] and "objective.preset: 'grpo' → 'dapo'" in errors[0]
    assert "--accept-config-changes" in errors[0]
    assert "field(s): steps:" not in errors[0] and "; steps:" not in errors[0]  # steps may change on resume
    # A field that does not change the run (steps, logging) resumes without a word.
    # Accepted, with another precision too: fp32's loss scale (S = 1) is not carried into fp16 (it was: fp16
    # gradients unscaled until S had doubled 15 times, 200 steps apart).
    # A change the checkpoint's state cannot take (another optimizer: other state tensors) is one line, exit 2,
    # naming the checkpoint and the changed field (it was exit 1 and ~23 lines); the checkpoint stays.
    out = subprocess.run([*cmd[:6], "--config.steps=2", "--accept-config-changes", "--config.optim.name=sgd"],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"{run_dir / 'checkpoints' / '1'}: does not fit this run's model and optimizer state" in errors[0]
    assert "(changed since it was written: optim.name)" in errors[0] and "new run_dir" in errors[0]
    assert (run_dir / "checkpoints" / "1").is_dir()
    out = subprocess.run([*cmd[:6], "--config.steps=2", "--accept-config-changes", "--config.optim.lr=0.005",
                          "--config.objective.preset=dapo", "--config.trainer.precision=fp16",
                          "--config.optim.weight_decay=0.5"], capture_output=True, text=True, timeout=600, cwd=REPO,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    # The accepted optimizer change reaches the state the update reads (the checkpoint carried weight_decay 0.01).
    hparams = {k.split("'")[-2]: float(v) for k, v in checkpoint_leaves(run_dir, 2).items() if "'hyperparams'" in k}
    assert hparams["weight_decay"] == pytest.approx(0.5) and hparams["learning_rate"] == pytest.approx(0.005)
    assert "finished steps 1 → 2" in out.stdout
    assert "validation after step 1" in out.stdout + out.stderr  # validation numbers in the progress output
    assert "config.trainer.precision changed since the checkpoint: the loss scale starts afresh at 32768" in out.stderr
    steps = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1] and steps[1]["lr"] == pytest.approx(0.005, rel=1e-6)
    assert steps[0]["loss_scale/scale"] == 1.0 and steps[1]["loss_scale/scale"] >= 2.0**14  # one overflow at most


@pytest.mark.slow
@pytest.mark.xla_full_opt  # exact mode's zero mismatch is a bit-for-bit claim about the programs users compile
def test_exact_mode_run_has_zero_mismatch_and_injected_noise_shows_up(base_model, tmp_path):
    """Through the real server: exact mode gives every mismatch metric exactly 0; σ > 0 gives ρ spread."""
    for name, rollout in (("exact", dict(exact=True)), ("noise", dict(exact=True, logit_noise_std=0.5))):
        c = tiny_config(base_model, tmp_path / name, **rollout)
        c.steps, c.eval.every = 1, 0
        _run(c)
        (r,) = [r for r in read_jsonl(str(tmp_path / name / "metrics.jsonl")) if r["step"] >= 0]
        if name == "exact":
            assert r["mismatch/log_ppl_abs_diff"] == 0.0 and r["mismatch/rho_std"] == 0.0
            assert r["mismatch/kl_k3"] == 0.0 and r["correction/token_truncated_frac"] == 0.0
        else:
            assert r["mismatch/rho_std"] > 0.05 and r["mismatch/log_ppl_abs_diff"] > 0.01


@pytest.mark.slow
def test_perfectible_output_keeps_the_input_format_so_the_training_task_reads_it(base_model, tmp_path):
    """MATH-format input → MATH-format output (the R1 sanity config's `math` task reads it: issue 13)."""
    from jaxrl_mismatch.data import get_task
    from jaxrl_mismatch.jobs.perfectible import main as perfectible

    src = tmp_path / "math_train.jsonl"
    problems = [(f"{a}+{b}*{c}=", a + b * c) for a, b, c in [(1, 2, 3), (4, 5, 6), (7, 8, 9), (2, 2, 2), (3, 1, 4), (9, 9, 1)]]
    src.write_text("".join(json.dumps({"problem": p, "solution": f"so \\boxed{{{v}}}", "level": "1"}) + "\n"
                           for p, v in problems))
    out = tmp_path / "perfectible.jsonl"
    assert perfectible(["--model", str(base_model), "--task", "math", "--file", str(src), "--template", "arithmetic",
                        "--k", "2", "--max-tokens", "24", "--lo", "0", "--hi", "1", "--out", str(out)]) == 0
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert [k["problem"] for k in kept] == [p for p, _ in problems]  # every line, in file order, MATH fields kept
    assert all(k["level"] == "1" and 0.0 <= k["initial_accuracy"] <= 1.0 and k["num_samples"] == 2 for k in kept)
    records = get_task("math").load("train", files={"train": str(out)}, data_dir=str(tmp_path / "tfds"))
    assert [r["answer"] for r in records] == [str(v) for _, v in problems]
