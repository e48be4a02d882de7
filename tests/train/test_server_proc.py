"""The trainer-managed rollout server never outlives the trainer, even one killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.rollout.conftest import make_tiny_qwen3


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); treat it as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.slow
def test_managed_server_exits_when_the_trainer_is_killed(tmp_path):
    model = make_tiny_qwen3(tmp_path / "model", tied=False)
    code = (
        "import sys, time\n"
        "from jaxrl_mismatch.train.server_proc import ManagedServer\n"
        f"s = ManagedServer(engine='jax', model_dir={str(model)!r}, dtype='float32', work_dir={str(tmp_path / 'w')!r})\n"
        "s.start()\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(trainer.stdout.readline())
        assert _alive(server_pid)
        trainer.send_signal(signal.SIGKILL)  # no chance to stop the server itself
        trainer.wait(timeout=10)
        deadline = time.monotonic() + 30
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server_pid), "the rollout server outlived its trainer"
        assert "parent process" in (tmp_path / "w" / "rollout_server.log").read_text()
    finally:
        trainer.kill()
        try:
            os.kill(server_pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass
