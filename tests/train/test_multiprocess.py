"""Multi-process training, run for real on one machine: 2 processes x 4 CPU devices against 1 x 8, same mesh.

Both runs go through the launcher's local mode (`LOCAL_PROCESSES=N launch/slurm_gpu.sh`), i.e. the path a
SLURM job takes: `jax.distributed.initialize` with a coordinator, gloo CPU collectives, process 0 talking to
the rollout server and broadcasting the batch, every process placing its shards (2 packed minibatches,
gathered from the prepared batch on the device), orbax writing one checkpoint from both processes. The update, `prepare`'s diagnostics and every logged metric must match to float
tolerance, as must the final parameters and optimizer state; a checkpoint written by the 2 processes resumes
in 1 process, and one written by 1 process resumes in 2, to the same next step.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_mismatch.runlog import read_jsonl
from tests.child_env import child_env

from .test_loop_integration import REPO, _config_file, checkpoint_leaves, tiny_config

MESH = "--config.trainer.mesh.data=4", "--config.trainer.mesh.fsdp=2"


@pytest.fixture(scope="module")
def config_file(tiny_base_model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mp")
    # The session's shared warm start (tests/conftest.py: hidden 32, 2 heads, 40 steps, the arguments this file's
    # own warm start used), read only: built once per test session instead of once more here.
    c = tiny_config(tiny_base_model, root / "unused")
    c.steps = 2
    # Two minibatches, packed: each is gathered on the device from the batch sharded over both processes.
    c.batch.minibatches = 2
    c.trainer.packing = True
    c.eval.every = 1
    c.checkpoint.every = 1
    return _config_file(root / "config.py", c)


def _launch(config: Path, run_dir: Path, processes: int, devices: int, *extra: str) -> subprocess.CompletedProcess:
    env = child_env(LOCAL_PROCESSES=str(processes), LOCAL_DEVICES=str(devices), PYTHON=sys.executable,
                    PYTHONPATH=str(REPO))
    cmd = ["bash", "launch/slurm_gpu.sh", str(config), f"--config.run_dir={run_dir}", *MESH, *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0]


def _same_state(a: Path, b: Path, step: int) -> None:
    import numpy as np

    sa, sb = checkpoint_leaves(a, step), checkpoint_leaves(b, step)
    assert sa.keys() == sb.keys() and any("params" in k for k in sa)
    for k in sa:
        np.testing.assert_allclose(np.asarray(sa[k], np.float64), np.asarray(sb[k], np.float64), rtol=2e-4, atol=2e-6,
                                   err_msg=k)


def _close(a: dict, b: dict, step: int) -> None:
    keys = {k for k in a if not k.startswith("time/") and isinstance(a[k], (int, float))}
    assert keys == {k for k in b if not k.startswith("time/") and isinstance(b[k], (int, float))}
    for k in sorted(keys):
        if isinstance(a[k], float) and math.isnan(a[k]):
            assert math.isnan(b[k]), (step, k)
        else:
            assert a[k] == pytest.approx(b[k], rel=2e-4, abs=2e-6), (step, k, a[k], b[k])


@pytest.mark.slow
def test_two_processes_train_like_one_and_checkpoints_move_between_them(config_file, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    out = _launch(config_file, two, 2, 4)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for i in (0, 1):
        assert f"train: process {i} of 2, 4 of 8 devices" in out.stdout
    # The reference: one process, every step (its checkpoints 1-4 are the states after each step).
    out = _launch(config_file, one, 1, 8, "--config.steps=4")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    a, b = _records(two), _records(one)
    assert [r["step"] for r in a] == [0, 1] and [r["step"] for r in b] == [0, 1, 2, 3]
    assert "grad/norm" in a[0] and "reward/mean" in a[0]
    for ra, rb in zip(a, b):
        _close(ra, rb, ra["step"])
    # The 2-process checkpoint of step 2, resumed by one process, takes the step the 1-process run took.
    out = _launch(config_file, two, 1, 8, "--config.steps=3")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    a = _records(two)
    assert [r["step"] for r in a] == [0, 1, 2]
    _close(a[2], b[2], 2)
    _same_state(two, one, 3)  # same parameters and optimizer state
    # The reverse: that 1-process checkpoint of step 3, resumed by 2 processes, takes the reference's step too.
    out = _launch(config_file, two, 2, 4, "--config.steps=4")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    a = _records(two)
    assert [r["step"] for r in a] == [0, 1, 2, 3]
    _close(a[3], b[3], 3)
    _same_state(two, one, 4)


def test_local_mode_rejects_bad_process_counts(tmp_path):
    for name, bad in (("LOCAL_PROCESSES", "0"), ("LOCAL_PROCESSES", "two"), ("LOCAL_DEVICES", "-1")):
        env = {**os.environ, "LOCAL_PROCESSES": "2", "PYTHON": sys.executable, name: bad}
        out = subprocess.run(["bash", "launch/slurm_gpu.sh", str(tmp_path / "config.py")], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stderr.strip() == f"error: {name} must be a positive integer, got '{bad}'"
