"""`RolloutClient`: a typed, retrying stub of one rollout server (transport only, no policy).

What it guarantees its caller (normally `rollout.session.RolloutSession`, which owns the recovery policy):

- **Ready before use.** The constructor waits for the standard gRPC health check to report SERVING.
- **Transient failures are retried** (UNAVAILABLE; DEADLINE_EXCEEDED except for Generate, whose abandoned work the
  server stops, and which would only outrun its deadline again; RESOURCE_EXHAUSTED marked `server-busy`, a server
  whose `--max-concurrent-generates` other callers fill) with exponential backoff; every
  call has a deadline. Generate is safe to repeat: with a fixed seed it is deterministic.
- **A server known to be gone is not waited for twice.** Once a call has spent its whole retry budget on
  UNAVAILABLE, later calls try once until one succeeds (or `wait_until_ready` sees the server again): the
  trainer's push after its producer's failed Generate reports at once instead of after a second budget.
  For a server this process launched, `alive` stops the retries as soon as its process has exited.
- **A restarted server is noticed.** Each server process has a random `server_id`, returned by GetInfo
  and every Generate. When it changes, `generate` raises `ServerRestartedError` instead of returning
  completions sampled by the new process (which serves its checkpoint weights, not the pushed ones):
  the caller re-pushes its weights and asks again.
- **Every completion's weight version is checked** against the version the trainer pushed last:
  older than `max_staleness` versions -> StaleCompletionError, newer than it (weights another writer pushed)
  -> ForeignCompletionError; `max_staleness=None` accepts any and
  leaves `Completion.weight_version` as the tag for off-policy correction.
- **Non-finite log-probs never reach the trainer**: NonFiniteLogprobsError names prompt, sample, position
  (raised from the server's report, and checked again on every response).
- **Engine and trainer must agree** on architecture, vocabulary and tokenizer: `check_compatible`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxrl_mismatch.rollout import protocol, rollout_pb2, rollout_pb2_grpc
from jaxrl_mismatch.rollout.engine import (
    Completion,
    EngineInfo,
    NonFiniteLogprobsError,
    SamplingSpec,
    TensorSpec,
    check_finite_logprobs,
)
from jaxrl_mismatch.rollout import shm
from jaxrl_mismatch.rollout.protocol import (
    DEFAULT_CHUNK_BYTES,
    ERROR_KIND_KEY,
    MAX_MESSAGE_BYTES,
    NON_FINITE,
    NON_FINITE_DETAIL_KEY,
    SERVER_BUSY,
    SERVICE_NAME,
    SHM_UNREACHABLE,
    Limits,
    is_printable_ascii,
    weight_chunks,
    wire_dtype,
)

log = logging.getLogger(__name__)


def _unresolved(e: grpc.RpcError) -> bool:
    """The call failed because the target's host name did not resolve (gRPC's resolver message)."""
    details = (e.details() or "").lower()
    return e.code() == grpc.StatusCode.UNAVAILABLE and ("resolving" in details or "dns resolution" in details)


_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # gRPC's default reconnect backoff grows to 120 s; a restarted rollout server should be found in ~1 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def _error_kind(e: grpc.RpcError) -> str | None:
    """The server's `jaxrl-error` trailing metadata, if any."""
    try:
        return dict(e.trailing_metadata() or ()).get(ERROR_KIND_KEY)
    except Exception:  # noqa: BLE001 - an RpcError that is not a call (no trailing metadata) has no kind
        return None


class RolloutError(RuntimeError):
    """The rollout server failed a call in a way retries did not fix; the message names the RPC and status.

    `code` is the gRPC status when the server answered with one (None for client-side errors), so the
    trainer can tell what state the server is in without parsing messages: INVALID_ARGUMENT (the call
    was refused, nothing changed), INTERNAL (the engine failed; after a failed weight push the previous
    weights are still served and the push may be retried), FAILED_PRECONDITION (the engine is unusable:
    restart the server; this client re-pushes the weights once it sees the new process).
    """

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, kind: str | None = None):
        super().__init__(message)
        self.code = code
        self.kind = kind  # the server's `jaxrl-error` trailing metadata, if any


class EngineMismatchError(RolloutError):
    """The engine serves a different model than the trainer trains (architecture, vocab, tokenizer)."""


class StaleCompletionError(RolloutError):
    """A completion was sampled with weights older than the client accepts."""


class ForeignCompletionError(RolloutError):
    """A completion was sampled with a weight version newer than this client's last push: weights another writer
    pushed to the server, which the trainer would otherwise train on as its own (a version lag below 0)."""


class ServerRestartedError(RolloutError):
    """The server process changed (new `server_id`) since the last call: it serves its checkpoint weights.

    Nothing it answered is returned; the caller pushes its current weights again and repeats the call.
    """


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Jittered exponential backoff; a call gives up after `max_attempts` attempts (None: no count limit) or
    when its next wait would end more than `max_elapsed_s` after its first failure (None: no time limit).
    The default, 8 attempts, waits about 11 s in all; the trainer's is `within(config.rollout.retry_s)`."""

    max_attempts: int | None = 8
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    max_elapsed_s: float | None = None

    @classmethod
    def within(cls, seconds: float) -> RetryPolicy:
        """Retry for up to `seconds` (0: one attempt), whatever the number of attempts."""
        return cls(max_attempts=None, max_elapsed_s=float(seconds))

    def delays(self) -> Iterator[float]:
        """Backoff before attempt 2, 3, ...; jittered by ±20% so restarted clients do not stampede."""
        d = self.initial_backoff_s
        attempts = itertools.count() if self.max_attempts is None else range(self.max_attempts - 1)
        for _ in attempts:
            yield d * random.uniform(0.8, 1.2)
            d = min(d * self.multiplier, self.max_backoff_s)


class RolloutClient:
    """Blocking client of one rollout server. Not thread-safe; one per trainer process is enough.

    Args:
      target: "host:port" of the server.
      token: shared token for UpdateWeights/Shutdown (None: read-only client); printable ASCII (gRPC metadata),
        else ValueError naming `token`.
      timeout_s: deadline of GetInfo/Shutdown and of each UpdateWeights stream.
      generate_timeout_s: deadline of one Generate call.
      retry: backoff policy for UNAVAILABLE / DEADLINE_EXCEEDED / a busy server (RESOURCE_EXHAUSTED `server-busy`).
      max_staleness: completions more than this many versions older than the last pushed version raise
        StaleCompletionError; None accepts all (tag = `Completion.weight_version`).
      wait_ready_s: wait this long for the health check at construction; None skips the wait.
      alive: for a server this process launched, a check that its process still runs: retrying a dead
        process is pointless, so its first UNAVAILABLE raises (the session then restarts it).
      chunk_bytes: UpdateWeights chunk size.
      weight_transport: "auto" (shared memory when the server is on this host, rollout/shm.py; else the
        gRPC stream), "shm" (shared memory or fail) or "grpc" (always the stream).
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        generate_timeout_s: float = 600.0,
        retry: RetryPolicy = RetryPolicy(),
        max_staleness: int | None = 0,
        wait_ready_s: float | None = 120.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        weight_transport: str = "auto",
        alive: Callable[[], bool] | None = None,
    ):
        if weight_transport not in shm.TRANSPORTS:
            raise ValueError(f"weight_transport: {weight_transport!r} is not one of {shm.TRANSPORTS}")
        if token is not None and not is_printable_ascii(token):
            # gRPC refuses such metadata at every push ("Invalid metadata"); say so once, here, without the token.
            raise ValueError("token: must be printable ASCII (it travels as gRPC metadata 'authorization: Bearer "
                             "<token>'); the one given has other characters")
        self.target = target
        self._token = token
        self._timeout_s = timeout_s
        self._generate_timeout_s = generate_timeout_s
        self._retry = retry
        self._alive = alive
        self._unreachable = False  # the last call spent its retries on UNAVAILABLE; none has succeeded since
        self.max_staleness = max_staleness
        self._chunk_bytes = chunk_bytes
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.pushed_version: int | None = None  # version of the last successful push
        self.weights_lost = False  # the server restarted after our last push and serves its checkpoint
        self.server_id: str | None = None
        self._weight_specs: dict[str, TensorSpec] | None = None
        self.restarts_seen = 0
        self.weight_transport = weight_transport
        self._server_host_id = ""  # the server's GetInfoResponse.shm_host_id
        self._seen: rollout_pb2.GetInfoResponse | None = None  # the last GetInfo read (its limits, vocab_size)
        self.last_push_transport: str | None = None  # "shm" or "grpc": how the last push travelled
        self._shm: shm.ShmWriter | None = None  # created at the first shared-memory push
        if wait_ready_s is not None:
            try:
                self.wait_until_ready(wait_ready_s)
                self._sync_server()
            except BaseException:
                self._channel.close()  # nobody holds this client to close it
                raise

    # -- plumbing ------------------------------------------------------------------------------------
    def close(self) -> None:
        self._channel.close()
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _auth(self) -> tuple[tuple[str, str], ...]:
        if self._token is None:
            raise RolloutError("this RPC needs the shared token; construct RolloutClient(..., token=...)")
        return (("authorization", f"Bearer {self._token}"),)

    def _call(self, what: str, fn: Callable[[], object], *, retry_deadline: bool = True) -> object:
        """Run fn with retries on transient codes; after a failure, resync with the (maybe new) server.

        A server that a previous call found unreachable through its whole budget, or whose launched process
        has exited, gets one attempt: the caller (session, trainer) decides what to do, now. Without
        `retry_deadline` a DEADLINE_EXCEEDED is final: a Generate that outran its deadline would only outrun it
        again, and every retry used to start the whole generation over while the abandoned one still ran.
        """
        delays = self._retry.delays()
        attempts, give_up_at = 0, None
        while True:
            attempts += 1
            try:
                out = fn()
                self._unreachable = False
                return out
            except grpc.RpcError as e:
                code = e.code()
                busy = code == grpc.StatusCode.RESOURCE_EXHAUSTED and _error_kind(e) == SERVER_BUSY
                if code not in _RETRYABLE and not busy:
                    raise self._translate(what, e) from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and not retry_deadline:
                    raise RolloutError(f"{what} on {self.target}: DEADLINE_EXCEEDED after {attempts} attempt(s): "
                                       f"{e.details()}; not retried (the server stops the abandoned work; raise the "
                                       "timeout, e.g. rollout.generate_timeout_s, or send smaller requests)",
                                       code=code) from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    if self._unreachable:
                        raise RolloutError(f"{what} on {self.target}: UNAVAILABLE, still unreachable (an earlier "
                                           f"call used up its retries): {e.details()}", code=code) from None
                    if self._alive is not None and not self._alive():
                        raise RolloutError(f"{what} on {self.target}: UNAVAILABLE, the server process has exited: "
                                           f"{e.details()}", code=code) from None
                if give_up_at is None and self._retry.max_elapsed_s is not None:
                    # The budget starts at the first failure: a long Generate that dies late still gets it.
                    give_up_at = time.monotonic() + self._retry.max_elapsed_s
                delay = next(delays, None)
                if delay is not None and give_up_at is not None and time.monotonic() + delay > give_up_at:
                    delay = None
                if delay is None:
                    self._unreachable = code == grpc.StatusCode.UNAVAILABLE
                    raise RolloutError(f"{what} on {self.target}: {code.name} after {attempts} attempts: {e.details()}",
                                       code=code, kind=_error_kind(e)) from None
                log.warning("%s on %s: %s (%s); retrying in %.2fs", what, self.target, code.name, e.details(), delay)
                time.sleep(delay)

    def _translate(self, what: str, e: grpc.RpcError) -> Exception:
        trailing = dict(e.trailing_metadata() or ())
        if trailing.get(ERROR_KIND_KEY) == NON_FINITE and NON_FINITE_DETAIL_KEY in trailing:
            detail = trailing[NON_FINITE_DETAIL_KEY]
            try:
                i, j, t, value, version = detail.split(",")
                return NonFiniteLogprobsError(int(i), int(j), int(t), float(value), int(version))
            except ValueError:  # a server not keeping the protocol: its own words, not an unpacking error
                return RolloutError(f"{what} on {self.target}: {e.code().name}: {e.details()} (malformed "
                                    f"{NON_FINITE_DETAIL_KEY} {detail!r})", code=e.code(), kind=NON_FINITE)
        return RolloutError(f"{what} on {self.target}: {e.code().name}: {e.details()}", code=e.code(),
                            kind=trailing.get(ERROR_KIND_KEY))

    # -- health / info -------------------------------------------------------------------------------
    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until the health service reports SERVING (engine loaded), or raise RolloutError."""
        deadline = time.monotonic() + timeout_s
        delays = RetryPolicy(max_attempts=1 << 30, initial_backoff_s=0.05, max_backoff_s=1.0).delays()
        last = "no answer"
        while True:
            try:
                resp = self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    self._unreachable = False
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as e:
                if last == "no answer" and _unresolved(e):
                    # Waiting is right for a host that appears later (a cluster's service name), but a typo'd host
                    # should not look like a slow start for the whole wait: say so at once.
                    log.warning("rollout server %s: its host name does not resolve (%s); waiting up to %.0fs for it",
                                self.target, e.details(), timeout_s)
                last = f"{e.code().name}: {e.details()}"
            if time.monotonic() >= deadline:
                raise RolloutError(f"rollout server {self.target} not ready after {timeout_s:.0f}s (last: {last})")
            time.sleep(min(next(delays), max(0.0, deadline - time.monotonic())))

    def _get_info(self, include_weight_specs: bool) -> rollout_pb2.GetInfoResponse:
        req = rollout_pb2.GetInfoRequest(include_weight_specs=include_weight_specs)
        return self._call("GetInfo", lambda: self._stub.GetInfo(req, timeout=self._timeout_s))

    def info(self) -> EngineInfo:
        """What the server serves; also records its process id and shared-memory host, as a push's sync does."""
        return protocol.info_from_proto(self._sync_server())

    def request_limits(self) -> Limits:
        """The server's per-request token limits (a larger Generate must be split by the caller)."""
        return protocol.limits_from_proto(self._get_info(False))

    def current_limits(self) -> Limits:
        """`request_limits` of the server process seen last, from the GetInfo that saw it when there was one."""
        if (seen := self._seen_now()) is not None:
            return protocol.limits_from_proto(seen)
        return self.request_limits()

    def weight_specs(self) -> dict[str, TensorSpec]:
        """HF name -> (shape, wire dtype) the engine expects in UpdateWeights (cached per server process)."""
        if self._weight_specs is None:
            self._weight_specs = protocol.weight_specs_from_proto(self._get_info(True))
        return self._weight_specs

    def check_compatible(
        self, *, architecture: str, vocab_size: int, tokenizer_vocab_size: int | None = None
    ) -> EngineInfo:
        """Fail early, with both values in the message, if the engine serves a model the trainer can't score.

        The tokenizer may be smaller than the model's (padded) embedding table but never larger: its
        extra ids would be out of range for the engine. Pass `ModelConfig.architecture/.vocab_size`.
        """
        info = self.info()
        problems = []
        if info.architecture != architecture:
            problems.append(f"architecture: engine serves {info.architecture!r}, trainer has {architecture!r}")
        if info.vocab_size != vocab_size:
            problems.append(f"vocab_size: engine {info.vocab_size}, trainer model {vocab_size}")
        if tokenizer_vocab_size is not None and tokenizer_vocab_size > info.vocab_size:
            problems.append(
                f"tokenizer has {tokenizer_vocab_size} tokens but the engine's vocab_size is {info.vocab_size}"
            )
        if problems:
            raise EngineMismatchError(f"rollout engine at {self.target} does not match the trainer: " + "; ".join(problems))
        return info

    # -- restarts ------------------------------------------------------------------------------------
    def _observe_server(self, server_id: str) -> bool:
        """Record the server process id; True if it changed since the last one seen (a restart)."""
        if server_id == self.server_id:
            return False
        first = self.server_id is None
        self.server_id = server_id
        self._weight_specs = None
        if first:
            return False
        self.restarts_seen += 1
        # Whoever notices the restart first (GetInfo, a push, a Generate), the pushed weights are gone
        # until the next successful push: `generate` refuses to return completions until then.
        self.weights_lost = self.pushed_version is not None
        log.warning("rollout server %s restarted (new server_id %s)", self.target, server_id)
        return True

    def _sync_server(self) -> rollout_pb2.GetInfoResponse:
        r = self._get_info(False)
        self._observe_server(r.server_id)
        self._server_host_id = r.shm_host_id
        self._seen = r
        return r

    def _seen_now(self) -> rollout_pb2.GetInfoResponse | None:
        """The last GetInfo read if it came from the server process seen last (else a restart made it stale)."""
        return self._seen if self._seen is not None and self._seen.server_id == self.server_id else None

    # -- weights -------------------------------------------------------------------------------------
    def push_weights(self, tensors: Mapping[str, np.ndarray], version: int, *, synced: bool = False) -> None:
        """Stream HF-named tensors to the server as weight `version`; returns once they are in service.

        Floating tensors are cast to the dtype the engine expects (e.g. float32 master weights to a
        bfloat16 engine, round-to-nearest-even like a checkpoint load); the tensor set is checked
        against the engine's before any byte is sent. The push first reads the server's GetInfo (a restart
        since the last call, its shared-memory host); `synced=True`: the caller has just called `info()`,
        which read and recorded the same, so the push does not ask again.
        """
        if not synced:
            self._sync_server()
        self._push(tensors, version)

    def _push(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        specs = self.weight_specs()
        unknown = sorted(set(tensors) - set(specs))
        missing = sorted(set(specs) - set(tensors))
        if unknown or missing:
            raise EngineMismatchError(
                f"weights do not match the engine's tensor set: unknown to the engine {unknown[:5]}, "
                f"missing {missing[:5]} ({len(unknown)} unknown, {len(missing)} missing)"
            )
        wire = {}
        for name, t in tensors.items():
            arr, spec = np.asarray(t), specs[name]
            if tuple(arr.shape) != spec.shape:
                raise EngineMismatchError(f"tensor {name!r}: shape {arr.shape} != engine's {spec.shape}")
            want = wire_dtype(spec.dtype)
            if arr.dtype != want:
                # float to float rounds as the engine's precision says; another byte order is the same values. A
                # float into an integer spec truncated and wrapped (1.7, 300 → 1, 44 in int8): refused.
                floats = all(np.issubdtype(d, np.floating) or d.name == "bfloat16" for d in (arr.dtype, want))
                if not (floats or arr.dtype.newbyteorder("=") == want):
                    raise EngineMismatchError(f"tensor {name!r}: dtype {arr.dtype} cannot be sent as {spec.dtype}")
                arr = arr.astype(want)
            wire[name] = arr
        md = self._auth()
        if self._use_shm():
            resp = self._push_shm(wire, version, md)
            if resp is not None:
                self.pushed_version, self.weights_lost, self.last_push_transport = resp.weight_version, False, "shm"
                return
        resp = self._call(
            "UpdateWeights",
            lambda: self._stub.UpdateWeights(
                weight_chunks(wire, version, chunk_bytes=self._chunk_bytes), timeout=self._timeout_s, metadata=md
            ),
        )
        self.pushed_version, self.weights_lost, self.last_push_transport = resp.weight_version, False, "grpc"

    def _use_shm(self) -> bool:
        if self.weight_transport == "grpc":
            return False
        local = shm.is_local_target(self.target) and bool(self._server_host_id) and self._server_host_id == shm.host_id()
        if self.weight_transport == "shm" and not local:
            why = ("the server does not offer shared memory" if not self._server_host_id else
                   "the server is on another host" if self._server_host_id != shm.host_id() else
                   "the address is not loopback")
            raise RolloutError(f"weight_transport 'shm': cannot push to {self.target} through shared memory ({why}); "
                               "use 'auto' or 'grpc'")
        return local

    def _push_shm(self, wire: dict[str, np.ndarray], version: int, md) -> rollout_pb2.UpdateWeightsResponse | None:
        """Push through shared memory; None (after a warning) when the server cannot open it and mode is auto."""
        try:
            if self._shm is None:
                self._shm = shm.ShmWriter()
            msg = self._shm.write(wire, version)
        except OSError as e:  # no memory for the buffer, a file-size limit: the stream still works
            if self._shm is not None:
                self._shm.close()
                self._shm = None
            if self.weight_transport == "shm":
                raise RolloutError(f"weight_transport 'shm': cannot write the shared-memory buffer for "
                                   f"{self.target} ({e.strerror or e}); use 'auto' or 'grpc'") from e
            log.warning("shared-memory buffer for %s could not be written (%s); using the gRPC stream from now on",
                        self.target, e.strerror or e)
            self.weight_transport = "grpc"
            return None
        try:
            return self._call("UpdateWeightsShm",
                              lambda: self._stub.UpdateWeightsShm(msg, timeout=self._timeout_s, metadata=md))
        except RolloutError as e:
            # An abandoned handler (a deadline passed) may still be reading this buffer: the next push must not
            # rewrite it under the server, or a version would be applied as a mix of two pushes' bytes.
            self._shm.close()
            self._shm = None
            unreachable = e.kind == SHM_UNREACHABLE or e.code == grpc.StatusCode.UNIMPLEMENTED
            if self.weight_transport == "shm" or not unreachable:
                raise
            log.warning("shared-memory push to %s failed (%s); using the gRPC stream from now on", self.target, e)
            self.weight_transport = "grpc"
            return None

    # -- generation ----------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], spec: SamplingSpec = SamplingSpec(), *, min_version: int | None = None
    ) -> list[list[Completion]]:
        """Sample spec.n completions per prompt; result[i][j] is sample j of prompt i.

        min_version: the oldest acceptable weight version (default: the last pushed version minus
        `max_staleness`; no check before the first push).
        """
        req = protocol.request_to_proto(prompts, spec)
        size = req.ByteSize()
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"prompts: the request is {size} bytes, over the {MAX_MESSAGE_BYTES}-byte message limit; split the batch")
        try:
            resp = self._call("Generate", lambda: self._stub.Generate(req, timeout=self._generate_timeout_s),
                              retry_deadline=False)
        except NonFiniteLogprobsError as e:
            raise self._non_finite(e, spec) from None
        # Completions from a process that has not received our weights are thrown away.
        if self._observe_server(resp.server_id) or self.weights_lost:
            raise ServerRestartedError(f"Generate on {self.target}: the server restarted (new server_id "
                                       f"{resp.server_id}); push the weights again and retry")
        try:
            completions = protocol.completions_from_proto(resp)
        except protocol.MalformedMessageError as e:
            raise RolloutError(f"Generate on {self.target}: {e}") from None
        if len(completions) != len(prompts) or any(len(s) != spec.n for s in completions):
            raise RolloutError(f"Generate on {self.target}: response shape does not match {len(prompts)} prompts x n={spec.n}")
        self._check_completion_tokens(completions, spec)
        if spec.return_routing:
            for i, samples in enumerate(completions):
                for j, c in enumerate(samples):
                    if c.routing is None or c.routing.shape[0] != len(prompts[i]) + len(c.token_ids):
                        got = "none" if c.routing is None else f"{c.routing.shape[0]} tokens"
                        raise RolloutError(f"Generate on {self.target}: completion (prompt {i}, sample {j}) has routing "
                                           f"for {got}, expected {len(prompts[i]) + len(c.token_ids)} (prompt + completion)")
        try:
            check_finite_logprobs(completions)
        except NonFiniteLogprobsError as e:
            raise self._non_finite(e, spec) from None
        self._check_versions(completions, min_version)
        return completions

    def _check_completion_tokens(self, completions: list[list[Completion]], spec: SamplingSpec) -> None:
        """A completion longer than `max_tokens`, or holding an id outside the vocabulary of the server process
        seen last (known once a GetInfo read it), breaks the protocol: refused here, naming it, instead of
        reaching the learner as NaN log-probs (an embedding lookup past the table) or the reward as junk."""
        vocab = seen.vocab_size if (seen := self._seen_now()) is not None else None
        for i, samples in enumerate(completions):
            for j, c in enumerate(samples):
                if len(c.token_ids) > spec.max_tokens:
                    raise RolloutError(f"Generate on {self.target}: completion (prompt {i}, sample {j}) has "
                                       f"{len(c.token_ids)} tokens, over max_tokens={spec.max_tokens}")
                ids = np.asarray(c.token_ids, dtype=np.int64)
                if vocab is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab):
                    t = int(np.flatnonzero((ids < 0) | (ids >= vocab))[0])
                    raise RolloutError(f"Generate on {self.target}: completion (prompt {i}, sample {j}) has token "
                                       f"id {int(ids[t])} at position {t}, outside the server's vocab_size={vocab}")

    def _non_finite(self, e: NonFiniteLogprobsError, spec: SamplingSpec) -> NonFiniteLogprobsError:
        """`e` (its prompt counted within this request) with the prompt's index in the caller's batch — a split
        batch's piece starts at `spec.prompt_offset` (`session.generate`, the fleet) — and naming this server."""
        return NonFiniteLogprobsError(spec.prompt_offset + e.prompt, e.sample, e.position, e.value, e.weight_version,
                                      where=self.target)

    def _check_versions(self, completions: list[list[Completion]], min_version: int | None) -> None:
        if self.pushed_version is not None and self.max_staleness is not None:
            for i, samples in enumerate(completions):
                for j, c in enumerate(samples):
                    if c.weight_version > self.pushed_version:
                        raise ForeignCompletionError(
                            f"Generate on {self.target}: completion (prompt {i}, sample {j}) has weight version "
                            f"{c.weight_version}, newer than this trainer's last push {self.pushed_version}: another "
                            "writer pushed weights to the server")
        if min_version is None:
            if self.pushed_version is None or self.max_staleness is None:
                return
            min_version = self.pushed_version - self.max_staleness
        for i, samples in enumerate(completions):
            for j, c in enumerate(samples):
                if c.weight_version < min_version:
                    raise StaleCompletionError(
                        f"completion (prompt {i}, sample {j}) has weight version {c.weight_version}, "
                        f"older than the minimum {min_version} (last pushed {self.pushed_version})"
                    )

    # -- admin ---------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Ask the server to stop gracefully (needs the token)."""
        md = self._auth()
        self._call("Shutdown", lambda: self._stub.Shutdown(rollout_pb2.ShutdownRequest(), timeout=self._timeout_s, metadata=md))
