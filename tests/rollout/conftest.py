"""Fixtures for rollout tests: tiny random Qwen3 checkpoints and real `serve` subprocesses on loopback.

Server processes are always reaped: every `ServerProcess` is registered with a finalizer that sends
SIGKILL to its process group if it is still alive at teardown.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[2]
TOKEN = "rollout-test-token"
VOCAB = 97


def make_tiny_qwen3(directory: Path, *, tied: bool, seed: int = 0) -> Path:
    """A 2-layer random Qwen3 saved by transformers itself (the format users' checkpoints come in).

    initializer_range=0.3 (vs HF's 0.02) makes next-token distributions far from uniform, so top-k /
    top-p masks cut real probability mass and a stale LM head changes log-probs visibly.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=tied,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(directory)
    return directory


def make_fp16_overflowing_qwen3(directory: Path) -> Path:
    """`make_tiny_qwen3` with its LM head × 3e4: the logits pass fp16's 65,504, so a float16 engine's log-probs are
    not finite (a real overflow, as on models whose activations exceed fp16's range); float32 is fine."""
    from safetensors.numpy import load_file, save_file

    ckpt = make_tiny_qwen3(directory, tied=False)
    shard = next(ckpt.glob("*.safetensors"))
    w = load_file(str(shard))
    w["lm_head.weight"] = w["lm_head.weight"] * np.float32(3e4)
    save_file(w, str(shard), metadata={"format": "pt"})
    return ckpt


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_qwen3")
    return {name: make_tiny_qwen3(root / name, tied=name == "tied") for name in ("tied", "untied")}


@pytest.fixture(scope="session")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


class ServerProcess:
    """`python -m jaxrl_mismatch.cli serve ...` in its own process group, with its output captured."""

    def __init__(self, model_dir: Path, token_file: Path, *, port: int = 0, engine: str = "jax",
                 dtype: str = "float32", extra: tuple[str, ...] = ()):
        self.args = [sys.executable, "-m", "jaxrl_mismatch.cli", "serve", "--engine", engine, "--model", str(model_dir),
                     "--dtype", dtype, "--port", str(port), "--token-file", str(token_file), *extra]
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.ready: dict | None = None

    def start(self, timeout_s: float = 180.0) -> ServerProcess:
        env = child_env(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        env.pop("JAXRL_ROLLOUT_TOKEN", None)
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        got: queue.Queue = queue.Queue()

        def pump(stream):
            for line in stream:
                self.lines.append(line.rstrip("\n"))
                if line.startswith("JAXRL_ROLLOUT_READY "):
                    got.put(json.loads(line.split(" ", 1)[1]))
            got.put(None)

        threading.Thread(target=pump, args=(self.proc.stdout,), daemon=True).start()
        try:
            self.ready = got.get(timeout=timeout_s)
        except queue.Empty:
            self.ready = None
        if self.ready is None:
            self.kill()
            raise RuntimeError("server did not become ready; output:\n" + "\n".join(self.lines[-40:]))
        self.port = self.ready["port"]
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def start_server(request, token_file):
    """Factory: start_server(model_dir, **kw) -> a ready ServerProcess, killed at teardown."""

    def start(model_dir, **kw) -> ServerProcess:
        server = ServerProcess(model_dir, token_file, **kw)
        request.addfinalizer(server.kill)
        return server.start()

    return start


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_checkpoint(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return dict(load_file(str(directory / "model.safetensors")))


def write_checkpoint(src: Path, dst: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A copy of checkpoint `src` with new tensors: the reference a recompute on new weights loads."""
    import shutil

    from safetensors.numpy import save_file

    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def wait_until(pred, timeout_s: float = 30.0, every_s: float = 0.1) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(every_s)
    return pred()


def in_process_servers(checkpoint, n: int):
    """`n` in-process rollout servers on one fp32 JaxEngine checkpoint each (a generator for module fixtures:
    yields the list, stops them after)."""
    from jaxrl_mismatch.rollout.jax_engine import JaxEngine
    from jaxrl_mismatch.rollout.server import RolloutServer

    servers = []
    for _ in range(n):
        server = RolloutServer(port=0, token=TOKEN)
        server.attach(JaxEngine(str(checkpoint), dtype="float32"))
        servers.append(server)
    yield servers
    for server in servers:
        server.stop(0)
