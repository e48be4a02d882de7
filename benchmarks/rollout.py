"""Rollout throughput: generation tokens/s per engine and weight-sync MB/s (gRPC and shared memory), in one run.

    .venv/bin/python benchmarks/rollout.py [--size small] [--engines jax,vllm]

Every number goes through a real `jaxrl-mismatch serve` subprocess on loopback, as in training:
- generation: tokens/s of the whole Generate call (prefill + decode + transport), prompts x n samples of
  `--max-tokens` tokens with no stop token, after one warm-up call that pays the compilation;
- weight sync: MB/s of `RolloutClient.push_weights` of the full HF-named weight set, end to end (until the
  engine serves it), over both transports: the gRPC stream (chunking, server-side reassembly and
  validation, the engine's atomic swap) and same-host shared memory (rollout/shm.py: copy into a memfd,
  xxh3 hash on both sides, the same validation and swap); against two baselines with the same bytes: an
  in-process memcpy (`np.copyto`) and a raw TCP loopback transfer (one socket, no framing), which
  separate gRPC's cost from the kernel's. The shared-memory target is >= 25% of memcpy;
- the server's same-version check (`validation.weights_digest`, xxh3 of every pushed tensor) on vs off, paired
  rounds of pushes to an in-process server on the JAX engine (`bench_digest`), over both transports.

Engines: `jax` always; `vllm` when both the `vllm` package and `jaxrl_mismatch.rollout.vllm_engine`
import (the server runs it with ENGINE_ENV["vllm"]). Writes benchmarks/results/rollout.json.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._args import ArgumentParser, description, positive_int  # noqa: E402
from benchmarks._paths import check_out, write_json  # noqa: E402
from jaxrl_mismatch.rollout.client import RolloutClient  # noqa: E402
from jaxrl_mismatch.rollout.engine import SamplingSpec  # noqa: E402

SIZES = {
    # ~0.2M params: the test model's scale (head_dim 32: vLLM's CPU attention has no kernel for 16).
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    # ~12.6M params (50.3 MB in float32, untied LM head): enough bytes for a meaningful weight-sync rate.
    "small": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=64),
}

# Environment of the server process per engine: vLLM offline, a 1 GiB CPU KV cache, the engine in the
# server process (in-process mode, so in-place weight reloads need no pickling; rollout/vllm_engine.py).
ENGINE_ENV: dict[str, dict[str, str]] = {
    "jax": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
    "vllm": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
}


def available_engines() -> list[str]:
    engines = ["jax"]
    if importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("jaxrl_mismatch.rollout.vllm_engine"):
        engines.append("vllm")
    return engines


def make_checkpoint(directory: Path, size: str) -> Path:
    """A random Qwen3 checkpoint written by our own HF writer (no torch needed)."""
    from flax import nnx

    from jaxrl_mismatch import precision
    from jaxrl_mismatch.models.config import ModelConfig
    from jaxrl_mismatch.models.hf_io import save_hf
    from jaxrl_mismatch.models.model import Transformer

    cfg = ModelConfig(architecture="Qwen3ForCausalLM", rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
                      tie_word_embeddings=False, attention_bias=False, qk_norm=True, max_position_embeddings=2048,
                      **SIZES[size])
    save_hf(Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(0)), cfg, directory)
    return directory


class Server:
    """A `serve` subprocess; stopped with SIGTERM (then SIGKILL) however the benchmark ends."""

    def __init__(self, engine: str, model_dir: Path, token_file: Path, run_dir: Path):
        env = dict(os.environ, PYTHONUNBUFFERED="1", **ENGINE_ENV.get(engine, {}))
        if engine == "vllm":
            env.setdefault("VLLM_CACHE_ROOT", str(run_dir / "vllm_cache"))
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(run_dir / "inductor_cache"))
        env.pop("JAXRL_ROLLOUT_TOKEN", None)
        cmd = [sys.executable, "-m", "jaxrl_mismatch.cli", "serve", "--engine", engine, "--model", str(model_dir),
               "--dtype", "float32", "--port", "0", "--token-file", str(token_file)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.port = None
        for line in self.proc.stdout:
            if line.startswith("JAXRL_ROLLOUT_READY "):
                self.port = json.loads(line.split(" ", 1)[1])["port"]
                break
        if self.port is None:
            raise RuntimeError(f"{engine} server exited with {self.proc.wait()} before it was ready")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # drain

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bench_generation(client: RolloutClient, vocab: int, *, prompts: int, n: int, prompt_len: int, max_tokens: int,
                     repeats: int) -> dict:
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(prompts)]
    spec = SamplingSpec(n=n, max_tokens=max_tokens, seed=0)
    t0 = time.perf_counter()
    client.generate(batch, spec)  # compile / warm caches
    warmup_s = time.perf_counter() - t0
    times, tokens = [], 0
    for r in range(repeats):
        t0 = time.perf_counter()
        out = client.generate(batch, SamplingSpec(n=n, max_tokens=max_tokens, seed=r + 1))
        times.append(time.perf_counter() - t0)
        tokens = sum(len(c.token_ids) for s in out for c in s)
    best = float(np.median(times))
    return {"prompts": prompts, "n": n, "prompt_len": prompt_len, "max_tokens": max_tokens, "tokens_per_call": tokens,
            "warmup_s": warmup_s, "median_call_s": best, "tokens_per_s": tokens / best}


def bench_weight_sync(target: str, token: str, repeats: int) -> dict:
    """Median push time of the same random weights over each transport (fresh versions, one client each)."""
    out: dict = {}
    version = 0
    for transport in ("grpc", "shm"):
        client = RolloutClient(target, token=token, wait_ready_s=300, weight_transport=transport)
        specs = client.weight_specs()
        if not out:
            rng = np.random.default_rng(1)
            tensors = {k: rng.normal(0, 0.02, s.shape).astype(s.dtype) for k, s in specs.items()}
            nbytes = sum(t.nbytes for t in tensors.values())
            out = {"bytes": nbytes, "num_tensors": len(tensors)}
        times = []
        for _ in range(repeats + 1):  # the first push of each transport is a warm-up
            version += 1
            t0 = time.perf_counter()
            client.push_weights(tensors, version=version)
            times.append(time.perf_counter() - t0)
            assert client.last_push_transport == transport
        client.close()
        median = float(np.median(times[1:]))
        out[f"{transport}_median_push_s"] = median
        out[f"{transport}_MBps"] = nbytes / 1e6 / median
    return out


def bench_digest(model_dir: Path, token: str, repeats: int) -> dict:
    """The server's same-version check (`validation.weights_digest` over every pushed tensor) on vs off, paired.

    An in-process server on the JAX engine (the same servicer `serve` runs) takes pushes of fresh versions over
    each transport; in every round one push runs with the digest and one with it replaced by a constant (the
    check then passes every new version, as the code before it did), in alternating order. Medians per side and
    the median of the per-round ratios."""
    from jaxrl_mismatch.rollout import server as server_mod
    from jaxrl_mismatch.rollout.jax_engine import JaxEngine

    srv = server_mod.RolloutServer(port=0, token=token)
    srv.attach(JaxEngine(str(model_dir), dtype="float32"))
    real = server_mod.weights_digest
    out: dict = {}
    try:
        for transport in ("grpc", "shm"):
            client = RolloutClient(f"127.0.0.1:{srv.port}", token=token, wait_ready_s=60, weight_transport=transport)
            specs = client.weight_specs()
            tensors = {k: np.random.default_rng(4).normal(0, 0.02, s.shape).astype(s.dtype) for k, s in specs.items()}
            times: dict[str, list[float]] = {"on": [], "off": []}
            for r in range(repeats + 1):  # round 0 is a warm-up
                for side in (("on", "off") if r % 2 else ("off", "on")):
                    server_mod.weights_digest = real if side == "on" else (lambda t: 0)
                    version = srv.engine.info().weight_version + 1
                    t0 = time.perf_counter()
                    client.push_weights(tensors, version=version)
                    if r:
                        times[side].append(time.perf_counter() - t0)
            client.close()
            ratios = [a / b for a, b in zip(times["on"], times["off"])]
            out[transport] = {"on_median_s": float(np.median(times["on"])),
                              "off_median_s": float(np.median(times["off"])),
                              "paired_ratio_median": float(np.median(ratios)), "rounds": repeats}
        t0 = time.perf_counter()
        for _ in range(repeats):
            real(tensors)
        out["digest_alone_s"] = (time.perf_counter() - t0) / repeats
    finally:
        server_mod.weights_digest = real
        srv.stop(0)
    return out


def bench_memcpy(nbytes: int, repeats: int) -> float:
    src = np.random.default_rng(2).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / 1e6 / float(np.median(times))


def bench_tcp_loopback(nbytes: int, repeats: int) -> float:
    """Raw socket transfer of the same bytes to a receiver thread: the floor any loopback RPC sits on."""
    payload = memoryview(np.random.default_rng(3).integers(0, 255, nbytes, dtype=np.uint8))
    sink = bytearray(nbytes)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def receive():
        for _ in range(repeats):
            conn, _ = listener.accept()
            with conn:
                view, got = memoryview(sink), 0
                while got < nbytes:
                    got += conn.recv_into(view[got:])
                conn.sendall(b"k")

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(payload)
            s.recv(1)
        times.append(time.perf_counter() - t0)
    t.join()
    listener.close()
    return nbytes / 1e6 / float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=description(__doc__))
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--engines", default=",".join(available_engines()), help="comma-separated (default: every engine that imports here: %(default)s)")
    p.add_argument("--prompts", type=positive_int, default=8)
    p.add_argument("--n", type=positive_int, default=4)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rollout.json"))
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    missing = sorted(set(engines) - set(available_engines()))
    if not engines or missing:
        p.error(f"argument --engines: {', '.join(missing) or 'none given'}: not an engine here; choose from "
                f"{', '.join(available_engines())}")
    check_out("--out", args.out, __file__)

    results: dict = {"size": args.size, "model": SIZES[args.size], "machine": platform.machine(),
                     "cpus": os.cpu_count(), "engines": {}}
    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as tmp:
        run_dir = Path(tmp)
        model_dir = make_checkpoint(run_dir / "model", args.size)
        token = secrets.token_hex(16)
        token_file = run_dir / "token"
        token_file.write_text(token)
        for engine in engines:
            server = Server(engine, model_dir, token_file, run_dir)
            try:
                client = RolloutClient(f"127.0.0.1:{server.port}", token=token, wait_ready_s=300)
                row = {"generation": bench_generation(client, SIZES[args.size]["vocab_size"], prompts=args.prompts,
                                                      n=args.n, prompt_len=args.prompt_len,
                                                      max_tokens=args.max_tokens, repeats=args.repeats)}
                client.close()
                row["weight_sync"] = bench_weight_sync(f"127.0.0.1:{server.port}", token, args.repeats)
            finally:
                server.stop()
            results["engines"][engine] = row
        results["digest"] = bench_digest(model_dir, token, max(args.repeats, 15))  # a few % of a push: many rounds
    nbytes = next(iter(results["engines"].values()))["weight_sync"]["bytes"]
    results["baselines"] = {"bytes": nbytes, "memcpy_MBps": bench_memcpy(nbytes, 5),
                            "tcp_loopback_MBps": bench_tcp_loopback(nbytes, 5)}
    for row in results["engines"].values():
        w = row["weight_sync"]
        w["shm_vs_memcpy"] = w["shm_MBps"] / results["baselines"]["memcpy_MBps"]
        w["shm_vs_grpc"] = w["shm_MBps"] / w["grpc_MBps"]

    print(f"\nrollout benchmark — model '{args.size}' ({nbytes / 1e6:.1f} MB of float32 weights), "
          f"{os.cpu_count()} CPUs\n")
    print(f"{'engine':<8} {'gen tokens/s':>13} {'tokens/call':>12} {'call s':>8} {'warm-up s':>10}")
    for engine, row in results["engines"].items():
        g = row["generation"]
        print(f"{engine:<8} {g['tokens_per_s']:>13.0f} {g['tokens_per_call']:>12d} {g['median_call_s']:>8.3f} "
              f"{g['warmup_s']:>10.1f}")
    b = results["baselines"]
    print(f"\nweight push, {nbytes / 1e6:.1f} MB, end to end (median of {args.repeats}):")
    print(f"{'engine':<8} {'path':<22} {'MB/s':>8} {'push s':>8} {'vs memcpy':>10}")
    for engine, row in results["engines"].items():
        w = row["weight_sync"]
        for path, label in (("grpc", "gRPC stream"), ("shm", "shared memory")):
            mbps = w[f"{path}_MBps"]
            print(f"{engine:<8} {label:<22} {mbps:>8.0f} {w[f'{path}_median_push_s']:>8.4f} "
                  f"{mbps / b['memcpy_MBps']:>9.1%}")
    print(f"{'-':<8} {'memcpy (np.copyto)':<22} {b['memcpy_MBps']:>8.0f} {nbytes / 1e6 / b['memcpy_MBps']:>8.4f} {1:>9.1%}")
    print(f"{'-':<8} {'raw TCP loopback':<22} {b['tcp_loopback_MBps']:>8.0f} "
          f"{nbytes / 1e6 / b['tcp_loopback_MBps']:>8.4f} {b['tcp_loopback_MBps'] / b['memcpy_MBps']:>9.1%}")
    d = results["digest"]
    print(f"\nthe server's weights digest on vs off (in-process jax server, {d['grpc']['rounds']} paired rounds; "
          f"the digest alone {d['digest_alone_s'] * 1e3:.1f} ms):")
    print(f"{'path':<22} {'on s':>8} {'off s':>8} {'paired on/off':>14}")
    for path, label in (("grpc", "gRPC stream"), ("shm", "shared memory")):
        print(f"{label:<22} {d[path]['on_median_s']:>8.4f} {d[path]['off_median_s']:>8.4f} "
              f"{d[path]['paired_ratio_median']:>13.3f}x")
    out = Path(args.out)
    write_json(out, results, __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
