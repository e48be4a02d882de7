"""Transport-level behaviour of server + client with an in-process fake engine.

The fake engine isolates what the gRPC layer owns — validation, auth, chunk reassembly, atomic
update semantics, error translation, version checks — from the model; the real-engine behaviour is
tested against real server subprocesses in test_jax_server.py.
"""

from __future__ import annotations

import math
import re
import threading

import grpc
import numpy as np
import pytest

from jaxrl_mismatch.rollout import rollout_pb2, rollout_pb2_grpc
from jaxrl_mismatch.rollout.client import (
    EngineMismatchError,
    ForeignCompletionError,
    RolloutClient,
    RolloutError,
    StaleCompletionError,
)
from jaxrl_mismatch.rollout.engine import (
    Completion,
    Engine,
    EngineInfo,
    EngineUnusableError,
    NonFiniteLogprobsError,
    SamplingSpec,
    TensorSpec,
    WeightReloadError,
    check_finite_logprobs,
    resolve_max_model_len,
)
from jaxrl_mismatch.rollout.protocol import (
    ENGINE_UNUSABLE,
    ERROR_KIND_KEY,
    WEIGHT_RELOAD_FAILED,
    Limits,
    weight_chunks,
)
from jaxrl_mismatch.rollout.server import RolloutServer
from jaxrl_mismatch.rollout.validation import count_non_finite

from .conftest import free_port

TOKEN = "s3cret-test-token"


class FakeEngine(Engine):
    """Echo engine: completion = the weight "w"'s first entries as token ids; logprob configurable."""

    def __init__(self, vocab_size: int = 32):
        self.vocab_size = vocab_size
        self.weights = {"w": np.zeros((4, 4), np.float32), "b": np.arange(3, dtype=np.float32)}
        self.version = 0
        self.logprob = -1.0
        self.reported_version: int | None = None  # overrides the version stamped on completions
        self.update_calls = 0  # how many weight sets reached the engine
        self._lock = threading.Lock()

    def info(self) -> EngineInfo:
        return EngineInfo(architecture="FakeForCausalLM", vocab_size=self.vocab_size, dtype="float32", engine="fake",
                          weight_version=self.version, max_model_len=64)

    def generate(self, prompts, spec):
        with self._lock:
            w, version = self.weights["w"], self.version
        stamp = version if self.reported_version is None else self.reported_version
        out = []
        for p in prompts:
            toks = [int(abs(w.flat[t % w.size])) % self.vocab_size for t in range(spec.max_tokens)]
            out.append([Completion(token_ids=toks, logprobs=[self.logprob] * len(toks), finish_reason="length",
                                   weight_version=stamp) for _ in range(spec.n)])
        return out

    def weight_specs(self):
        return {k: TensorSpec(v.shape, v.dtype.name) for k, v in self.weights.items()}

    def update_weights(self, tensors, version):
        self.update_calls += 1
        with self._lock:
            self.weights = {k: np.array(v) for k, v in tensors.items()}
            self.version = version


@pytest.fixture
def served():
    engine = FakeEngine()
    server = RolloutServer(port=0, token=TOKEN, limits=Limits(max_request_prompt_tokens=1000,
                                                              max_request_completion_tokens=10_000))
    server.attach(engine)
    stub = rollout_pb2_grpc.RolloutStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    yield engine, server, stub
    server.stop(0)


def _req(**kw):
    prompts = kw.pop("prompts", [[1, 2, 3]])
    return rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(token_ids=p) for p in prompts], **kw)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=4, n=0), "n"),
        (dict(max_tokens=4, prompts=[[1, 32]]), "prompts[0].token_ids"),
        (dict(max_tokens=4, prompts=[[1], [-1]]), "prompts[1].token_ids"),
        (dict(max_tokens=4, prompts=[[1], []]), "prompts[1].token_ids"),
        (dict(max_tokens=4, prompts=[]), "prompts"),
        (dict(max_tokens=4, temperature=-0.5), "temperature"),
        (dict(max_tokens=4, temperature=math.nan), "temperature"),
        (dict(max_tokens=4, top_p=0.0), "top_p"),
        (dict(max_tokens=4, top_p=1.5), "top_p"),
        (dict(max_tokens=4, top_k=-2), "top_k"),
        (dict(max_tokens=4, stop_token_ids=[99]), "stop_token_ids"),
        (dict(max_tokens=62, prompts=[[1, 2, 3]]), "max_tokens"),  # 3 + 62 > max_model_len 64
        (dict(max_tokens=1, prompts=[[1] * 600, [1] * 600]), "prompts"),  # over the 1000-token request limit
        (dict(max_tokens=50, n=300), "max_tokens"),  # over the completion-token limit
        (dict(max_tokens=4, exact=True), "exact"),  # the fake engine lists no optional features
        (dict(max_tokens=4, logit_noise_std=0.5), "logit_noise_std"),
        (dict(max_tokens=4, logit_noise_std=-1.0), "logit_noise_std"),
    ],
)
def test_malformed_generate_is_invalid_argument_naming_field(served, kwargs, field):
    _, _, stub = served
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(_req(**kwargs), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()
    # ... and the server keeps serving.
    ok = stub.Generate(_req(max_tokens=2), timeout=10)
    assert len(ok.prompts[0].samples[0].token_ids) == 2


def _md(token=TOKEN):
    return (("authorization", f"Bearer {token}"),)


def _update(stub, tensors, version, md=None, chunk_bytes=16):
    return stub.UpdateWeights(weight_chunks(tensors, version, chunk_bytes=chunk_bytes), timeout=10,
                              metadata=_md() if md is None else md)


def _good(scale=1.0):
    return {"w": np.full((4, 4), 5.0 * scale, np.float32), "b": np.ones(3, np.float32)}


def test_update_weights_requires_token(served):
    engine, _, stub = served
    for md in [(), _md("wrong")]:
        with pytest.raises(grpc.RpcError) as err:
            _update(stub, _good(), 1, md=md)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stub.Shutdown(rollout_pb2.ShutdownRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert engine.version == 0


def test_update_weights_chunked_roundtrip(served):
    engine, _, stub = served
    resp = _update(stub, _good(), 3, chunk_bytes=7)  # chunk boundaries inside float32 elements
    assert resp.weight_version == 3 and resp.num_tensors == 2 and resp.num_bytes == 4 * 16 + 4 * 3
    np.testing.assert_array_equal(engine.weights["w"], _good()["w"])
    assert stub.Generate(_req(max_tokens=2), timeout=10).prompts[0].samples[0].weight_version == 3


def _chunk(**kw):
    base = dict(version=2, name="b", dtype="float32", shape=[3], offset=0, data=np.ones(3, np.float32).tobytes())
    base.update(kw)
    return rollout_pb2.WeightChunk(**base)


@pytest.mark.parametrize(
    "chunks, needle",
    [
        (lambda: list(weight_chunks({**_good(), "extra": np.ones(2, np.float32)}, 2)), "'extra'"),
        (lambda: list(weight_chunks({"w": np.ones((4, 5), np.float32), "b": np.ones(3, np.float32)}, 2)), "'w'"),
        (lambda: list(weight_chunks({"w": np.ones((4, 4), np.float64), "b": np.ones(3, np.float32)}, 2)), "'w'"),
        (lambda: list(weight_chunks({"b": np.ones(3, np.float32)}, 2)), "'w'"),  # missing
        (lambda: list(weight_chunks({"w": np.ones((4, 4), np.float32)}, 2)) + [_chunk(data=b"\0" * 8)], "'b'"),
        (lambda: list(weight_chunks(_good(), 2))[:-1] + [_chunk(offset=4, data=b"\0" * 8)], "'b'"),  # gap
        (lambda: [_chunk(version=0)], "version"),
        (lambda: [_chunk(), _chunk(version=3, name="w")], "version"),
        # Non-finite values: refused by the server for every engine, naming tensor, count, first value, index.
        (lambda: list(weight_chunks({**_good(), "b": np.array([1.0, np.nan, 2.0], np.float32)}, 2)),
         "tensor 'b': 1 non-finite value(s), the first nan at index (1,)"),
        (lambda: list(weight_chunks({**_good(), "w": np.where(np.eye(4) > 0, np.float32(-np.inf), 1.0)
                                     .astype(np.float32)}, 2, chunk_bytes=5)),
         "tensor 'w': 4 non-finite value(s), the first -inf at index (0, 0)"),
    ],
)
def test_bad_update_is_rejected_and_old_weights_stay(served, chunks, needle):
    engine, _, stub = served
    _update(stub, _good(), 1)
    before = stub.Generate(_req(max_tokens=4), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdateWeights(iter(chunks()), timeout=10, metadata=_md())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details(), err.value.details()
    assert engine.version == 1 and engine.update_calls == 1  # the engine never saw the bad set
    after = stub.Generate(_req(max_tokens=4), timeout=10)
    assert after == before


def test_version_never_goes_backwards(served):
    _, _, stub = served
    _update(stub, _good(), 5)
    with pytest.raises(grpc.RpcError) as err:
        _update(stub, _good(2.0), 4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "version" in err.value.details()


def test_non_finite_logprob_is_reported_not_passed_on(served):
    engine, server, _ = served
    engine.logprob = math.nan
    client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=10)
    with pytest.raises(NonFiniteLogprobsError) as err:
        client.generate([[1, 2], [3]], SamplingSpec(max_tokens=3, n=2))
    assert (err.value.prompt, err.value.sample, err.value.position) == (0, 0, 0)
    assert "prompt 0, sample 0, position 0" in str(err.value) and str(err.value).endswith(f"from {client.target}")
    # A piece of a split batch (prompt_offset: where it starts) names the prompt's place in the whole batch; it
    # was "prompt 0" whichever piece it came from.
    with pytest.raises(NonFiniteLogprobsError, match=r"at prompt 40, sample 0, position 0 .* from 127\.0\.0\.1:"):
        client.generate([[1, 2], [3]], SamplingSpec(max_tokens=3, n=2, prompt_offset=40))
    engine.logprob = -1.0
    assert client.generate([[1]], SamplingSpec(max_tokens=2))[0][0].logprobs == [-1.0, -1.0]


def test_malformed_response_is_a_rollout_error_naming_it(served, monkeypatch):
    """A response the client cannot decode (4 kept_counts for 2 tokens) is a RolloutError naming the RPC and field."""
    engine, server, _ = served
    bad = Completion(token_ids=[1, 2], logprobs=[-1.0, -1.0], finish_reason="length", weight_version=0,
                     kept_counts=[1, 2, 3, 4])
    monkeypatch.setattr(engine, "generate", lambda prompts, spec: [[bad]])
    client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=10)
    with pytest.raises(RolloutError, match=r"Generate on 127\.0\.0\.1:\d+: malformed completion: 4 kept_counts"):
        client.generate([[1]], SamplingSpec(max_tokens=2))


def test_a_completion_with_fewer_logprobs_than_tokens_is_malformed(served, monkeypatch):
    """It was returned as if whole: the mismatch surfaced later as a padding ValueError, not a transport error."""
    engine, server, _ = served
    bad = Completion(token_ids=[1, 2, 3], logprobs=[-0.5], finish_reason="length", weight_version=0)
    monkeypatch.setattr(engine, "generate", lambda prompts, spec: [[bad]])
    client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=10)
    with pytest.raises(RolloutError, match=r"Generate on 127\.0\.0\.1:\d+: malformed completion: 1 logprobs for 3 "
                                           r"tokens"):
        client.generate([[1]], SamplingSpec(max_tokens=3))


@pytest.mark.parametrize("tokens, max_tokens, needle", [
    ([5, 999, 3], 4, r"has token id 999 at position 1, outside the server's vocab_size=32"),
    ([5, -3], 4, r"has token id -3 at position 1, outside"),
    ([1] * 10, 4, r"has 10 tokens, over max_tokens=4"),
])
def test_a_completion_outside_the_vocabulary_or_over_max_tokens_is_refused(served, monkeypatch, tokens, max_tokens,
                                                                           needle):
    """A server not keeping the protocol: these were returned as if good (ids past the embedding table give NaN
    log-probs in the learner). Known once a GetInfo read the vocabulary, as every push does."""
    engine, server, _ = served
    bad = Completion(token_ids=tokens, logprobs=[-0.5] * len(tokens), finish_reason="length", weight_version=0)
    monkeypatch.setattr(engine, "generate", lambda prompts, spec: [[bad]])
    client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=10)
    client.info()
    with pytest.raises(RolloutError, match=rf"Generate on 127\.0\.0\.1:\d+: completion \(prompt 0, sample 0\) "
                                           rf"{needle}"):
        client.generate([[1]], SamplingSpec(max_tokens=max_tokens))


def test_a_malformed_non_finite_report_is_a_rollout_error_naming_it(served, monkeypatch):
    """A non-finite trailer of 4 fields was a bare ValueError (not enough values to unpack) naming no RPC."""
    from jaxrl_mismatch.rollout.protocol import NON_FINITE, NON_FINITE_DETAIL_KEY

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INTERNAL

        def details(self):
            return "engine produced nan"

        def trailing_metadata(self):
            return ((ERROR_KIND_KEY, NON_FINITE), (NON_FINITE_DETAIL_KEY, "0,1,2,nan"))

    _, server, _ = served
    client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=10)
    def generate(*a, **kw):
        raise Refused()

    monkeypatch.setattr(client, "_stub", type("Stub", (), {"Generate": staticmethod(generate)}))
    with pytest.raises(RolloutError, match=r"Generate on 127\.0\.0\.1:\d+: INTERNAL: engine produced nan \(malformed "
                                           r"jaxrl-non-finite '0,1,2,nan'\)"):
        client.generate([[1]], SamplingSpec(max_tokens=2))


def test_client_check_names_the_first_non_finite_logprob():
    """The client's own check of every response (independent of the server's): crafted completions."""
    ok = Completion(token_ids=[1, 2], logprobs=[-0.5, -1.5], finish_reason="length", weight_version=4)
    bad = Completion(token_ids=[1, 2, 3], logprobs=[-0.5, -1.5, -math.inf], finish_reason="stop", weight_version=4)
    check_finite_logprobs([[ok, ok], [ok, ok]])
    with pytest.raises(NonFiniteLogprobsError, match=r"-inf at prompt 1, sample 0, position 2 \(weight version 4\)"):
        check_finite_logprobs([[ok, ok], [bad, ok]])


def test_non_finite_count_is_blockwise_and_covers_bfloat16(monkeypatch):
    import ml_dtypes

    from jaxrl_mismatch.rollout import validation

    monkeypatch.setattr(validation, "_FINITE_SCAN_BLOCK", 3)  # the first bad value sits in a later block
    arr = np.zeros((2, 5), np.float32)
    arr[1, 2], arr[1, 4] = np.inf, np.nan
    assert count_non_finite(arr) == (2, 7)
    assert count_non_finite(arr.astype(ml_dtypes.bfloat16)) == (2, 7)
    assert count_non_finite(np.ones((2, 5), np.float16)) == (0, -1)
    assert count_non_finite(np.arange(10, dtype=np.int32)) == (0, -1)


def test_max_model_len_rule_shared_by_both_engines():
    assert resolve_max_model_len(None, 256) == 256  # default: the model's max_position_embeddings
    assert resolve_max_model_len(192, 256) == 192
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 256"):
        resolve_max_model_len(300, 256)
    with pytest.raises(ValueError, match=">= 2"):
        resolve_max_model_len(1, 256)
    with pytest.raises(ValueError, match="no max_position_embeddings"):
        resolve_max_model_len(None, None)
    assert resolve_max_model_len(512, None) == 512


class FailingEngine(FakeEngine):
    """FakeEngine whose next update / generate raises what the real vLLM engine raises when it fails."""

    def __init__(self):
        super().__init__()
        self.update_error: Exception | None = None
        self.unusable = False
        self.generate_calls = 0

    def update_weights(self, tensors, version):
        if self.update_error is not None:
            self.update_calls += 1
            if isinstance(self.update_error, WeightReloadError) and not self.update_error.restored:
                self.unusable = True
            raise self.update_error
        super().update_weights(tensors, version)

    def generate(self, prompts, spec):
        self.generate_calls += 1
        if self.unusable:
            raise EngineUnusableError("vLLM engine unusable: restoring weight version 1 failed; restart")
        return super().generate(prompts, spec)


@pytest.fixture
def failing():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    engine = FailingEngine()
    server = RolloutServer(port=0, token=TOKEN)
    server.attach(engine)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)
    status = lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status  # noqa: E731
    client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=10)
    client.push_weights(_good(), version=1)
    yield engine, server, client, rollout_pb2_grpc.RolloutStub(channel), status
    client.close()
    server.stop(0)


def test_failed_reload_with_restore_is_internal_and_server_keeps_serving(failing):
    from grpc_health.v1 import health_pb2

    engine, _, client, stub, health = failing
    before = client.generate([[1]], SamplingSpec(max_tokens=3))
    engine.update_error = WeightReloadError("vLLM failed to load weight version 2: OSError: disk", restored=True)
    with pytest.raises(RolloutError) as err:
        client.push_weights(_good(2.0), version=2)
    assert err.value.code == grpc.StatusCode.INTERNAL
    assert re.search(r"UpdateWeights(Shm)? on", str(err.value)) and "INTERNAL" in str(err.value)
    assert "previous weights stay in service" in str(err.value) and "OSError: disk" in str(err.value)
    with pytest.raises(grpc.RpcError) as raw:  # the machine-readable kind, for other clients
        _update(stub, _good(2.0), 2)
    assert dict(raw.value.trailing_metadata())[ERROR_KIND_KEY] == WEIGHT_RELOAD_FAILED
    assert health() == health_pb2.HealthCheckResponse.SERVING
    assert client.info().weight_version == 1 and client.generate([[1]], SamplingSpec(max_tokens=3)) == before
    engine.update_error = None  # the trainer may simply push again
    client.push_weights(_good(2.0), version=2)
    assert client.generate([[1]], SamplingSpec(max_tokens=3))[0][0].weight_version == 2


def test_unusable_engine_is_failed_precondition_not_retried_and_not_serving(failing):
    from grpc_health.v1 import health_pb2

    engine, _, client, stub, health = failing
    engine.update_error = WeightReloadError("vLLM failed to load weight version 2: restoring failed too",
                                            restored=False)
    with pytest.raises(RolloutError, match=r"UpdateWeights(Shm)? on .*: FAILED_PRECONDITION: engine unusable, "
                                           r"restart the rollout server: .*restoring failed too") as err:
        client.push_weights(_good(2.0), version=2)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert health() == health_pb2.HealthCheckResponse.NOT_SERVING  # supervisors and new clients see it
    calls = engine.generate_calls
    with pytest.raises(RolloutError, match=r"Generate on .*: FAILED_PRECONDITION: engine unusable, restart the "
                                           r"rollout server: WeightReloadError: .*restoring failed too") as err:
        client.generate([[1]], SamplingSpec(max_tokens=2))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert engine.generate_calls == calls  # refused by the server, and not retried: only a restart can help
    # A push repeating the one in service never reaches the engine: it answered OK on this dead server
    with pytest.raises(RolloutError, match=r"FAILED_PRECONDITION: engine unusable") as err:
        client.push_weights(_good(), version=1)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as raw:
        stub.Generate(_req(max_tokens=2), timeout=10)
    assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(raw.value.trailing_metadata())[ERROR_KIND_KEY] == ENGINE_UNUSABLE


def test_other_engine_errors_are_internal_naming_the_rpc(failing, monkeypatch):
    engine, _, client, _, _ = failing

    def broken(prompts, spec):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engine, "generate", broken)
    with pytest.raises(RolloutError, match="Generate on .*: INTERNAL: engine error in Generate: "
                                           "RuntimeError: kernel exploded") as err:
        client.generate([[1]], SamplingSpec(max_tokens=2))
    assert err.value.code == grpc.StatusCode.INTERNAL


def test_client_stale_versions_and_compatibility(served):
    engine, server, _ = served
    client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=10)
    client.push_weights({"w": np.ones((4, 4), np.float64), "b": np.zeros(3)}, 2)  # client casts to float32
    assert engine.weights["w"].dtype == np.float32 and engine.version == 2
    assert client.generate([[1]], SamplingSpec(max_tokens=2))[0][0].weight_version == 2
    engine.reported_version = 1  # as if a completion had been sampled before the push landed
    with pytest.raises(StaleCompletionError, match="weight version 1"):
        client.generate([[1]], SamplingSpec(max_tokens=2))
    engine.reported_version = 3  # weights another writer pushed after ours: trained on as ours, lag -1
    with pytest.raises(ForeignCompletionError, match="weight version 3, newer than this trainer's last push 2"):
        client.generate([[1]], SamplingSpec(max_tokens=2))
    client.max_staleness = None  # tag mode: accepted, the version is the tag
    assert client.generate([[1]], SamplingSpec(max_tokens=2))[0][0].weight_version == 3
    engine.reported_version = 1
    assert client.generate([[1]], SamplingSpec(max_tokens=2))[0][0].weight_version == 1
    client.check_compatible(architecture="FakeForCausalLM", vocab_size=32, tokenizer_vocab_size=30)
    with pytest.raises(EngineMismatchError, match="architecture.*vocab_size"):
        client.check_compatible(architecture="Qwen3ForCausalLM", vocab_size=64)
    with pytest.raises(EngineMismatchError, match="tokenizer has 40 tokens"):
        client.check_compatible(architecture="FakeForCausalLM", vocab_size=32, tokenizer_vocab_size=40)
    with pytest.raises(EngineMismatchError, match="unknown to the engine"):
        client.push_weights({**_good(), "lm_head.weight": np.ones(2, np.float32)}, 3)
    client.shutdown()
    assert server.stop_event.wait(5)


def test_client_gives_up_waiting_with_a_clear_error():
    port = free_port()  # a port nobody listens on
    from jaxrl_mismatch.rollout.client import RolloutError

    with pytest.raises(RolloutError, match=f"127.0.0.1:{port} not ready after 1s"):
        RolloutClient(f"127.0.0.1:{port}", wait_ready_s=1.0)


def test_a_host_name_that_does_not_resolve_is_said_at_once(caplog):
    """A typo'd --address host waited the whole startup timeout (600 s) looking like a slow start; the wait stays
    (a cluster's service name can appear later), but the first failed lookup is logged, once."""
    from jaxrl_mismatch.rollout.client import RolloutError

    caplog.set_level("WARNING", logger="jaxrl_mismatch.rollout.client")
    with pytest.raises(RolloutError, match="nosuchhost.invalid:1 not ready after 2s"):
        RolloutClient("nosuchhost.invalid:1", wait_ready_s=2.0)
    said = [r.getMessage() for r in caplog.records if "does not resolve" in r.getMessage()]
    assert len(said) == 1 and "nosuchhost.invalid:1" in said[0] and "waiting up to 2s" in said[0]
    caplog.clear()
    with pytest.raises(RolloutError):  # a host that resolves, nobody listening: no such line
        RolloutClient(f"127.0.0.1:{free_port()}", wait_ready_s=1.0)
    assert not [r for r in caplog.records if "does not resolve" in r.getMessage()]


class _CountingGetInfo:
    """Wraps a client's GetInfo stub to count the attempts one call makes."""

    def __init__(self, client):
        self.attempts, self._rpc = 0, client._stub.GetInfo
        client._stub.GetInfo = self

    def __call__(self, *args, **kwargs):
        self.attempts += 1
        return self._rpc(*args, **kwargs)


def test_a_server_that_used_up_a_calls_retries_gets_one_attempt_per_call_until_it_answers():
    """The async trainer's push after its producer's failed Generate must not wait a second retry budget;
    once the server answers again, a later outage gets its full budget back."""
    from jaxrl_mismatch.rollout.client import RetryPolicy

    port = free_port()
    client = RolloutClient(f"127.0.0.1:{port}", token=TOKEN, wait_ready_s=None,
                           retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.01))
    calls = _CountingGetInfo(client)
    with pytest.raises(RolloutError, match="UNAVAILABLE after 3 attempts"):
        client.info()
    assert calls.attempts == 3
    with pytest.raises(RolloutError, match="UNAVAILABLE, still unreachable"):
        client.info()
    assert calls.attempts == 4
    server = RolloutServer(port=port, token=TOKEN)
    server.attach(FakeEngine())
    try:
        client.wait_until_ready(30)
        assert client.info().vocab_size == 32
    finally:
        server.stop(0)
    calls.attempts = 0
    with pytest.raises(RolloutError, match="UNAVAILABLE after 3 attempts"):
        client.info()
    assert calls.attempts == 3
    client.close()


@pytest.mark.parametrize("alive, attempts", [(False, 1), (True, 3)])
def test_a_launched_server_whose_process_exited_is_not_retried(alive, attempts):
    from jaxrl_mismatch.rollout.client import RetryPolicy

    client = RolloutClient(f"127.0.0.1:{free_port()}", wait_ready_s=None, alive=lambda: alive,
                           retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.01))
    calls = _CountingGetInfo(client)
    with pytest.raises(RolloutError, match="process has exited" if not alive else "after 3 attempts"):
        client.info()
    assert calls.attempts == attempts
    client.close()


def test_a_retry_time_budget_bounds_the_attempts_whatever_their_count():
    """`rollout.retry_s` reaches the client as `RetryPolicy.within`: 0 s is one attempt, a budget shorter than
    the first backoff too; with no count limit, a 0.3 s budget of 10 ms backoffs retries many times, then stops."""
    from jaxrl_mismatch.rollout.client import RetryPolicy

    many = RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.01, max_elapsed_s=0.3)
    for policy, ok in [(RetryPolicy.within(0), lambda n: n == 1), (RetryPolicy.within(0.05), lambda n: n == 1),
                       (many, lambda n: n > 3)]:
        client = RolloutClient(f"127.0.0.1:{free_port()}", wait_ready_s=None, retry=policy)
        calls = _CountingGetInfo(client)
        with pytest.raises(RolloutError, match=r"UNAVAILABLE after \d+ attempts"):
            client.info()
        assert ok(calls.attempts), (policy, calls.attempts)
        client.close()


def test_the_retry_time_budget_starts_at_the_first_failure_not_at_the_call():
    """A Generate can run for minutes before its server dies: `rollout.retry_s` is how long the client then
    retries, so a first attempt longer than the whole budget must not use it up."""
    import time

    from jaxrl_mismatch.rollout.client import RetryPolicy

    client = RolloutClient(f"127.0.0.1:{free_port()}", wait_ready_s=None,
                           retry=RetryPolicy(max_attempts=None, initial_backoff_s=0.01, max_backoff_s=0.01,
                                             max_elapsed_s=0.3))
    calls = _CountingGetInfo(client)
    refused = calls._rpc

    def slow_first_attempt(*args, **kwargs):
        if calls.attempts == 1:
            time.sleep(0.5)  # the call's own work outlasts the 0.3 s budget, then the server is gone
        return refused(*args, **kwargs)

    calls._rpc = slow_first_attempt
    t0 = time.monotonic()
    with pytest.raises(RolloutError, match=r"UNAVAILABLE after \d+ attempts"):
        client.info()
    assert calls.attempts > 3  # retried after the slow failure (the old budget, counted from the start: 1)
    assert time.monotonic() - t0 >= 0.5 + 0.25  # and for about the budget, after it
    client.close()


def test_server_refuses_to_start_without_a_token(monkeypatch, tmp_path):
    from jaxrl_mismatch.rollout.protocol import TOKEN_ENV
    from jaxrl_mismatch.rollout.server import read_token
    from jaxrl_mismatch.usage import UsageError

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(UsageError, match=r"\$JAXRL_ROLLOUT_TOKEN is empty or unset"):
        read_token(None)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UsageError, match="--token-file .*empty is empty or unset"):
        read_token(str(tmp_path / "empty"))
    with pytest.raises(UsageError, match="--token-file .*missing: does not exist"):
        read_token(str(tmp_path / "missing"))
    monkeypatch.setenv(TOKEN_ENV, " abc \n")
    assert read_token(None) == "abc"


def test_health_is_not_serving_until_the_engine_is_attached():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = RolloutServer(port=0, token=TOKEN)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        health = health_pb2_grpc.HealthStub(channel)
        check = lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status  # noqa: E731
        assert check() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            rollout_pb2_grpc.RolloutStub(channel).Generate(_req(max_tokens=1), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        server.attach(FakeEngine())
        assert check() == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_client_casts_to_the_engines_bfloat16_wire_dtype():
    import ml_dtypes

    engine = FakeEngine()
    bf16 = np.dtype(ml_dtypes.bfloat16)
    engine.weights = {"w": np.zeros((4, 4), bf16), "b": np.zeros(3, bf16)}
    server = RolloutServer(port=0, token=TOKEN)
    server.attach(engine)
    try:
        client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=10, chunk_bytes=6)
        master = {"w": np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4) * np.float32(1 / 3),
                  "b": np.array([1e-3, 2.0, -7.25], np.float32)}
        client.push_weights(master, version=1)
        for k, v in master.items():
            assert engine.weights[k].dtype == bf16
            np.testing.assert_array_equal(engine.weights[k], v.astype(bf16))  # round-to-nearest, like a load
        client.close()
    finally:
        server.stop(0)


def test_client_reports_the_servers_request_limits_and_split_requests_fit(served):
    """The session splits Generate by the limits the server reports, not by defaults."""
    from jaxrl_mismatch.rollout import RolloutClient, SamplingSpec
    from jaxrl_mismatch.rollout.session import RolloutSession, request_chunks

    _, server, _ = served
    client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=10)
    with RolloutSession(client, restart=False) as session:
        limits = session.limits
        assert (limits.max_request_prompt_tokens, limits.max_request_completion_tokens) == (1000, 10_000)
        prompts = [[1, 2, 3]] * 40
        spec = SamplingSpec(n=5, max_tokens=60)  # 40 × 300 = 12,000 completion tokens: one request is too big
        assert len(request_chunks(prompts, spec, limits)) == 2
        outs = session.generate(prompts, spec)  # two requests, each within the limits
        assert len(outs) == 40 and all(len(g) == 5 for g in outs)


def test_a_float_tensor_is_not_cast_into_an_integer_spec_and_another_byte_order_is_sent():
    """A float pushed to an int8 spec was truncated and wrapped (1.7, -3.9, 300 → 1, -3, 44) and served; a
    big-endian uint16 tensor, the same values, was refused."""
    engine = FakeEngine()
    engine.weights = {"w": np.zeros(3, np.int8), "b": np.zeros(2, np.uint16)}
    server = RolloutServer(port=0, token=TOKEN)
    server.attach(engine)
    try:
        client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=10)
        with pytest.raises(EngineMismatchError, match=r"tensor 'w': dtype float32 cannot be sent as int8"):
            client.push_weights({"w": np.array([1.7, -3.9, 300], np.float32), "b": np.zeros(2, np.uint16)}, version=1)
        assert engine.weights["w"].tolist() == [0, 0, 0]
        client.push_weights({"w": np.array([1, -3, 44], np.int8), "b": np.array([7, 513], ">u2")}, version=1)
        assert engine.weights["w"].tolist() == [1, -3, 44] and engine.weights["b"].tolist() == [7, 513]
        client.close()
    finally:
        server.stop(0)


def test_a_server_restarted_with_tighter_limits_before_a_generate_gets_requests_it_takes():
    """Restarted between a push and a Generate with a smaller per-request limit, the server refused the session's
    chunks (INVALID_ARGUMENT) before any Generate could report its new id: every Generate failed until the next
    push. A refused call now asks GetInfo whether the server changed; the session recovers (re-push, new limits)
    and the retry is split under them, sampling the same completions."""
    from jaxrl_mismatch.rollout.session import RolloutSession

    server = RolloutServer(port=0, token=TOKEN)
    server.attach(FakeEngine())
    port = server.port
    client = RolloutClient(f"127.0.0.1:{port}", token=TOKEN, wait_ready_s=10)
    session = RolloutSession(client, restart=False)
    session.push({"w": np.arange(16, dtype=np.float32).reshape(4, 4), "b": np.ones(3, np.float32)})
    prompts, spec = [[1, 2]] * 20, SamplingSpec(n=3, max_tokens=4)
    before = session.generate(prompts, spec)
    server.stop(0)
    engine = FakeEngine()
    server = RolloutServer(port=port, token=TOKEN, limits=Limits(max_request_completion_tokens=36))  # 3 prompts
    server.attach(engine)
    try:
        after = session.generate(prompts, spec)
        assert after == before and engine.version == 1 and engine.update_calls == 1
        assert session.restarts == 1 and session.limits.max_request_completion_tokens == 36
        with pytest.raises(RolloutError, match="INVALID_ARGUMENT"):  # a request refused for itself still is
            session.generate([[1, 99]], spec)
        assert session.restarts == 1
        session.close()
        # A new session's first call refused for itself is no restart (`_restarted_unseen` also ignores a client
        # that has read no server id yet; the real client reads it when it connects)
        fresh = RolloutSession(RolloutClient(f"127.0.0.1:{port}", token=TOKEN, wait_ready_s=10), restart=False)
        with pytest.raises(RolloutError, match="INVALID_ARGUMENT"):
            fresh.generate([[1, 99]], spec)
        assert fresh.restarts == 0
        fresh.close()
    finally:
        server.stop(0)
