"""Same-host weight sync through shared memory (rollout/shm.py): what the server loads, what it refuses, what is left.

In-process servers with the JAX engine check that a shared-memory push serves exactly the weights a gRPC push
does (the sampled tokens match); the refusals (token, checksum, tensors, version) leave the old weights in
service; the transport choice follows the config and the server's host id; and a trainer killed with
SIGKILL mid-push leaves nothing in /dev/shm while the server keeps serving.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import pytest

from jaxrl_mismatch.rollout import rollout_pb2_grpc, shm
from jaxrl_mismatch.rollout.client import RolloutClient, RolloutError
from jaxrl_mismatch.rollout.engine import SamplingSpec
from jaxrl_mismatch.rollout.server import RolloutServer
from tests.child_env import child_env

from .conftest import REPO, TOKEN, read_checkpoint

SPEC = SamplingSpec(n=2, max_tokens=8, seed=3)
PROMPTS = [[3, 14, 15], [9, 2, 6, 5]]


@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    from jaxrl_mismatch.rollout.jax_engine import JaxEngine

    server = RolloutServer(port=0, token=TOKEN)
    server.attach(JaxEngine(str(tiny_checkpoints["untied"]), dtype="float32"))
    yield server
    server.stop(0)


def _client(server, **kw) -> RolloutClient:
    return RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=30, **kw)


def _perturbed(tiny_checkpoints, scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(int(scale * 100))
    return {k: (v + scale * rng.normal(size=v.shape)).astype(v.dtype)
            for k, v in read_checkpoint(tiny_checkpoints["untied"]).items()}


@pytest.mark.slow
def test_shm_push_serves_the_same_weights_as_the_grpc_stream(served, tiny_checkpoints):
    weights = _perturbed(tiny_checkpoints, 0.5)
    with _client(served, weight_transport="grpc") as by_grpc, _client(served) as by_shm:
        by_grpc.push_weights(weights, version=served.engine.info().weight_version + 1)
        assert by_grpc.last_push_transport == "grpc"
        ref = by_grpc.generate(PROMPTS, SPEC)
        by_shm.push_weights(_perturbed(tiny_checkpoints, 2.0), version=by_grpc.pushed_version + 1)
        assert by_shm.last_push_transport == "shm"  # auto picked shared memory on loopback
        other = by_shm.generate(PROMPTS, SPEC)
        assert [c.token_ids for s in other for c in s] != [c.token_ids for s in ref for c in s]
        version = by_shm.pushed_version + 1
        by_shm.push_weights(weights, version=version)  # the same buffer, rewritten
        got = by_shm.generate(PROMPTS, SPEC)
        # The engine copied what it loaded: rewriting the trainer's buffer does not change what it serves.
        by_shm._shm.write(_perturbed(tiny_checkpoints, 2.0), version + 1)
        again = by_shm.generate(PROMPTS, SPEC)
        assert [c.token_ids for s in again for c in s] == [c.token_ids for s in got for c in s]
    assert served.engine.info().weight_version == version
    for a, b in zip((c for s in ref for c in s), (c for s in got for c in s)):
        assert a.token_ids == b.token_ids and a.weight_version + 2 == b.weight_version
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    # One buffer for all pushes of a client; the server maps at most the latest trainer's.
    gc.collect()
    assert len(_mapped_buffers()) <= 1


def _mapped_buffers() -> set[str]:
    """Inodes of our shared-memory weight buffers mapped in this process (client and in-process server)."""
    return {line.split()[4] for line in open("/proc/self/maps") if "memfd:jaxrl-weights" in line}


def _shm_msg(weights, version):
    writer = shm.ShmWriter()
    return writer, writer.write(weights, version)


@pytest.mark.slow
@pytest.mark.parametrize("corrupt,code,needle", [
    (lambda m: setattr(m, "checksum", m.checksum ^ 1), grpc.StatusCode.INVALID_ARGUMENT, "checksum"),
    (lambda m: m.tensors.pop(), grpc.StatusCode.INVALID_ARGUMENT, "missing from the update"),
    (lambda m: setattr(m.tensors[0], "offset", 8), grpc.StatusCode.INVALID_ARGUMENT, "aligned"),
    (lambda m: setattr(m.tensors[0], "dtype", "float16"), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    (lambda m: setattr(m, "version", 0), grpc.StatusCode.INVALID_ARGUMENT, "version"),
    (lambda m: setattr(m, "fd", 9999), grpc.StatusCode.FAILED_PRECONDITION, "cannot open"),
    # no process or descriptor can have these: a malformed request, not a host the server cannot reach
    (lambda m: setattr(m, "pid", -1), grpc.StatusCode.INVALID_ARGUMENT, "pid: must be a process id >= 1, got -1"),
    (lambda m: setattr(m, "pid", 0), grpc.StatusCode.INVALID_ARGUMENT, "pid: must be a process id >= 1, got 0"),
    (lambda m: setattr(m, "fd", -1), grpc.StatusCode.INVALID_ARGUMENT, "fd: must be a file descriptor >= 0, got -1"),
])
def test_bad_shm_push_is_refused_and_old_weights_stay(served, tiny_checkpoints, corrupt, code, needle):
    before = served.engine.info().weight_version
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(f"127.0.0.1:{served.port}"))
    writer, msg = _shm_msg(read_checkpoint(tiny_checkpoints["untied"]), before + 1)
    corrupt(msg)
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWeightsShm(msg, timeout=30, metadata=(("authorization", f"Bearer {TOKEN}"),))
    writer.close()
    assert err.value.code() == code and needle in err.value.details()
    assert served.engine.info().weight_version == before


@pytest.mark.slow
def test_shm_push_needs_the_token(served, tiny_checkpoints):
    before = served.engine.info().weight_version
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(f"127.0.0.1:{served.port}"))
    writer, msg = _shm_msg(read_checkpoint(tiny_checkpoints["untied"]), before + 1)
    for md in [(), (("authorization", "Bearer wrong"),)]:
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateWeightsShm(msg, timeout=30, metadata=md)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    writer.close()
    assert served.engine.info().weight_version == before


@pytest.mark.slow
def test_non_finite_weights_are_refused_over_shm_too(served, tiny_checkpoints):
    weights = read_checkpoint(tiny_checkpoints["untied"])
    name = sorted(weights)[0]
    weights[name] = weights[name].copy()
    weights[name].flat[5] = np.nan
    with _client(served, weight_transport="shm") as client:
        before = served.engine.info().weight_version
        with pytest.raises(RolloutError, match="non-finite") as err:
            client.push_weights(weights, version=before + 1)
        # A failed push's buffer may still be read by an abandoned handler: the next push writes a new file.
        assert client._shm is None
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and name in str(err.value)
    assert served.engine.info().weight_version == before


@pytest.mark.slow
def test_a_buffer_the_caller_could_shrink_is_refused_and_ours_cannot_shrink(served, tiny_checkpoints):
    """The server maps the caller's file; truncated under the mapping it killed the server with SIGBUS (a review's
    race: exit 135). A file without the shrink seal is refused naming `fd`; the trainer's own cannot shrink."""
    before = served.engine.info().weight_version
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(f"127.0.0.1:{served.port}"))
    writer, msg = _shm_msg(read_checkpoint(tiny_checkpoints["untied"]), before + 1)
    with pytest.raises(PermissionError):
        os.ftruncate(msg.fd, 0)
    unsealed = os.memfd_create("unsealed")
    try:
        os.write(unsealed, os.pread(msg.fd, msg.size, 0))  # the same bytes, the same checksum
        msg.fd = unsealed
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdateWeightsShm(msg, timeout=30, metadata=(("authorization", f"Bearer {TOKEN}"),))
    finally:
        os.close(unsealed)
        writer.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("fd: ") and "sealed against shrinking" in err.value.details()
    assert served.engine.info().weight_version == before


@pytest.mark.slow
def test_transport_choice_follows_config_and_host_id(served, tiny_checkpoints, monkeypatch, caplog):
    weights = read_checkpoint(tiny_checkpoints["untied"])
    assert shm.is_local_target("127.0.0.1:5") and shm.is_local_target("[::1]:5") and shm.is_local_target("unix:/x")
    assert not shm.is_local_target("10.1.2.3:50051") and not shm.is_local_target("node7:50051")
    with pytest.raises(ValueError, match="weight_transport"):
        _client(served, weight_transport="nvlink")
    # The server says it lives elsewhere (another boot or PID namespace): auto streams, shm refuses.
    monkeypatch.setattr(served.servicer, "shm_host_id", "another-host/pid:[1]")
    with _client(served) as client:
        client.push_weights(weights, version=served.engine.info().weight_version + 1)
        assert client.last_push_transport == "grpc"
    with _client(served, weight_transport="shm") as client, pytest.raises(RolloutError, match="another host"):
        client.push_weights(weights, version=served.engine.info().weight_version + 1)
    # Same host id but the server cannot open the buffer: auto falls back (and says so) and stays on gRPC.
    monkeypatch.setattr(served.servicer, "shm_host_id", shm.host_id())
    monkeypatch.setattr(served.servicer._shm_reader, "read",
                        lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with _client(served) as client:
        client.push_weights(weights, version=served.engine.info().weight_version + 1)
        assert client.last_push_transport == "grpc" and client.weight_transport == "grpc"
    assert "using the gRPC stream from now on" in caplog.text


@pytest.mark.slow
def test_a_buffer_that_cannot_be_written_falls_back_to_the_stream(served, tiny_checkpoints, monkeypatch, caplog):
    """No memory for the buffer or a file-size limit (EFBIG) on the trainer's side: auto pushes over gRPC and says
    so once; a forced 'shm' is refused naming the transport."""
    import errno

    weights = _perturbed(tiny_checkpoints, 0.0)
    monkeypatch.setattr(served.servicer, "shm_host_id", shm.host_id())
    monkeypatch.setattr(shm.ShmWriter, "write", lambda *a: (_ for _ in ()).throw(OSError(errno.EFBIG, "File too large")))
    with _client(served) as client:
        client.push_weights(weights, version=served.engine.info().weight_version + 1)
        assert client.last_push_transport == "grpc" and client.weight_transport == "grpc"
    assert "could not be written (File too large)" in caplog.text
    with _client(served, weight_transport="shm") as client, pytest.raises(RolloutError, match="weight_transport 'shm'"):
        client.push_weights(weights, version=served.engine.info().weight_version + 1)


TRAINER = textwrap.dedent("""
    import sys, numpy as np
    from jaxrl_mismatch.rollout.client import RolloutClient
    from safetensors.numpy import load_file
    client = RolloutClient(sys.argv[1], token=sys.argv[2], weight_transport="shm", wait_ready_s=60)
    weights = dict(load_file(sys.argv[3] + "/model.safetensors"))
    version = client.info().weight_version
    while True:
        version += 1
        client.push_weights(weights, version)
        print("pushed", version, flush=True)
""")


def _ours_in_dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.slow
def test_trainer_killed_mid_push_leaves_nothing_behind(served, tiny_checkpoints):
    before = _ours_in_dev_shm()
    env = child_env(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, f"127.0.0.1:{served.port}", TOKEN,
                             str(tiny_checkpoints["untied"])], env=env, stdout=subprocess.PIPE, text=True)
    try:
        pushed = [proc.stdout.readline() for _ in range(3)]
        assert all(line.startswith("pushed") for line in pushed), pushed
        proc.send_signal(signal.SIGKILL)  # mid-push: it pushes back to back
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _ours_in_dev_shm() == before
    # The server maps at most the dead trainer's last buffer (kept for reuse, not one per push) and serves.
    assert len(_mapped_buffers()) <= 1
    with _client(served) as client:
        client.push_weights(read_checkpoint(tiny_checkpoints["untied"]), served.engine.info().weight_version + 1)
        assert client.last_push_transport == "shm"
        assert len(client.generate(PROMPTS, SPEC)) == 2


@pytest.mark.slow
def test_session_passes_the_configured_transport(served, tiny_checkpoints):
    from jaxrl_mismatch.rollout.session import RolloutSession
    from jaxrl_mismatch.train.config import ConfigError, base_config
    from jaxrl_mismatch.train.config_checks import validate

    weights = read_checkpoint(tiny_checkpoints["untied"])
    for transport in ("grpc", "shm"):
        with RolloutSession.attach(f"127.0.0.1:{served.port}", token=TOKEN, ready_timeout_s=30,
                                   weight_transport=transport) as session:
            session.push(weights)
            assert session.client.last_push_transport == transport
    c = base_config()
    assert c.rollout.weight_transport == "auto"
    c.rollout.weight_transport = "rdma"
    with pytest.raises(ConfigError, match="rollout.weight_transport"):
        validate(c)


@pytest.mark.slow
def test_a_version_names_one_set_of_weights_whichever_transport_brings_it(served, tiny_checkpoints, monkeypatch):
    """A re-push of the version in service is a retry when its weights are the same (answered, not applied again)
    and refused when they are not, over either transport: the digest is of the tensors, not of their layout."""
    a, b = _perturbed(tiny_checkpoints, 0.5), _perturbed(tiny_checkpoints, 2.0)
    applied = []
    real = served.engine.update_weights
    monkeypatch.setattr(served.engine, "update_weights", lambda t, v: (applied.append(v), real(t, v)))
    with _client(served, weight_transport="grpc") as by_grpc, _client(served, weight_transport="shm") as by_shm:
        version = served.engine.info().weight_version + 1
        by_grpc.push_weights(a, version=version)
        ref = by_grpc.generate(PROMPTS, SPEC)
        by_shm.push_weights(a, version=version)  # the same weights again, the other transport: a retry
        by_grpc.push_weights(a, version=version)
        assert applied == [version]
        for client in (by_grpc, by_shm):
            with pytest.raises(RolloutError) as err:
                client.push_weights(b, version=version)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "version" in str(err.value) and "other weights" in str(err.value)
        got = by_shm.generate(PROMPTS, SPEC)  # still `a`, still `version`
        assert [c.token_ids for s in got for c in s] == [c.token_ids for s in ref for c in s]
        assert {c.weight_version for s in got for c in s} == {version}
        by_grpc.push_weights(b, version=version + 1)  # under a new version they go in
        assert applied == [version, version + 1]
        other = by_grpc.generate(PROMPTS, SPEC)
        assert [c.token_ids for s in other for c in s] != [c.token_ids for s in ref for c in s]
