"""A launched rollout server: flags built from serve's parser, and it never outlives its launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from jaxrl_mismatch.rollout.launcher import ManagedServer, serve_argv, server_xla_flags
from jaxrl_mismatch.usage import UsageError
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
        "from jaxrl_mismatch.rollout.launcher import ManagedServer\n"
        f"s = ManagedServer({str(tmp_path / 'w')!r}, engine='jax', model={str(model)!r}, dtype='float32')\n"
        "s.start()\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    # The trainer's XLA flags reach its server (the same compiler flags on both sides), all but the fake CPU
    # device count (the server is one device).
    flags = "--xla_force_host_platform_device_count=8 --xla_cpu_use_fusion_emitters=false"
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, XLA_FLAGS=flags))
    try:
        server_pid = int(trainer.stdout.readline())
        assert _alive(server_pid)
        with open(f"/proc/{server_pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        assert env[b"XLA_FLAGS"] == b"--xla_cpu_use_fusion_emitters=false"
        # its pid as the parent's: read by the child after its imports, a launcher killed during them left init's
        assert env[b"JAXRL_SERVE_PARENT_PID"] == str(trainer.pid).encode()
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


def test_server_gets_the_trainers_xla_flags_but_the_fake_device_count():
    assert server_xla_flags("") == ""
    assert server_xla_flags("--xla_force_host_platform_device_count=8") == ""
    assert server_xla_flags("--xla_gpu_autotune_level=0 --xla_force_host_platform_device_count=8 "
                            "--xla_gpu_deterministic_ops=true") == (
        "--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops=true")


def test_serve_argv_comes_from_the_servers_own_parser(tmp_path):
    argv = serve_argv({"engine": "vllm", "model": "/m", "port": 0, "exit_with_parent": True, "max_model_len": None})
    assert argv == ["--engine", "vllm", "--model", "/m", "--port", "0", "--exit-with-parent"]
    with pytest.raises(ValueError, match="serve has no option 'model_dir'"):
        serve_argv({"model_dir": "/m"})
    with pytest.raises(UsageError, match="invalid choice: 'float8'"):  # serve's own choices, before any start
        ManagedServer(str(tmp_path), engine="jax", model="/m", dtype="float8")
    with pytest.raises(UsageError, match="99999 is outside 0-65535"):
        ManagedServer(str(tmp_path), engine="jax", model="/m", port=99999)


@pytest.mark.slow
def test_serve_stops_once_the_parent_it_was_given_is_not_its_parent(tmp_path):
    """The parent's pid was read as os.getppid() after the start-up imports: a launcher killed during them had
    already handed the server to init, whose pid was then taken for the parent's, and the server ran on for good.
    A launcher's pid given in the environment is compared from the start (here pid 1 stands in for a parent that
    has gone: this process is the server's parent)."""
    model = make_tiny_qwen3(tmp_path / "model", tied=False)
    (tmp_path / "token").write_text("t" * 32 + "\n")
    out = subprocess.run([sys.executable, "-m", "jaxrl_mismatch.cli", "serve", "--engine", "jax", "--model", str(model),
                          "--dtype", "float32", "--port", "0", "--token-file", str(tmp_path / "token"),
                          "--exit-with-parent"], env=dict(os.environ, JAXRL_SERVE_PARENT_PID="1"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "serve: parent process 1 exited" in out.stdout, out.stdout + out.stderr


def test_the_token_is_never_written_through_a_link(tmp_path):
    """A `rollout_token` that is a symbolic link (to the user's own token file, say) was followed, and its target
    truncated and overwritten with the generated token; it is refused by name and the target kept."""
    theirs = tmp_path / "their_token"
    theirs.write_text("their secret\n")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "rollout_token").symlink_to(theirs)
    with pytest.raises(UsageError, match=r"^rollout server token .*rollout_token is a symbolic link; remove it$"):
        ManagedServer(str(tmp_path / "w"), engine="jax", model="/m", dtype="float32")
    assert theirs.read_text() == "their secret\n"
    # an existing token file of mode 0644 kept it: the new token was world-readable
    (tmp_path / "w" / "rollout_token").unlink()
    (tmp_path / "w" / "rollout_token").write_text("old\n")
    os.chmod(tmp_path / "w" / "rollout_token", 0o644)
    ManagedServer(str(tmp_path / "w"), engine="jax", model="/m", dtype="float32")
    assert os.stat(tmp_path / "w" / "rollout_token").st_mode & 0o777 == 0o600


@pytest.mark.slow
def test_a_stop_from_another_thread_ends_a_start_in_progress_and_close_is_for_good(tmp_path):
    """A fleet revives a server in a background thread while the step or the shutdown stops it: `stop` set `proc` to
    None under the start's feet (AttributeError in its wait loop) or, coming just before the process was spawned,
    stopped nothing, and the start went on to launch a server nobody would stop. Now the start raises at once and
    kills what it spawned; after `close` nothing starts."""
    import threading

    from jaxrl_mismatch.rollout.launcher import ServerStartError

    model = make_tiny_qwen3(tmp_path / "model", tied=False)
    server = ManagedServer(str(tmp_path / "w"), engine="jax", model=str(model), dtype="float32")

    def start_in_thread():
        outcome = {}

        def run():
            try:
                outcome["address"] = server.start()
            except BaseException as e:  # noqa: BLE001 - the test reads it
                outcome["error"] = e

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 30
        while server.proc is None and time.monotonic() < deadline:  # spawned, not yet ready (seconds of start-up)
            time.sleep(0.01)
        return thread, outcome, server.proc

    try:
        for how in ("stop", "close"):
            thread, outcome, proc = start_in_thread()
            assert proc is not None and not os.path.exists(server.ready_file)
            getattr(server, how)()
            thread.join(timeout=30)
            assert not thread.is_alive()
            reason = "its launcher is closed" if how == "close" else "stop requested"
            assert isinstance(outcome.get("error"), ServerStartError), outcome
            assert str(outcome["error"]) == f"rollout server stopped while it was starting ({reason})"
            assert proc.poll() is not None and not server.alive()
            if how == "stop":  # a stop is not for good: the server starts again and serves
                assert server.start() == server.address and server.alive()
                server.stop()
        with pytest.raises(ServerStartError, match="not started: its launcher is closed"):
            server.start()
        assert server.starts == 3 and server.proc is None
    finally:
        server.close()
