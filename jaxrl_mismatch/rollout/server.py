"""gRPC rollout server: one engine (built-in JAX or vLLM) behind the Rollout service of rollout.proto.

`jaxrl-mismatch serve --engine {jax,vllm} --model DIR --dtype float32 --port N` (see `main`).

Life cycle. The server binds first and answers health checks with NOT_SERVING while the engine loads
(vLLM takes tens of seconds), so a client can connect early and wait; it prints
`JAXRL_ROLLOUT_LISTENING {...}` once bound and `JAXRL_ROLLOUT_READY {...}` (JSON with the port, which
matters for `--port 0`) once the engine serves. SIGTERM, SIGINT or an authenticated Shutdown RPC stop it
gracefully: health turns NOT_SERVING, in-flight calls get a grace period, the engine is closed.

Security. The server binds 127.0.0.1 unless told otherwise, and the mutating RPCs (UpdateWeights,
Shutdown) require `authorization: Bearer <token>` metadata with the shared token (from `--token-file`
or the JAXRL_ROLLOUT_TOKEN environment variable — never a command-line value, which `ps` would show).
Generate and GetInfo are read-only and open to anyone who can reach the port.

Errors. A malformed call is INVALID_ARGUMENT naming the field and never reaches the engine (that
includes pushed weights with NaN/inf values: checked here once, so every engine refuses the same pushes).
An engine's own failures are mapped so that the client knows what state the server is in:

- ValueError (the engine refused a weight set) -> INVALID_ARGUMENT; the old weights stay in service.
- A push of the version in service with other weights (`validation.weights_digest`) -> INVALID_ARGUMENT naming
  `version`: a version names one set of weights. The same weights again (a retry) answer OK, not re-applied.
- NonFiniteLogprobsError -> INTERNAL with `jaxrl-error: non-finite-logprobs` metadata; still serving.
- WeightReloadError(restored=True) -> INTERNAL, `jaxrl-error: weight-reload-failed`; the previous
  weights and version stay in service and the server keeps serving.
- WeightReloadError(restored=False) or EngineUnusableError -> FAILED_PRECONDITION,
  `jaxrl-error: engine-unusable`; health turns NOT_SERVING and every later Generate / UpdateWeights
  fails the same way.
- anything else -> INTERNAL; still serving.

FAILED_PRECONDITION rather than UNAVAILABLE for an unusable engine: clients retry UNAVAILABLE, and no
retry can succeed against this process; only a restart (which reloads the checkpoint) can.

Capacity. At most `max_concurrent_generates` Generate calls run at once (`--max-concurrent-generates`); one more
is answered RESOURCE_EXHAUSTED with `jaxrl-error: server-busy` (the client retries it with backoff). The thread
pool has `RESERVED_WORKERS` threads beyond that cap, so health checks, GetInfo, weight pushes and Shutdown are
answered however long the generations run (before, all RPCs shared 8 threads: 8 long Generates made the health
check time out, as if the server were dead, and the trainer could not push). At most `MAX_CONCURRENT_PUSHES`
authenticated pushes are in the server at once, one more is answered `server-busy` the same way, so waiting pushes
cannot take those threads either (open health Watch streams take none: grpc answers them without blocking). A push
waits for the update lock only while its caller still waits: one whose caller went away (deadline, cancel) is
dropped, never applied late.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hmac
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxrl_mismatch.rollout import rollout_pb2, rollout_pb2_grpc
from jaxrl_mismatch.usage import ArgumentParser, UsageError, existing_dir, existing_file, first_line, port
from jaxrl_mismatch.rollout.engine import (
    ENGINE_DTYPES,
    Engine,
    EngineUnusableError,
    GenerationCancelled,
    NonFiniteLogprobsError,
    WeightReloadError,
    check_finite_logprobs,
)
from jaxrl_mismatch.rollout.protocol import (
    ENGINE_UNUSABLE,
    ERROR_KIND_KEY,
    LISTENING_PREFIX,
    MAX_MESSAGE_BYTES,
    NON_FINITE,
    NON_FINITE_DETAIL_KEY,
    READY_PREFIX,
    SERVER_BUSY,
    SERVICE_NAME,
    SHM_UNREACHABLE,
    TOKEN_ENV,
    WEIGHT_RELOAD_FAILED,
    Limits,
    completions_to_proto,
    info_to_proto,
    is_printable_ascii,
)
from jaxrl_mismatch.rollout import protocol, shm
from jaxrl_mismatch.rollout.validation import (
    RequestError,
    TensorAssembler,
    check_version_weights,
    parse_generate,
    weights_digest,
)

log = logging.getLogger(__name__)


DEFAULT_MAX_CONCURRENT_GENERATES = 8  # the old pool's size: whatever ran concurrently before still does
RESERVED_WORKERS = 8  # threads beyond the Generate cap: health, GetInfo, pushes (one applies, others wait), Shutdown
# Weight pushes in the server at once (streaming, waiting for the update lock, or applying): half the reserved
# threads, so pushes alone can never take the threads health checks, GetInfo and Shutdown answer on.
MAX_CONCURRENT_PUSHES = RESERVED_WORKERS // 2
_LOCK_POLL_S = 0.05  # how often a push waiting for the update lock checks that its caller still waits

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted server must not be able to share the port with a dying one.
    ("grpc.so_reuseport", 0),
]


def _refuse_busy(context: grpc.ServicerContext, message: str) -> NoReturn:
    """RESOURCE_EXHAUSTED marked `server-busy`, which clients retry with backoff (`abort` raises)."""
    context.set_trailing_metadata(((ERROR_KIND_KEY, SERVER_BUSY),))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Validates every call, then delegates to the engine; the engine is attached once it has loaded."""

    def __init__(self, *, token: str, limits: Limits, stop_event: threading.Event,
                 on_engine_unusable: Callable[[], None] | None = None,
                 max_concurrent_generates: int = DEFAULT_MAX_CONCURRENT_GENERATES):
        if not is_printable_ascii(token):
            raise ValueError("token: must be printable ASCII (gRPC metadata carries it)")
        if max_concurrent_generates < 1:
            raise ValueError(f"max_concurrent_generates: must be >= 1, got {max_concurrent_generates}")
        self._token = token.encode()
        self._max_generates = max_concurrent_generates
        self._limits = limits
        self._stop_event = stop_event
        self._on_engine_unusable = on_engine_unusable
        self._engine: Engine | None = None
        self._update_lock = threading.Lock()  # one UpdateWeights at a time keeps versions monotone
        self._served: tuple[int, int] | None = None  # (version, weights_digest) of the last push applied
        self._unusable: str | None = None  # why the engine became unusable (then Generate and pushes refuse)
        self.server_id = uuid.uuid4().hex
        self.shm_host_id = shm.host_id()  # "" where same-host shared memory is not offered
        self._shm_reader = shm.ShmReader()
        self._generating = 0  # Generate handlers admitted (at most the cap), which `wait_generations` waits out
        self._generating_cv = threading.Condition()
        self._pushes = 0  # pushes admitted (at most MAX_CONCURRENT_PUSHES)
        self._pushes_lock = threading.Lock()

    def attach(self, engine: Engine) -> None:
        self._engine = engine

    def wait_generations(self, timeout_s: float) -> bool:
        """Wait until no Generate handler is inside the engine (cancelled ones stop at their next batch);
        False if some still is after `timeout_s`."""
        with self._generating_cv:
            return self._generating_cv.wait_for(lambda: self._generating == 0, timeout=timeout_s)

    # -- helpers -----------------------------------------------------------------------------------
    def _require_engine(self, context: grpc.ServicerContext) -> Engine:
        if self._engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still loading")
        return self._engine

    def _usable_engine(self, context: grpc.ServicerContext) -> Engine:
        """The engine, unless a call found it unusable: then FAILED_PRECONDITION, as that call was answered. The
        engine's own refusals said so before, except a push repeating the one in service, which never reaches the
        engine and answered OK on a dead server (a resumed trainer re-serving its checkpoint version, say)."""
        engine = self._require_engine(context)
        if self._unusable is not None:
            context.set_trailing_metadata(((ERROR_KIND_KEY, ENGINE_UNUSABLE),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"engine unusable, restart the rollout server: {self._unusable}")
        return engine

    def _abort_engine_failure(self, context: grpc.ServicerContext, rpc: str, e: Exception) -> None:
        """Answer an engine exception with the status that tells the client the server's state (module doc)."""
        if isinstance(e, EngineUnusableError) or (isinstance(e, WeightReloadError) and not e.restored):
            log.error("%s: the engine is unusable and refuses further calls: %s", rpc, e)
            self._unusable = f"{type(e).__name__}: {e}"
            if self._on_engine_unusable is not None:
                self._on_engine_unusable()
            context.set_trailing_metadata(((ERROR_KIND_KEY, ENGINE_UNUSABLE),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"engine unusable, restart the rollout server: {type(e).__name__}: {e}")
        if isinstance(e, WeightReloadError):
            log.error("%s: applying the weights failed, previous weights restored: %s", rpc, e)
            context.set_trailing_metadata(((ERROR_KIND_KEY, WEIGHT_RELOAD_FAILED),))
            context.abort(grpc.StatusCode.INTERNAL,
                          f"weight update failed, the previous weights stay in service: {type(e).__name__}: {e}")
        log.error("engine failed in %s", rpc, exc_info=e)
        context.abort(grpc.StatusCode.INTERNAL, f"engine error in {rpc}: {type(e).__name__}: {e}")

    @staticmethod
    def _caller_gone(context: grpc.ServicerContext, rpc: str, when: str) -> None:
        """End a push whose caller went away (cancelled, deadline passed, its request stream failed, or the server
        is stopping): one log line, nothing applied; the weights and version in service stay."""
        log.warning("%s: the caller went away %s (cancelled, deadline passed, or the server is stopping); "
                    "nothing applied", rpc, when)
        context.abort(grpc.StatusCode.CANCELLED, f"{rpc}: the call ended {when}; nothing applied")

    @contextlib.contextmanager
    def _update_turn(self, context: grpc.ServicerContext, rpc: str) -> Iterator[None]:
        """Hold the update lock (one push at a time keeps versions monotone), waiting for it only while the caller
        still waits: a push whose caller gave up behind a slow push is dropped and frees its thread, instead of
        being applied later to a trainer that saw it fail. At most `MAX_CONCURRENT_PUSHES` pushes are admitted:
        one more is refused at once as `server-busy` (the client retries it), keeping threads for everything else."""
        with self._pushes_lock:
            admitted = self._pushes < MAX_CONCURRENT_PUSHES
            if admitted:
                self._pushes += 1
        if not admitted:
            _refuse_busy(context, f"{rpc}: the server is busy: {MAX_CONCURRENT_PUSHES} weight pushes are in progress; "
                                  "retry later")
        try:
            with self._locked_update(context, rpc):
                yield
        finally:
            with self._pushes_lock:
                self._pushes -= 1

    @contextlib.contextmanager
    def _locked_update(self, context: grpc.ServicerContext, rpc: str) -> Iterator[None]:
        while not self._update_lock.acquire(timeout=_LOCK_POLL_S):
            if not context.is_active():
                self._caller_gone(context, rpc, "while it waited for another push")
        try:
            if not context.is_active():
                self._caller_gone(context, rpc, "while it waited for another push")
            yield
        finally:
            self._update_lock.release()

    def _authenticate(self, context: grpc.ServicerContext) -> None:
        md = dict(context.invocation_metadata())
        got = md.get("authorization", "")
        scheme, _, value = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self._token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong 'authorization: Bearer <token>' metadata")

    # -- RPCs --------------------------------------------------------------------------------------
    def Generate(self, request, context):
        engine = self._usable_engine(context)
        with self._generating_cv:  # admission: the cap keeps threads free for health, GetInfo and pushes
            admitted = self._generating < self._max_generates
            if admitted:
                self._generating += 1
        if not admitted:
            _refuse_busy(context, f"Generate: the server is busy: {self._max_generates} Generate calls are in progress "
                                  f"(serve --max-concurrent-generates {self._max_generates}); retry later")
        try:
            try:
                prompts, spec = parse_generate(request, engine.info(), self._limits)
            except RequestError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            cancelled = threading.Event()  # set when the RPC ends early: its deadline, a cancel, the server stopping
            if not context.add_callback(cancelled.set):  # it ended already (while queued, admitted or parsed):
                cancelled.set()  # the callback will never run, so nobody is waiting: no sampling for it
            try:
                completions = engine.generate_cancellable(prompts, spec, cancelled)
                # Whatever the engine, a non-finite μ never leaves the server.
                check_finite_logprobs(completions)
            except GenerationCancelled as e:  # nobody is waiting for the answer: the work stopped, nothing to send
                context.abort(grpc.StatusCode.CANCELLED, f"Generate stopped: {e}")
            except NonFiniteLogprobsError as e:
                detail = f"{e.prompt},{e.sample},{e.position},{e.value},{e.weight_version}"
                context.set_trailing_metadata(((ERROR_KIND_KEY, NON_FINITE), (NON_FINITE_DETAIL_KEY, detail)))
                context.abort(grpc.StatusCode.INTERNAL, str(e))
            except Exception as e:  # an engine failure must not look like a transport error to the client
                self._abort_engine_failure(context, "Generate", e)
        finally:
            with self._generating_cv:
                self._generating -= 1
                self._generating_cv.notify_all()
        return completions_to_proto(completions, self.server_id, prompts)

    def _apply(self, engine: Engine, tensors: dict, version: int) -> None:
        """Put validated `tensors` in service as `version` (under the update lock). A repeat of the push in service
        (same version, same weights: a retry, or a resumed trainer re-serving its checkpoint) changes nothing and
        is not applied again; other weights under the version in service are refused (`check_version_weights`)."""
        digest = weights_digest(tensors)
        if check_version_weights(version, self._served, digest):
            return
        engine.update_weights(tensors, version)
        self._served = (version, digest)

    def UpdateWeights(self, request_iterator: Iterator[rollout_pb2.WeightChunk], context):
        self._authenticate(context)
        engine = self._usable_engine(context)
        with self._update_turn(context, "UpdateWeights"):
            assembler = TensorAssembler(engine.weight_specs(), engine.info().weight_version)
            try:
                for chunk in request_iterator:
                    assembler.add(chunk)
                tensors, version = assembler.finish()
            except grpc.RpcError:  # the stream broke: the client cancelled, its deadline passed, its iterator raised
                self._caller_gone(context, "UpdateWeights", "mid-stream")
            except ValueError as e:  # RequestError
                if _ends_soon(context):  # a stream cut short by the caller's departure is not a bad request
                    self._caller_gone(context, "UpdateWeights", "mid-stream")
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if not context.is_active():
                self._caller_gone(context, "UpdateWeights", "before the weights were applied")
            try:
                self._apply(engine, tensors, version)
            except ValueError as e:  # the engine's own rejection, or another set under the version in service
                # The engine contract: a rejected update leaves the old weights and version in service.
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except Exception as e:
                self._abort_engine_failure(context, "UpdateWeights", e)
        return rollout_pb2.UpdateWeightsResponse(
            weight_version=version, num_tensors=len(tensors), num_bytes=assembler.num_bytes
        )

    def UpdateWeightsShm(self, request: rollout_pb2.ShmWeights, context):
        """UpdateWeights from the caller's shared-memory buffer (rollout/shm.py); same checks, same atomicity."""
        self._authenticate(context)
        engine = self._usable_engine(context)
        if not self.shm_host_id:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server does not offer shared-memory weight sync")
        with self._update_turn(context, "UpdateWeightsShm"):
            try:
                tensors = self._shm_reader.read(request, engine.weight_specs(), engine.info().weight_version)
            except RequestError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except OSError as e:
                context.set_trailing_metadata(((ERROR_KIND_KEY, SHM_UNREACHABLE),))
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot open the trainer's shared memory "
                              f"(pid {request.pid}, fd {request.fd}): {e.strerror}; push over UpdateWeights")
            if not context.is_active():  # its deadline passed while the buffer was hashed and checked
                self._caller_gone(context, "UpdateWeightsShm", "before the weights were applied")
            try:
                self._apply(engine, tensors, request.version)  # the engine copies: the views die with this call
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except Exception as e:
                self._abort_engine_failure(context, "UpdateWeightsShm", e)
        return rollout_pb2.UpdateWeightsResponse(weight_version=request.version, num_tensors=len(tensors),
                                                 num_bytes=sum(t.nbytes for t in tensors.values()))

    def GetInfo(self, request, context):
        engine = self._require_engine(context)
        info = engine.info()
        specs = engine.weight_specs() if request.include_weight_specs else None
        return info_to_proto(info, server_id=self.server_id, limits=self._limits, shm_host_id=self.shm_host_id,
                             weight_specs=specs)

    def Shutdown(self, request, context):
        self._authenticate(context)
        # The main thread performs the graceful stop; this call's response still goes out within the grace.
        self._stop_event.set()
        return rollout_pb2.ShutdownResponse()


def _ends_soon(context: grpc.ServicerContext, wait_s: float = 0.5) -> bool:
    """Whether the call ends within `wait_s`: a stream whose caller left (its iterator raised, its deadline passed)
    can look merely short to the handler a moment before gRPC marks the call inactive; only a malformed request
    from a caller still waiting pays the wait."""
    deadline = time.monotonic() + wait_s
    while context.is_active():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


class RolloutServer:
    """A bound gRPC server with its servicer and health service; usable in-process (tests, benchmarks)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, token: str, limits: Limits = Limits(),
                 max_concurrent_generates: int = DEFAULT_MAX_CONCURRENT_GENERATES):
        self.stop_event = threading.Event()
        self.servicer = RolloutServicer(
            token=token, limits=limits, stop_event=self.stop_event,
            # An unusable engine turns health NOT_SERVING, so supervisors and new clients see it.
            on_engine_unusable=lambda: self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING),
            max_concurrent_generates=max_concurrent_generates,
        )
        # Non-blocking Watch (grpc's default, named here): an open Watch stream holds no pool thread, so supervisors
        # watching the server cannot starve Generate or the reserved threads (tests/rollout/test_server_robustness.py).
        self.health = health.HealthServicer(experimental_non_blocking=True)
        # More threads than Generate may hold (module doc, "Capacity"): the others answer while generations run.
        workers = max_concurrent_generates + RESERVED_WORKERS
        self._grpc = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout"),
            options=GRPC_OPTIONS,
        )
        rollout_pb2_grpc.add_RolloutServicer_to_server(self.servicer, self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = self._grpc.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        self.host = host
        self._grpc.start()

    def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self.servicer.attach(engine)
        self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace_s: float = 5.0) -> bool:
        """Stop serving: calls in flight get `grace_s`, then are cancelled; a cancelled Generate stops at its next
        batch, and the engine is closed only once no generation is inside it (or, if one never returns, after
        `grace_s` more: the caller then ends the process)."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._grpc.stop(grace_s).wait()
        finished = self.servicer.wait_generations(max(grace_s, 1.0))
        self.servicer._shm_reader.close()
        engine = getattr(self, "engine", None)
        if engine is not None and finished:
            engine.close()
        return finished


def load_engine(name: str, model_dir: str, dtype: str, max_model_len: int | None, quantize: str = "none",
                gpu_memory_utilization: float | None = None) -> Engine:
    """Import the engine lazily: vLLM (torch, ~GBs) must not load unless asked for. `gpu_memory_utilization`
    is vLLM's (None: its default); the JAX engine's share is XLA_PYTHON_CLIENT_MEM_FRACTION, so it refuses one."""
    if name == "jax":
        from jaxrl_mismatch.rollout.jax_engine import JaxEngine

        if gpu_memory_utilization is not None:
            raise ValueError("gpu_memory_utilization is vLLM's; the JAX engine's share is "
                             "XLA_PYTHON_CLIENT_MEM_FRACTION")
        return JaxEngine(model_dir, dtype=dtype, max_model_len=max_model_len, quantize=quantize)
    if name == "vllm":
        from jaxrl_mismatch.rollout.vllm_engine import VLLMEngine, check_quantize

        check_quantize(quantize)  # before vLLM starts: a refused method is a usage error, not a bad model
        memory = {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
        return VLLMEngine(model_dir, dtype, max_model_len=max_model_len, quantize=quantize, **memory)
    raise ValueError(f"unknown engine {name!r}")


def read_token(token_file: str | None) -> str:
    """The shared token from `--token-file` or $JAXRL_ROLLOUT_TOKEN; UsageError naming the source if none, or if it
    is not printable ASCII (it travels as gRPC metadata, which must be ASCII: with any other byte the server would
    start and then no client could ever push)."""
    source = f"--token-file {token_file}" if token_file else f"${TOKEN_ENV}"
    try:
        return protocol.read_token(
            token_file and existing_file("--token-file", token_file), file_label=source, env_label=source,
            missing=f"{source} is empty or unset; UpdateWeights and Shutdown need a shared token: pass --token-file "
                    f"PATH or set {TOKEN_ENV}")
    except ValueError as e:
        raise UsageError(str(e)) from None


READY_FILE_MARK = {"written_by": "jaxrl-mismatch serve"}  # in every ready file: what a later serve may replace


def _announce(prefix: str, payload: dict, ready_file: str | None) -> None:
    """The ready file first, then the line: whoever sees either finds the other written."""
    if ready_file and prefix == READY_PREFIX:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(ready_file)}.", dir=os.path.dirname(
            os.path.abspath(ready_file)))
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({**payload, **READY_FILE_MARK}, f)
            os.replace(tmp, ready_file)  # atomic: a reader never sees a half-written file
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)  # our own temporary
            raise
    print(f"{prefix} {json.dumps(payload, sort_keys=True)}", flush=True)


def _is_ready_file(path: str) -> bool:
    """Whether `path` holds a ready file an earlier `serve` wrote (the only file --ready-file may replace)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and all(data.get(k) == v for k, v in READY_FILE_MARK.items())


PARENT_PID_ENV = "JAXRL_SERVE_PARENT_PID"  # set by `launcher.ManagedServer` for --exit-with-parent


def _check_ready_file(path: str) -> None:
    """UsageError naming --ready-file unless the file can be written there: its directory exists and is writable,
    and nothing but an earlier server's ready file is at the path (a user's file is never replaced)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"--ready-file {path}: is a directory; expected a file path")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--ready-file {path}: its directory {parent} "
                         f"{'does not exist' if not os.path.isdir(parent) else 'is not writable'}")
    if os.path.lexists(path) and not _is_ready_file(path):
        raise UsageError(f"--ready-file {path}: already exists and is not a ready file of an earlier serve; "
                         "name a new path (it is never replaced)")


def _check_max_model_len(model_dir: str, max_model_len: int | None) -> None:
    """UsageError naming --max-model-len when it exceeds the model's context (before the engine loads it)."""
    if max_model_len is None:
        return
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError):
        return  # the model check names the broken config.json
    limit = config.get("max_position_embeddings") if isinstance(config, dict) else None  # a list: named there too
    if isinstance(limit, int) and max_model_len > limit:
        raise UsageError(f"--max-model-len: {max_model_len} exceeds the model's context (max_position_embeddings "
                         f"{limit} in {os.path.join(model_dir, 'config.json')})")


def _check_model_files(model_dir: str) -> None:
    """UsageError naming --model when its config.json does not read or its weight files do not open or do not hold
    config.json's tensors (`hf_io.check_model_files`, headers only): before any engine starts (vLLM took 10 s to
    fail on a folder without weights, with a multi-line error after its start-up warnings)."""
    from jaxrl_mismatch.models.config import ModelConfig
    from jaxrl_mismatch.models.hf_io import ModelFilesError, check_model_files

    try:
        check_model_files(model_dir, ModelConfig.from_hf(model_dir))
    except ModelFilesError as e:
        raise UsageError(f"--model {e}") from None
    except (ValueError, OSError) as e:  # a damaged or unsupported config.json
        raise UsageError(f"--model {model_dir}: {first_line(e)}") from None


def _check_host(host: str) -> None:
    """UsageError naming --host if it is neither an IP address nor a name that resolves."""
    import socket

    try:
        socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"--host {host}: not an IP address or a resolvable host name ({e})") from None


def _check_port_free(host: str, port: int) -> None:
    """UsageError naming the port if something already listens there (gRPC would log a C-level error first)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as gRPC binds: a port in TIME_WAIT (a restarted server's) is free, a listened one is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UsageError(f"--host {host} --port {port}: cannot bind ({e.strerror}); is the port in use?") from None
            raise UsageError(f"--host {host}: cannot bind to it ({e.strerror}); use an address of this machine "
                             "(127.0.0.1, 0.0.0.0 for all interfaces)") from None


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="jaxrl-mismatch serve", description="gRPC rollout server")
    p.add_argument("--engine", choices=("jax", "vllm"), default="jax")
    p.add_argument("--model", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--dtype", choices=ENGINE_DTYPES, default="float32")
    p.add_argument("--quantize", choices=("none", "int8", "fp8"), default="none",
                   help="serve weight-quantized linear layers (models/quantize.py; vllm: fp8 only); pushes are "
                        "quantized on arrival")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="vllm only: the share of the GPU's memory vLLM may take, in (0, 1] (vLLM's "
                        "gpu_memory_utilization, default 0.9; on the CPU backend a share of RAM); lower it when "
                        "a trainer shares the GPU")
    p.add_argument("--host", default="127.0.0.1", help="bind address; loopback unless told otherwise")
    p.add_argument("--port", type=port, default=50051, help="0-65535; 0 picks a free port (printed in the ready line)")
    p.add_argument("--token-file", default=None, help=f"file holding the shared token (else ${TOKEN_ENV})")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion limit, the same for both engines (default and maximum: the model's "
                   "max_position_embeddings)")
    p.add_argument("--max-request-prompt-tokens", type=int, default=Limits.max_request_prompt_tokens)
    p.add_argument("--max-request-completion-tokens", type=int, default=Limits.max_request_completion_tokens)
    p.add_argument("--max-concurrent-generates", type=int, default=DEFAULT_MAX_CONCURRENT_GENERATES, metavar="N",
                   help="Generate calls served at once; one more is answered RESOURCE_EXHAUSTED (clients retry). "
                        "Health checks, GetInfo and weight pushes always have threads of their own")
    p.add_argument("--ready-file", default=None, help="also write the ready JSON here (atomically)")
    p.add_argument("--grace-s", type=float, default=5.0, help="grace period for in-flight calls on shutdown")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop when the launching process exits (a trainer's managed server must not outlive it)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    existing_dir("--model", args.model)
    _check_host(args.host)
    if args.max_model_len is not None and args.max_model_len < 2:  # engine.resolve_max_model_len's rule, before loading
        raise UsageError(f"--max-model-len: must be >= 2 (one prompt and one completion token), "
                         f"got {args.max_model_len}")
    for flag in ("max_request_prompt_tokens", "max_request_completion_tokens", "max_concurrent_generates"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: must be >= 1, got {value}")
    memory = args.gpu_memory_utilization
    if memory is not None:
        if not (math.isfinite(memory) and 0 < memory <= 1):
            raise UsageError(f"--gpu-memory-utilization: must be a fraction in (0, 1], got {memory}")
        if args.engine != "vllm":
            raise UsageError("--gpu-memory-utilization: applies to --engine vllm only; the jax engine's memory "
                             "share is XLA_PYTHON_CLIENT_MEM_FRACTION")
    if not (math.isfinite(args.grace_s) and args.grace_s >= 0):
        raise UsageError(f"--grace-s: must be a number >= 0 (seconds), got {args.grace_s}")
    if args.ready_file is not None:
        _check_ready_file(args.ready_file)
    _check_max_model_len(args.model, args.max_model_len)
    # The launcher's pid as it gave it (`ManagedServer` sets PARENT_PID_ENV): read here, after the imports, a parent
    # killed during them had already handed this process to init, whose pid was then taken for the parent's.
    parent = int(os.environ.get(PARENT_PID_ENV) or os.getppid()) if args.exit_with_parent else None
    token = read_token(args.token_file)
    limits = Limits(
        max_request_prompt_tokens=args.max_request_prompt_tokens,
        max_request_completion_tokens=args.max_request_completion_tokens,
    )
    _check_port_free(args.host, args.port)  # port 0 too: binding it tests the address
    _check_model_files(args.model)  # after every flag's own check (a flag error is named first)
    try:
        server = RolloutServer(host=args.host, port=args.port, token=token, limits=limits,
                               max_concurrent_generates=args.max_concurrent_generates)
    except (OSError, RuntimeError) as e:
        raise UsageError(f"--host {args.host} --port {args.port}: cannot bind ({e}); is the port in use?") from None
    # Signal handlers only flip the event; the main thread does the stop, outside signal context.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop_event.set())
    base = {"host": args.host, "port": server.port, "pid": os.getpid(), "engine": args.engine}
    _announce(LISTENING_PREFIX, base, None)
    try:
        engine = load_engine(args.engine, args.model, args.dtype, args.max_model_len, args.quantize, memory)
    except UsageError:
        server.stop(0)
        raise
    except Exception as e:  # noqa: BLE001 - any load failure is reported as a bad --model, one line
        server.stop(0)
        raise UsageError(f"--model {args.model}: the {args.engine} engine cannot load it: {type(e).__name__}: "
                         f"{first_line(e)}") from None
    server.attach(engine)
    info = engine.info()
    _announce(READY_PREFIX, {**base, "server_id": server.servicer.server_id, "vocab_size": info.vocab_size,
                             "weight_version": info.weight_version}, args.ready_file)
    while not server.stop_event.wait(0.5):
        # Reparenting means the launcher died (even by SIGKILL, when it could not stop us itself).
        if parent is not None and os.getppid() != parent:
            print(f"serve: parent process {parent} exited", flush=True)
            break
    print("serve: stopping", flush=True)
    if not server.stop(args.grace_s):
        # A generation that did not stop at a batch boundary within the grace period: the process exits anyway
        # (the executor would join its thread at exit, holding the process for as long as it runs).
        print("serve: a generation was still running after the grace period; exiting without it", flush=True)
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
