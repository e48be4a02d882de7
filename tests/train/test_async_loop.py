"""Asynchronous rollouts (train/rollout_producer.py) through the real loop and a real rollout-server subprocess:
bounded lags, the staleness/precision split in exact mode, the first step equal to the synchronous loop's,
dynamic sampling with a server killed mid-run, and kill -9 of the trainer followed by a resume.

The policy moves through an entropy bonus (the tiny warm start rarely earns a reward, so advantages are
mostly 0): enough for π at version v to differ from π at v − 2.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxrl_mismatch.runlog import read_jsonl
from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_checks import check_paths, validate
from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base_model(tiny_base_model) -> Path:
    """The session's shared tiny warm start (tests/conftest.py): the same arguments this file used to train."""
    return tiny_base_model


def config(model: Path, run_dir: Path, **rollout):
    c = base_config()
    c.run_dir = str(run_dir)
    c.steps = 4
    c.model.path = str(model)
    c.task.num_train = 200
    c.task.num_val = 4
    c.rollout.group_size = 4
    c.rollout.max_tokens = 16
    c.rollout.update(rollout)
    c.batch.prompts_per_step = 4
    c.batch.max_oversample_rounds = 1
    c.trainer.chunk_size = 16
    c.optim.lr = 3e-3
    c.objective.entropy_coef = 0.05
    c.eval.every = 0
    c.eval.k = 1
    c.eval.greedy = False
    c.checkpoint.every = 0
    c.log.progress = False
    c.log.tensorboard = False
    c.log.report = False
    return c


def checked(c):
    """`c` validated as `jobs/train.py` validates it before building a `Trainer` (which takes it as it is)."""
    validate(c)
    check_paths(c)
    return c


def _run(c) -> list[dict]:
    from jaxrl_mismatch.train.loop import Trainer

    t = Trainer(checked(c))
    try:
        t.run()
    finally:
        t.close()
    return [r for r in read_jsonl(os.path.join(c.run_dir, "metrics.jsonl")) if r["step"] >= 0]


SPLIT = ("staleness/precision_kl_k1", "staleness/precision_kl_k3", "staleness/precision_rho_std")


@pytest.mark.slow
@pytest.mark.xla_full_opt  # exact mode's zero mismatch is a bit-for-bit claim about the programs users compile
def test_exact_mode_staleness_is_all_that_remains_and_step_0_is_the_synchronous_one(base_model, tmp_path):
    sync = _run(config(base_model, tmp_path / "sync", exact=True))
    stale = _run(config(base_model, tmp_path / "stale", exact=True, max_staleness=2, fixed_staleness=True))
    for r in sync:  # exact, synchronous: nothing to split
        assert all(v == 0 for k, v in r.items() if k.startswith("staleness/")), r
        assert r["mismatch/kl_k3"] == 0 and r["mismatch/rho_std"] == 0
    assert [r["staleness/version_lag_max"] for r in stale] == [0, 1, 2, 2]  # fixed: exactly s after warm-up
    assert [r["rollout/batch_index"] for r in stale] == [0, 1, 2, 3] and stale[-1]["rollout/dropped_batches"] == 0
    for r in stale[1:]:
        assert all(r[k] == 0 for k in SPLIT), r  # the exact engine = the trainer at the sample's version
        assert r["staleness/kl_k3"] > 0 and r["staleness/rho_std"] > 0
        assert r["mismatch/kl_k1"] == pytest.approx(r["staleness/kl_k1"], abs=1e-6)  # all of it is staleness
    # The producer made step 0's batch with step 0's seeds and prompts from version 1, as the loop does.
    same = [k for k in sync[0] if k.startswith(("reward/", "mismatch/", "loss/", "grad/", "length/"))]
    assert same and {k: stale[0][k] for k in same} == {k: sync[0][k] for k in same}


def test_bad_staleness_names_the_field(base_model, tmp_path):
    c = config(base_model, tmp_path / "x", max_staleness=-1)
    with pytest.raises(ConfigError, match=r"config\.rollout\.max_staleness"):
        validate(c)


@pytest.mark.slow
def test_dynamic_sampling_and_a_server_killed_mid_run(base_model, tmp_path):
    from jaxrl_mismatch.train.loop import Trainer

    c = config(base_model, tmp_path / "run", max_staleness=1)
    c.steps = 5
    c.batch.dynamic_sampling = True
    t = Trainer(checked(c))
    killed = threading.Event()

    def kill_after_step_1():
        while t.step < 2:
            time.sleep(0.05)
        os.killpg(t.session.server.proc.pid, signal.SIGKILL)
        killed.set()

    threading.Thread(target=kill_after_step_1, daemon=True).start()
    try:
        t.run()
        restarts = t.session.restarts
    finally:
        t.close()
    rows = [r for r in read_jsonl(os.path.join(c.run_dir, "metrics.jsonl")) if r["step"] >= 0]
    assert killed.is_set() and restarts >= 1 and len(rows) == 5
    assert all(r["staleness/version_lag_max"] <= 1 for r in rows)
    assert max(r["filter/rounds"] for r in rows) >= 1
    _check_no_prompt_used_twice(rows, c.batch.prompts_per_step)


def _check_no_prompt_used_twice(rows: list[dict], prompts_per_step: int) -> None:
    """Each step's batch starts where the previous one's prompts (prompts × rounds) end, or later."""
    for a, b in zip(rows, rows[1:]):
        assert b["rollout/prompt_position"] >= a["rollout/prompt_position"] + prompts_per_step * a["filter/rounds"]


@pytest.mark.slow
def test_kill_9_of_the_trainer_resumes_without_reusing_a_sample(base_model, tmp_path):
    run_dir = tmp_path / "run"
    c = config(base_model, run_dir, max_staleness=2)
    c.steps = 6
    c.checkpoint.every = 1
    cfg = _config_file(tmp_path / "cfg.py", c)
    env = child_env()
    cmd = [sys.executable, "-m", "jaxrl_mismatch.cli", "train", "--config", str(cfg)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = run_dir / "metrics.jsonl"
    # Kill only once 3 steps are logged (checkpoints every step): killed earlier, the rerun would start over and
    # the test would say nothing about resuming. The wait is generous because on a loaded 2-core machine the
    # first step (start-up, compilation) has taken minutes.
    deadline, done = time.time() + 900, 0
    while time.time() < deadline and proc.poll() is None:
        done = sum(1 for r in read_jsonl(str(metrics)) if r["step"] >= 0) if metrics.exists() else 0
        if done >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
    if done < 3:
        proc.kill()
        proc.wait()
        _stop_orphan_server(run_dir)
        pytest.fail(f"the trainer logged {done} steps in 900 s: too slow to test a kill after step 2")
    proc.send_signal(signal.SIGKILL)  # batches are in flight: the producer runs up to 2 ahead
    proc.wait()
    _stop_orphan_server(run_dir)
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = re.search(r"finished steps (\d+) → 6", out.stdout)
    assert resumed and int(resumed.group(1)) >= 2, out.stdout[-2000:]  # resumed, did not start over
    rows = [r for r in read_jsonl(str(metrics)) if r["step"] >= 0]
    assert [r["step"] for r in rows] == list(range(6))
    assert all(r["staleness/version_lag_max"] <= 2 for r in rows)
    _check_no_prompt_used_twice(rows, c.batch.prompts_per_step)


def _config_file(path: Path, c) -> Path:
    """A config file whose get_config() rebuilds `c` (every field that differs from base_config)."""
    from jaxrl_mismatch.train.config import flatten

    base = flatten(base_config())
    lines = ["from jaxrl_mismatch.train.config import base_config", "", "def get_config():", "    c = base_config()"]
    lines += [f"    c.{k} = {v!r}" for k, v in flatten(c).items() if base.get(k) != v]
    path.write_text("\n".join(lines + ["    return c", ""]))
    return path


def _stop_orphan_server(run_dir: Path) -> None:
    """The managed server runs in its own session and outlives a SIGKILLed trainer: stop the one it started."""
    import json

    ready = run_dir / "rollout_ready.json"
    if ready.exists():
        pid = json.loads(ready.read_text())["pid"]
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_external_server_lost_mid_async_run_checkpoints_and_the_rerun_finishes(base_model, tmp_path):
    """An external server that dies while batches are in flight: the producer's failure reaches the trainer,
    which checkpoints the last finished step; with the server back the same config finishes the run."""
    from jaxrl_mismatch.rollout.launcher import ManagedServer
    from jaxrl_mismatch.train.loop import RolloutFailure, Trainer

    server = ManagedServer(str(tmp_path / "srv"), engine="jax", model=str(base_model), dtype="float32")
    server.start()
    run_dir = tmp_path / "run"
    c = config(base_model, run_dir, max_staleness=2, address=server.address, token_file=server.token_file)
    c.steps = 5
    c.rollout.retry_s = 1.0
    t = Trainer(checked(c))

    def kill_after_step_1():
        while t.step < 2:
            time.sleep(0.05)
        server.stop(grace_s=0)

    threading.Thread(target=kill_after_step_1, daemon=True).start()
    try:
        with pytest.raises(RolloutFailure, match=r"resumable checkpoint of step (\d+)") as err:
            t.run()
    finally:
        t.close()
    done = int(re.search(r"checkpoint of step (\d+)", str(err.value)).group(1))
    assert 2 <= done < 5
    server.start()
    try:
        rows = _run(c)
    finally:
        server.stop()
    assert [r["step"] for r in rows] == list(range(5))
    assert all(r["staleness/version_lag_max"] <= 2 for r in rows)
    _check_no_prompt_used_twice(rows, c.batch.prompts_per_step)


@pytest.mark.slow
@pytest.mark.xla_full_opt  # exact mode's zero precision mismatch before the onset is a bit-for-bit claim
def test_a_dropped_batch_is_replaced_and_its_replacement_logs_the_scale_it_was_sampled_with(base_model, tmp_path,
                                                                                              monkeypatch):
    """A second writer pushes to the server just before the trainer's push of step 2 (the version jumps by
    2): batch 2, made from step 1's weights, is then 2 versions behind and dropped; step 2 trains on batch 3.
    With an int8 onset at 3 in exact mode, batch 3 is quantized and batch 2 would not have been: the logged
    `rollout/mismatch_scale` and the precision part of the mismatch must both be batch 3's."""
    from jaxrl_mismatch.train.loop import Trainer

    c = config(base_model, tmp_path / "run", max_staleness=1, fixed_staleness=True, exact=True, quantize="int8",
               mismatch_onset_step=3)
    from jaxrl_mismatch.train.rollout_producer import LockedSession

    t = Trainer(c)
    push = LockedSession.push

    def push_after_another_writer(session, weights):
        if t.step == 2:
            push(session, weights)  # the other writer's push lands first
        return push(session, weights)

    monkeypatch.setattr(LockedSession, "push", push_after_another_writer)
    try:
        t.run()
    finally:
        t.close()
    rows = [r for r in read_jsonl(os.path.join(c.run_dir, "metrics.jsonl")) if r["step"] >= 0]
    assert [r["rollout/batch_index"] for r in rows] == [0, 1, 3, 4]
    assert [r["rollout/dropped_batches"] for r in rows] == [0, 0, 1, 1]
    assert [r["rollout/mismatch_scale"] for r in rows] == [0.0, 0.0, 1.0, 1.0]
    assert rows[1]["staleness/precision_rho_std"] == 0 and rows[2]["staleness/precision_rho_std"] > 0
    assert all(r["staleness/version_lag_max"] <= 1 for r in rows)
    # A resume continues the batch indices after the drop (seeds, onset) and its count: it restarted them at the
    # step (index 4 again for step 4) and the count at 0.
    c.steps = 6
    t = Trainer(c)
    try:
        t.run()
    finally:
        t.close()
    rows = [r for r in read_jsonl(os.path.join(c.run_dir, "metrics.jsonl")) if r["step"] >= 4]
    assert [r["rollout/batch_index"] for r in rows] == [5, 6]
    assert [r["rollout/dropped_batches"] for r in rows] == [1, 1]
