"""A rollout server run as a child process: `jaxrl-mismatch serve` on loopback, owned by its launcher.

The launcher talks to it only over gRPC, exactly as to an external server; this object just owns the
process: start it, learn its port from the ready file, restart it on the same port, stop it with SIGTERM
(graceful). Its command line is built from `server.build_parser()` itself, so a renamed or removed serve
flag fails here at once instead of at the first restart.

`start` may run in one thread (a fleet's background revival) while `stop` or `close` run in another (a step
taking the server down, the trainer shutting down): a stop during a start kills the process being started and
that start raises at once instead of waiting out its start-up; after `close` no start launches a process.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from jaxrl_mismatch.rollout.client import RolloutError
from jaxrl_mismatch.rollout.server import PARENT_PID_ENV, build_parser
from jaxrl_mismatch.usage import UsageError


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def server_xla_flags(flags: str) -> str:
    """The trainer's `XLA_FLAGS` for its local rollout server: all but the fake CPU device count.

    Why: the engine's bits are a property of program, shapes, device and compiler flags (docs/rollout.md,
    exact mode), so the flags a user sets for the trainer (`--xla_gpu_autotune_level=0`, deterministic ops,
    CPU code generation) must reach the engine too; only `--xla_force_host_platform_device_count` stays
    behind, since the server is a single-device process."""
    return " ".join(f for f in flags.split() if f.split("=", 1)[0] != _DEVICE_COUNT_FLAG)


def server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a single-device child process: `XLA_FLAGS` by `server_xla_flags`, dropped when nothing is left."""
    env = dict(environ)
    flags = server_xla_flags(env.pop("XLA_FLAGS", ""))
    return env | {"XLA_FLAGS": flags} if flags else env


class ServerStartError(RolloutError):
    """The rollout server subprocess exited or did not become ready; the message quotes its log."""


def serve_argv(options: dict[str, Any]) -> list[str]:
    """`jaxrl-mismatch serve` arguments for `options` (argparse dest names → values), checked by its parser.

    True booleans become bare flags, False/None are left out; unknown names raise ValueError.
    """
    actions = {a.dest: a for a in build_parser()._actions if a.option_strings}
    argv: list[str] = []
    for dest, value in options.items():
        if dest not in actions:
            raise ValueError(f"serve has no option {dest!r}; valid: {sorted(d for d in actions if d != 'help')}")
        flag = actions[dest].option_strings[-1]
        if value is None or value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    build_parser().parse_args(argv)  # the server's own checks (choices, types, ranges) before any start
    return argv


class ManagedServer:
    """One `serve` subprocess with a generated token; `options` are serve's flags by argparse dest name."""

    def __init__(self, work_dir: str, startup_timeout_s: float = 600.0, **options: Any) -> None:
        os.makedirs(work_dir, exist_ok=True)
        self.startup_timeout_s = startup_timeout_s
        self.token = secrets.token_hex(16)
        self.token_file = os.path.join(work_dir, "rollout_token")
        # Never through a link: its target (a token file of the user's, say) would be truncated and overwritten.
        try:
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            what = "is a symbolic link; remove it" if e.errno == errno.ELOOP else f"cannot be written: {e.strerror}"
            raise UsageError(f"rollout server token {self.token_file} {what}") from None
        os.fchmod(fd, 0o600)  # the mode above applies only to a file it creates: an existing one kept its own
        with open(fd, "w") as f:
            f.write(self.token + "\n")
        self.log_path = os.path.join(work_dir, "rollout_server.log")
        self.ready_file = os.path.join(work_dir, "rollout_ready.json")
        self.options = {"port": 0, **options, "token_file": self.token_file, "ready_file": self.ready_file,
                        "exit_with_parent": True}
        serve_argv(self.options)  # fail now on a bad option
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        # `proc`, `starts`, the port and the counters below change under this lock only; a start notices a stop
        # or close made meanwhile by `_stops` having moved on.
        self._lock = threading.Lock()
        self._stops = 0
        self._closed = False

    @property
    def port(self) -> int:
        return int(self.options["port"])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> str:
        """Start (or restart, on the port it had) the server and block until it serves; returns host:port.

        Raises ServerStartError if the process exits, is not ready within `startup_timeout_s`, or is stopped or
        closed (from another thread) before it is ready; after `close` it starts nothing."""
        with self._lock:
            if self._closed:
                raise ServerStartError("rollout server not started: its launcher is closed")
            if self.alive():
                return self.address
            if os.path.exists(self.ready_file):
                os.remove(self.ready_file)
            args = [sys.executable, "-m", "jaxrl_mismatch.cli", "serve", *serve_argv(self.options)]
            env = server_env(os.environ) | {"PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid())}
            with open(self.log_path, "a") as log:
                log.write(f"\n=== start {self.starts + 1}: {' '.join(args)}\n")
                log.flush()
                # Own session: a Ctrl-C in the launcher's terminal reaches only the launcher, which then stops
                # the server gracefully; --exit-with-parent covers a launcher killed outright.
                self.proc = proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                    start_new_session=True)
            self.starts += 1
            stops = self._stops
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._stops != stops:  # stopped (or closed) meanwhile; `stop` killed the process
                    raise ServerStartError("rollout server stopped while it was starting "
                                           f"({'its launcher is closed' if self._closed else 'stop requested'})")
                if os.path.exists(self.ready_file):
                    with open(self.ready_file) as f:
                        self.options["port"] = int(json.load(f)["port"])  # restarts reuse the port
                    return self.address
            if proc.poll() is not None:
                raise ServerStartError(f"rollout server exited with code {proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.2)
        self.stop()
        raise ServerStartError(f"rollout server not ready after {self.startup_timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM (graceful shutdown), then SIGKILL of the process group if it lingers. A start in progress in
        another thread raises; `start` may be called again afterwards (not after `close`)."""
        with self._lock:
            proc, self.proc = self.proc, None
            self._stops += 1
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)

    def close(self) -> None:
        """`stop` for good: no later `start` launches a process, and one in progress stops now."""
        with self._lock:
            self._closed = True
        self.stop()

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no log)"
