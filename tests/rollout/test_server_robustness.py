"""The rollout server stays answerable and its state stays what its callers saw, whatever the callers do.

A review reproduced each of these against `serve --engine jax`; each test failed before its fix:

- 8 long Generates held all 8 threads: the health check (2 s, `wait_until_ready`'s), GetInfo and an authenticated push
  timed out. Generate is capped (`--max-concurrent-generates`, RESOURCE_EXHAUSTED `server-busy`, which the client
  retries) and the pool has threads beyond the cap.
- UpdateWeightsShm naming a FIFO blocked in open() while holding the update lock, jamming every later push.
- A shared-memory push whose caller had already seen DEADLINE_EXCEEDED (queued behind a slow push) was applied later.
- Pushes waiting for the update lock each held a thread: enough of them (authenticated callers pushing at once) would
  take the reserved threads too. Pushes have their own cap (MAX_CONCURRENT_PUSHES, then `server-busy`).
- A push the client broke off (its iterator raised, its deadline passed) was logged as "engine failed" with a traceback.
- A token that is not printable ASCII crashed `serve` (non-UTF-8) or was accepted and then refused by gRPC at every
  push (non-ASCII UTF-8); `--max-model-len 1` was reported as a bad `--model` after loading it.

One test pins what already held: open health Watch streams take no thread (a later note had said they did).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxrl_mismatch.rollout import rollout_pb2, rollout_pb2_grpc, shm
from jaxrl_mismatch.rollout.client import RetryPolicy, RolloutClient, RolloutError
from jaxrl_mismatch.rollout.engine import GenerationCancelled
from jaxrl_mismatch.rollout.protocol import ERROR_KIND_KEY, SERVICE_NAME, TOKEN_ENV, weight_chunks
from jaxrl_mismatch.rollout.server import (DEFAULT_MAX_CONCURRENT_GENERATES, MAX_CONCURRENT_PUSHES, RESERVED_WORKERS,
                                           RolloutServer, main, read_token)
from jaxrl_mismatch.usage import UsageError

from .conftest import REPO, TOKEN, read_checkpoint, wait_until

AUTH = (("authorization", f"Bearer {TOKEN}"),)
REQUEST = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=[3, 14, 15])], n=1, max_tokens=4, seed=1)


@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    from jaxrl_mismatch.rollout.jax_engine import JaxEngine

    server = RolloutServer(port=0, token=TOKEN)
    server.attach(JaxEngine(str(tiny_checkpoints["untied"]), dtype="float32"))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, rollout_pb2_grpc.RolloutStub(channel), health_pb2_grpc.HealthStub(channel)
    channel.close()
    server.stop(0)


@pytest.fixture(scope="module")
def weights(tiny_checkpoints) -> dict[str, np.ndarray]:
    return read_checkpoint(tiny_checkpoints["untied"])


def _version(stub) -> int:
    return stub.GetInfo(rollout_pb2.GetInfoRequest(), timeout=10).weight_version


def test_health_info_and_pushes_answer_while_generate_is_at_its_cap(served, weights, monkeypatch):
    """As many long Generates as the cap allows (8 by default, the old pool's size) leave threads for everything
    else; one more Generate is refused at once with RESOURCE_EXHAUSTED `server-busy` instead of queueing."""
    server, stub, health = served
    engine = server.engine
    cap = 8  # serve's default --max-concurrent-generates
    inside = threading.Semaphore(0)

    def long_generation(prompts, spec, cancelled):  # a generation that runs until its caller goes away
        inside.release()
        cancelled.wait(60)
        raise GenerationCancelled("the caller went away")

    monkeypatch.setattr(engine, "generate_cancellable", long_generation)
    futures = [stub.Generate.future(REQUEST, timeout=60) for _ in range(cap)]
    try:
        for _ in range(cap):
            assert inside.acquire(timeout=30), "the Generate calls did not all reach the engine"
        t0 = time.monotonic()
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2.0).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        version = _version(stub)
        reply = stub.UpdateWeights(weight_chunks(weights, version + 1), timeout=10, metadata=AUTH)
        assert reply.weight_version == version + 1 == _version(stub)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(REQUEST, timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-generates 8" in err.value.details(), err.value.details()
        assert dict(err.value.trailing_metadata())[ERROR_KIND_KEY] == "server-busy"
        assert time.monotonic() - t0 < 10
    finally:
        for f in futures:
            f.cancel()
    # The cancelled calls leave; the cap frees up.
    assert wait_until(lambda: server.servicer._generating == 0, timeout_s=10)


def test_pushes_beyond_their_cap_are_busy_and_leave_threads_for_health(served, weights, monkeypatch):
    """Pushes waiting behind a slow one each hold a thread: at most MAX_CONCURRENT_PUSHES are admitted, one more is
    refused at once as `server-busy` (which the client retries), and the health check still answers. The waiting
    pushes of the same weights then finish, answered OK without being applied again."""
    server, stub, health = served
    engine = server.engine
    applying, release = threading.Semaphore(0), threading.Event()
    real_update = engine.update_weights
    applied = []

    def slow_update(tensors, version):
        applied.append(version)
        applying.release()
        release.wait(30)
        real_update(tensors, version)

    monkeypatch.setattr(engine, "update_weights", slow_update)
    version = _version(stub) + 1
    first = stub.UpdateWeights.future(weight_chunks(weights, version), timeout=60, metadata=AUTH)
    assert applying.acquire(timeout=30), "the first push did not reach the engine"
    waiting = [stub.UpdateWeights.future(weight_chunks(weights, version), timeout=60, metadata=AUTH)
               for _ in range(MAX_CONCURRENT_PUSHES - 1)]
    try:
        assert wait_until(lambda: server.servicer._pushes == MAX_CONCURRENT_PUSHES, timeout_s=10)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateWeights(weight_chunks(weights, version), timeout=10, metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.value.trailing_metadata())[ERROR_KIND_KEY] == "server-busy"
        assert f"{MAX_CONCURRENT_PUSHES} weight pushes are in progress" in err.value.details()
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2.0).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
    assert [f.result(timeout=30).weight_version for f in [first, *waiting]] == [version] * MAX_CONCURRENT_PUSHES
    assert applied == [version] and _version(stub) == version
    assert wait_until(lambda: server.servicer._pushes == 0, timeout_s=10)


def test_open_health_watch_streams_take_no_threads(served):
    """Supervisors may hold `Health.Watch` streams open for the server's life: grpc's health servicer answers them
    without blocking a thread (experimental_non_blocking, its default), so three times the whole pool's worth of
    open streams still leaves health checks, GetInfo and Generate answered."""
    server, stub, health = served
    n = 3 * (DEFAULT_MAX_CONCURRENT_GENERATES + RESERVED_WORKERS)  # the whole default pool, three times over
    streams = [health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=60) for _ in range(n)]
    try:
        assert all(next(st).status == health_pb2.HealthCheckResponse.SERVING for st in streams)
        t0 = time.monotonic()
        assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2.0).status == \
            health_pb2.HealthCheckResponse.SERVING
        _version(stub)
        assert len(stub.Generate(REQUEST, timeout=30).prompts) == 1
        assert time.monotonic() - t0 < 30
    finally:
        for st in streams:
            st.cancel()


class _Failure(grpc.RpcError):
    def __init__(self, code, kind=None):
        self._code, self._kind = code, kind

    def code(self):
        return self._code

    def details(self):
        return "busy" if self._kind else "message larger than max"

    def trailing_metadata(self):
        return ((ERROR_KIND_KEY, self._kind),) if self._kind else ()


def test_client_retries_a_busy_server_but_not_an_oversize_message(caplog):
    """`server-busy` is transient (other callers fill the cap): retried with backoff, like UNAVAILABLE. gRPC's own
    RESOURCE_EXHAUSTED (a message over the transport limit) is not: the same message would fail again."""
    client = RolloutClient("127.0.0.1:1", wait_ready_s=None, retry=RetryPolicy(initial_backoff_s=0.01))
    try:
        answers = [_Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "server-busy")] * 2 + ["done"]

        def call():
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        with caplog.at_level(logging.WARNING, logger="jaxrl_mismatch.rollout.client"):
            assert client._call("Generate", call, retry_deadline=False) == "done"
        assert sum("RESOURCE_EXHAUSTED (busy); retrying" in r.getMessage() for r in caplog.records) == 2

        calls = []

        def oversize():
            calls.append(1)
            raise _Failure(grpc.StatusCode.RESOURCE_EXHAUSTED)

        with pytest.raises(RolloutError, match="RESOURCE_EXHAUSTED: message larger than max") as err:
            client._call("Generate", oversize, retry_deadline=False)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and len(calls) == 1

        always_busy = RolloutClient("127.0.0.1:1", wait_ready_s=None, retry=RetryPolicy(max_attempts=2,
                                                                                         initial_backoff_s=0.01))
        with pytest.raises(RolloutError, match="RESOURCE_EXHAUSTED after 2 attempts") as err:
            always_busy._call("Generate", lambda: (_ for _ in ()).throw(
                _Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "server-busy")), retry_deadline=False)
        assert (err.value.code, err.value.kind) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "server-busy")
        assert not always_busy._unreachable  # busy is not gone: the next call gets its full retries
        always_busy.close()
    finally:
        client.close()


def test_a_shm_push_naming_a_fifo_is_refused_without_blocking(served, weights, tmp_path):
    server, stub, _ = served
    path = tmp_path / "fifo"
    os.mkfifo(path)
    fifo = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    writer = shm.ShmWriter()
    try:
        version = _version(stub)
        good = writer.write(weights, version + 1)
        bad = rollout_pb2.ShmWeights()
        bad.CopyFrom(good)
        bad.fd = fifo  # this process's descriptor of a FIFO nobody writes to
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateWeightsShm(bad, timeout=3, metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert err.value.details().startswith("fd: ") and "is a FIFO" in err.value.details(), err.value.details()
        # The update lock is free: the next push is applied at once.
        assert stub.UpdateWeightsShm(good, timeout=10, metadata=AUTH).weight_version == version + 1
        assert time.monotonic() - t0 < 8
    finally:
        # Before the fix the server's open() still blocked here: a writer releases it (and the test process).
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        os.close(fifo)
        writer.close()


def test_a_push_whose_caller_left_while_it_waited_is_not_applied(served, weights, caplog):
    """A push queued behind a slow one (the update lock held) whose deadline passes gets DEADLINE_EXCEEDED and must
    not be applied once the lock frees: the trainer saw it fail."""
    server, stub, _ = served
    version = _version(stub)
    writer = shm.ShmWriter()
    new = {k: v * np.float32(1.5) for k, v in weights.items()}
    try:
        with caplog.at_level(logging.WARNING, logger="jaxrl_mismatch.rollout.server"):
            with server.servicer._update_lock:  # a slow push in progress
                for push in (lambda: stub.UpdateWeightsShm(writer.write(new, version + 1), timeout=0.5, metadata=AUTH),
                             lambda: stub.UpdateWeights(weight_chunks(new, version + 1), timeout=0.5, metadata=AUTH)):
                    with pytest.raises(grpc.RpcError) as err:
                        push()
                    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                time.sleep(0.5)  # the handlers notice their callers left and give up waiting
            # Before the fix they took the lock now and applied version + 1.
            gone = lambda: [r.getMessage() for r in caplog.records if "caller went away" in r.getMessage()]  # noqa: E731
            wait_until(lambda: len(gone()) == 2 or _version(stub) != version, timeout_s=10)
        assert _version(stub) == version
        assert len(gone()) == 2 and all("while it waited for another push" in m for m in gone()), gone()
    finally:
        writer.close()


def test_a_push_broken_off_by_its_client_is_logged_as_such(served, weights, caplog):
    """The client's chunk iterator raising (a trainer dying mid-push) or its deadline passing mid-stream: one warning
    line saying the caller went away, no "engine failed" traceback; the version in service stays."""
    server, stub, _ = served
    version = _version(stub)
    chunks = list(weight_chunks(weights, version + 1, chunk_bytes=4096))

    def raising():
        yield from chunks[: len(chunks) // 2]
        time.sleep(0.5)  # the handler is inside the stream (a call cancelled before it starts is never handled)
        raise RuntimeError("trainer died")

    def stalling():
        yield from chunks[: len(chunks) // 2]
        time.sleep(1.5)
        yield from chunks[len(chunks) // 2:]

    with caplog.at_level(logging.INFO, logger="jaxrl_mismatch.rollout.server"):
        for stream, timeout in ((raising(), 10), (stalling(), 0.7)):
            with pytest.raises(grpc.RpcError):
                stub.UpdateWeights(stream, timeout=timeout, metadata=AUTH)
        assert wait_until(lambda: sum("caller went away" in r.getMessage() for r in caplog.records) >= 2, 10)
    assert _version(stub) == version
    messages = [r.getMessage() for r in caplog.records if r.name == "jaxrl_mismatch.rollout.server"]
    assert not [m for m in messages if "engine failed" in m], messages
    assert all(r.exc_info is None for r in caplog.records if r.name == "jaxrl_mismatch.rollout.server")
    assert sum("UpdateWeights: the caller went away mid-stream" in m for m in messages) == 2, messages


@pytest.mark.parametrize("raw", [b"\xff\xfe\xfa\n", "tökén\n".encode(), b"ab\x01cd"])
def test_a_token_that_is_not_printable_ascii_is_refused_at_start(raw, tmp_path, monkeypatch):
    """gRPC metadata must be ASCII: a non-UTF-8 token crashed `serve`, a non-ASCII UTF-8 one was accepted and then
    every push failed client-side with "Invalid metadata"."""
    path = tmp_path / "token"
    path.write_bytes(raw)
    with pytest.raises(UsageError, match=rf"^--token-file {path}: the token must be printable ASCII"):
        read_token(str(path))
    monkeypatch.setenv(TOKEN_ENV, os.fsdecode(raw.strip()))
    with pytest.raises(UsageError, match=r"^\$JAXRL_ROLLOUT_TOKEN: the token must be printable ASCII"):
        read_token(None)
    with pytest.raises(ValueError, match="^token: must be printable ASCII"):
        RolloutClient("127.0.0.1:1", token=raw.decode("utf-8", "replace").strip(), wait_ready_s=None)
    path.write_bytes(b"  good-token_0123 \n")
    assert read_token(str(path)) == "good-token_0123"


def test_serve_refuses_a_non_utf8_token_variable_in_one_line(tiny_checkpoints, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env = {k.encode(): v.encode() for k, v in env.items()}
    env[TOKEN_ENV.encode()] = b"\xff\xfe"
    out = subprocess.run([sys.executable, "-m", "jaxrl_mismatch.cli", "serve", "--model",
                          str(tiny_checkpoints["untied"]), "--port", "0"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "error: $JAXRL_ROLLOUT_TOKEN: the token must be printable ASCII (it travels as " \
        "gRPC metadata); the byte at offset 0 is not (`openssl rand -hex 16` makes a good one)", out.stderr


@pytest.mark.parametrize("flags, message", [
    (["--max-model-len", "1"], "--max-model-len: must be >= 2 (one prompt and one completion token), got 1"),
    (["--max-model-len", "0"], "--max-model-len: must be >= 2"),
    (["--max-concurrent-generates", "0"], "--max-concurrent-generates: must be >= 1, got 0"),
])
def test_serve_flags_are_refused_before_the_model_loads(flags, message, tiny_checkpoints, token_file, monkeypatch):
    import jaxrl_mismatch.rollout.server as server_mod

    def never(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(server_mod, "load_engine", never)
    monkeypatch.setattr(server_mod, "RolloutServer", never)
    with pytest.raises(UsageError) as err:
        main(["--model", str(tiny_checkpoints["untied"]), "--token-file", str(token_file), "--port", "0", *flags])
    assert str(err.value).startswith(message), str(err.value)


def test_a_generate_whose_call_ended_before_its_callback_was_added_samples_nothing(served, monkeypatch):
    """gRPC's `add_callback` returns False, and never calls the callback, once the call has ended: a Generate
    whose caller left (deadline, cancel, server stopping) while it waited for a thread, its admission or its
    parsing was sampled to the end for nobody, holding one of the Generate slots. Now it stops before sampling.
    The servicer is called with a context whose call has ended, as gRPC hands it over then."""
    server, _, _ = served
    given = []

    def record(prompts, spec, cancelled):
        given.append(cancelled.is_set())
        raise GenerationCancelled("the caller went away")

    class Aborted(Exception):
        pass

    class EndedCall:
        def add_callback(self, callback):
            return False  # grpc: "the RPC had already terminated and the callback will not be called"

        def abort(self, code, details):
            raise Aborted(code, details)

    monkeypatch.setattr(server.engine, "generate_cancellable", record)
    with pytest.raises(Aborted) as err:
        server.servicer.Generate(REQUEST, EndedCall())
    assert given == [True] and err.value.args[0] == grpc.StatusCode.CANCELLED
    assert server.servicer._generating == 0


def test_a_client_that_never_got_its_server_closes_its_channel(monkeypatch):
    """A client whose server never became ready (or whose first GetInfo failed) raised from its constructor with
    its gRPC channel open: a channel (and its threads) per retried construction, closed only by the garbage
    collector. The constructor now closes it before raising."""
    from jaxrl_mismatch.rollout import client as client_mod

    channels = []
    real = grpc.insecure_channel

    def tracked(*args, **kwargs):
        ch = real(*args, **kwargs)
        channels.append(ch)
        return ch

    monkeypatch.setattr(client_mod.grpc, "insecure_channel", tracked)
    with pytest.raises(RolloutError, match="not ready after"):
        RolloutClient("127.0.0.1:1", token=None, wait_ready_s=0.2)
    assert len(channels) == 1
    with pytest.raises(ValueError, match="closed channel"):  # what gRPC says of a call on a closed channel
        health_pb2_grpc.HealthStub(channels[0]).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1)
