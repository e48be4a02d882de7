"""A rollout server the trainer starts itself: `jaxrl-mismatch serve` as a subprocess on loopback.

The trainer talks to it only over gRPC, exactly as to an external server; this object just owns the
process: start it, learn its port from the ready file, restart it on the same port after a crash (the
client then re-pushes the current weights), and stop it with SIGTERM (graceful) at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time


class ServerStartError(RuntimeError):
    """The rollout server subprocess exited or did not become ready; the message quotes its log."""


class ManagedServer:
    def __init__(self, *, engine: str, model_dir: str, dtype: str, work_dir: str, max_model_len: int = 0,
                 startup_timeout_s: float = 600.0) -> None:
        self.engine, self.model_dir, self.dtype = engine, model_dir, dtype
        self.work_dir = work_dir
        self.max_model_len = max_model_len
        self.startup_timeout_s = startup_timeout_s
        os.makedirs(work_dir, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.token_file = os.path.join(work_dir, "rollout_token")
        with open(os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(self.token + "\n")
        self.log_path = os.path.join(work_dir, "rollout_server.log")
        self.ready_file = os.path.join(work_dir, "rollout_ready.json")
        self.port = 0  # 0 until the first start picks a free port; restarts reuse it
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> str:
        """Start (or restart) the server and block until it serves; returns "host:port"."""
        if self.alive():
            return self.address
        if os.path.exists(self.ready_file):
            os.remove(self.ready_file)
        args = [sys.executable, "-m", "jaxrl_mismatch.cli", "serve", "--engine", self.engine, "--model", self.model_dir,
                "--dtype", self.dtype, "--port", str(self.port), "--token-file", self.token_file,
                "--ready-file", self.ready_file, "--exit-with-parent"]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # The server is a single-device process: the trainer's fake-device flags must not leak into it.
        env.pop("XLA_FLAGS", None)
        log = open(self.log_path, "a")
        log.write(f"\n=== start {self.starts + 1}: {' '.join(args)}\n")
        log.flush()
        # Own session: a Ctrl-C in the trainer's terminal reaches only the trainer, which then stops the
        # server gracefully; --exit-with-parent covers a trainer killed outright.
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self.starts += 1
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if os.path.exists(self.ready_file):
                with open(self.ready_file) as f:
                    self.port = int(json.load(f)["port"])
                return self.address
            if self.proc.poll() is not None:
                raise ServerStartError(f"rollout server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.2)
        self.stop()
        raise ServerStartError(f"rollout server not ready after {self.startup_timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM (graceful shutdown), then SIGKILL of the process group if it lingers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"
