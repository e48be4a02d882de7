"""Checks on incoming RPCs, before anything reaches an engine.

A malformed request must come back as INVALID_ARGUMENT naming the offending field, and must never reach
an engine, where it could crash the process (an out-of-range token id indexes past the embedding table;
a huge max_tokens allocates a huge KV cache) or poison the weights in service. Every check raises
`RequestError(field, message)`; the server turns it into the gRPC status.

Oversize requests: gRPC itself answers RESOURCE_EXHAUSTED when a message exceeds the transport limit, and
that happens before our code runs. So the server enforces its own, lower, limits on the number of prompt
tokens and completion tokens per request (`protocol.Limits`, advertised in GetInfo), chosen so that any
request within them fits well inside the transport limit. An oversize request up to the transport limit gets INVALID_ARGUMENT naming
`prompts` or `max_tokens`; only a message beyond the transport limit (64 MiB) gets gRPC's code. The response
is bounded too (`protocol.response_bytes_bound`: tokens, framing, and a MoE engine's routing, which repeats
the prompt's expert ids in every sample): a request whose response could exceed 64 MiB is refused before any
generation (`return_routing` or `max_tokens`), since gRPC would fail it only after the whole batch was sampled.
"""

from __future__ import annotations

import math

import numpy as np
import xxhash

from jaxrl_mismatch.rollout import rollout_pb2
from jaxrl_mismatch.rollout.engine import EngineInfo, SamplingSpec, TensorSpec
from jaxrl_mismatch.rollout.protocol import (
    MAX_MESSAGE_BYTES,
    Limits,
    response_bytes_bound,
    spec_from_proto,
    tensor_from_bytes,
    tensor_nbytes,
)

MAX_STOP_TOKEN_IDS = 64
MAX_PROMPT_INDEX = 2**31 - 1  # prompt_offset + i keys a prompt's randomness; the engines hold it as int32
GREEDY_TEMPERATURE = 1e-5  # below it sampling is greedy (same constant as rollout/sampling.py and vLLM)
MAX_NOISE_OVER_T = 1e30  # logit_noise_std / temperature: far above any use, far below float32 overflow (3.4e38)
# vLLM raises any temperature in (0, 0.01) to 0.01 (vllm.sampling_params._MAX_TEMP, with a warning): μ would be
# sampled at another temperature than the one π is scored at, so the vllm engine refuses those.
VLLM_MIN_TEMPERATURE = 0.01
VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses a temperature above it (an engine error, INTERNAL)
# Elements per block of the finiteness scan: bounds its temporary boolean array (16 MiB) for any tensor size.
_FINITE_SCAN_BLOCK = 1 << 24


def is_greedy(temperature: float) -> bool:
    """Whether `temperature` means greedy decoding: below GREEDY_TEMPERATURE compared in float32, as the wire
    carries it and as the JAX sampler compares it (`sampling.effective_settings`), so the server's checks, the
    JAX engine and the vLLM engine agree at the boundary (1e-5 itself samples)."""
    return bool(np.float32(temperature) < np.float32(GREEDY_TEMPERATURE))


def vllm_temperature_problem(engine: str, temperature: float) -> str | None:
    """Why the `engine` would not sample at `temperature` (vLLM raises (0, 0.01) to 0.01 and refuses above 2), or
    None. Compared in float32, as the wire carries it: 0.01 arrives as 0.0099999998, which vLLM moves by 2e-10."""
    if engine == "vllm" and not is_greedy(temperature) and np.float32(temperature) < np.float32(VLLM_MIN_TEMPERATURE):
        return (f"the vllm engine samples any temperature in (0, {VLLM_MIN_TEMPERATURE}) at {VLLM_MIN_TEMPERATURE} "
                f"(vLLM's floor), not at {temperature:g}; use >= {VLLM_MIN_TEMPERATURE}, or < {GREEDY_TEMPERATURE} "
                "for greedy decoding")
    if engine == "vllm" and np.float32(temperature) > np.float32(VLLM_MAX_TEMPERATURE):
        return (f"the vllm engine samples at most temperature {VLLM_MAX_TEMPERATURE:g} (vLLM's bound), got "
                f"{temperature:g}")
    return None


class RequestError(ValueError):
    """A request that is malformed; `field` names the proto field (or tensor) at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _check_token_ids(ids: np.ndarray, vocab_size: int, field: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise RequestError(field, f"token id {bad} outside [0, vocab_size={vocab_size})")


def parse_generate(
    req: rollout_pb2.GenerateRequest, info: EngineInfo, limits: Limits
) -> tuple[list[list[int]], SamplingSpec]:
    """Validate a GenerateRequest against the engine and the limits; return prompts and the spec
    (decoded by `protocol.spec_from_proto`, the one request mapping)."""
    if len(req.prompts) == 0:
        raise RequestError("prompts", "no prompts given")
    total = sum(len(p.token_ids) for p in req.prompts)
    if total > limits.max_request_prompt_tokens:
        raise RequestError(
            "prompts",
            f"{total} prompt tokens in one request exceed the server limit of {limits.max_request_prompt_tokens}; "
            "split the batch",
        )
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # before decoding: bounded work on a hostile request
        raise RequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop tokens, got {len(req.stop_token_ids)}")
    prompts = [list(p.token_ids) for p in req.prompts]
    spec = spec_from_proto(req)
    check_request(prompts, spec, info)
    completion_tokens = len(prompts) * spec.n * spec.max_tokens
    if completion_tokens > limits.max_request_completion_tokens:
        raise RequestError(
            "max_tokens",
            f"prompts x n x max_tokens = {completion_tokens} exceeds the server limit of "
            f"{limits.max_request_completion_tokens} completion tokens per request; split the batch",
        )
    size = response_bytes_bound([len(p) for p in prompts], spec, info.routing_bytes_per_token)
    if size > MAX_MESSAGE_BYTES:  # checked now, not by gRPC after the whole batch was generated
        routing = (f", {info.routing_bytes_per_token} bytes of routing per prompt and completion token of each "
                   "sample" if spec.return_routing and info.routing_bytes_per_token else "")
        raise RequestError(
            "return_routing" if routing else "max_tokens",
            f"the response could reach {size} bytes ({len(prompts)} prompts x n={spec.n} x max_tokens="
            f"{spec.max_tokens}{routing}), over the {MAX_MESSAGE_BYTES}-byte message limit; split the batch")
    return prompts, spec


def check_request(prompts: list[list[int]], spec: SamplingSpec, info: EngineInfo) -> None:
    """Whether an engine described by `info` can sample `spec` for `prompts`; RequestError naming the field. The
    server checks every Generate with it (`parse_generate`), and the JAX engine every in-process call (the jobs
    that drive an engine directly), so both refuse the same requests the same way."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise RequestError(f"prompts[{i}].token_ids", "empty prompt")
        _check_token_ids(np.asarray(p, dtype=np.int64), info.vocab_size, f"prompts[{i}].token_ids")
    if len(spec.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError("stop_token_ids",
                           f"at most {MAX_STOP_TOKEN_IDS} stop tokens, got {len(spec.stop_token_ids)}")
    if spec.n < 1:
        raise RequestError("n", f"must be >= 1, got {spec.n}")
    if spec.max_tokens < 1:
        raise RequestError("max_tokens", f"must be >= 1, got {spec.max_tokens}")
    longest = max((len(p) for p in prompts), default=0)
    if longest + spec.max_tokens > info.max_model_len:
        raise RequestError(
            "max_tokens",
            f"longest prompt ({longest} tokens) + max_tokens ({spec.max_tokens}) exceeds max_model_len "
            f"{info.max_model_len}",
        )
    if not (math.isfinite(spec.temperature) and spec.temperature >= 0.0):
        raise RequestError("temperature", f"must be finite and >= 0 (below 1e-5: greedy), got {spec.temperature}")
    if not (math.isfinite(spec.top_p) and 0.0 < spec.top_p <= 1.0):
        raise RequestError("top_p", f"must be in (0, 1], got {spec.top_p}")
    if not 0 <= spec.top_k <= MAX_PROMPT_INDEX:
        raise RequestError("top_k", f"must be in [0, {MAX_PROMPT_INDEX}] (0 disables), got {spec.top_k}")
    _check_token_ids(np.asarray(spec.stop_token_ids, dtype=np.int64), info.vocab_size, "stop_token_ids")
    if spec.prompt_offset < 0:
        raise RequestError("prompt_offset", f"must be >= 0, got {spec.prompt_offset}")
    if spec.prompt_offset + len(prompts) - 1 > MAX_PROMPT_INDEX:  # the engines draw keys for int32 prompt indices
        raise RequestError("prompt_offset", f"prompt_offset + number of prompts - 1 must be <= {MAX_PROMPT_INDEX} "
                                            f"(the last prompt's index), got {spec.prompt_offset} + {len(prompts)} - 1")
    noise = spec.logit_noise_std
    if not (math.isfinite(noise) and noise >= 0.0):
        raise RequestError("logit_noise_std", f"must be finite and >= 0 (0 = off), got {noise}")
    if noise / max(spec.temperature, GREEDY_TEMPERATURE) > MAX_NOISE_OVER_T:  # (σ/T)·ε would overflow float32
        raise RequestError("logit_noise_std", f"σ/T must be <= {MAX_NOISE_OVER_T:g} (the noise is added to logits/T "
                                              f"in float32), got {noise}/{spec.temperature}")
    for field, option, on in (("exact", "exact", spec.exact), ("logit_noise_std", "logit_noise_std", noise > 0),
                              ("return_routing", "routing", spec.return_routing)):
        if on and option not in info.options:
            raise RequestError(field, f"not supported by the {info.engine} engine (it supports: "
                                      f"{', '.join(info.options) or 'no optional features'})")
    strength = spec.quantize_strength
    if not (math.isfinite(strength) and 0.0 <= strength <= 1.0):
        raise RequestError("quantize_strength", f"must be in [0, 1] (1 = the served quantized weights), got {strength}")
    if strength != 1.0 and info.quantize != "none" and "quantize_strength" not in info.options:
        raise RequestError("quantize_strength", f"not supported by the {info.engine} engine (it serves {info.quantize} "
                                                "weights as they are)")
    if why := vllm_temperature_problem(info.engine, spec.temperature):
        raise RequestError("temperature", why)
    if noise > 0 and is_greedy(spec.temperature):
        raise RequestError("logit_noise_std", f"injected noise needs sampling (temperature >= {GREEDY_TEMPERATURE})")
    if spec.exact and spec.return_routing:
        raise RequestError("return_routing", "not available in exact mode (exact mode already gives μ = π(θ_old); "
                                             "routing replay is for the normal sampler)")
    if spec.exact and is_greedy(spec.temperature):
        raise RequestError("exact", f"exact mode samples at temperature > 0: needs temperature >= {GREEDY_TEMPERATURE}")


def check_chunk_header(chunk: rollout_pb2.WeightChunk, specs: dict[str, TensorSpec]) -> TensorSpec:
    """Check one UpdateWeights chunk's tensor metadata against what the engine expects."""
    name = chunk.name
    if name not in specs:
        raise RequestError(f"tensor {name!r}", "unknown tensor name for this model")
    spec = specs[name]
    shape = tuple(int(s) for s in chunk.shape)
    if shape != tuple(spec.shape):
        raise RequestError(f"tensor {name!r}", f"shape {shape} != expected {tuple(spec.shape)}")
    if chunk.dtype != spec.dtype:
        raise RequestError(f"tensor {name!r}", f"dtype {chunk.dtype!r} != expected {spec.dtype!r}")
    return spec


def count_non_finite(arr: np.ndarray) -> tuple[int, int]:
    """(number of NaN/inf values, flat index of the first) of a floating array; (0, -1) if all are finite.

    Integer arrays are always finite. Scans in blocks so that a multi-GB embedding does not need a
    same-sized temporary.
    """
    if not (np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16"):
        return 0, -1
    flat = arr.reshape(-1)
    count, first = 0, -1
    for start in range(0, flat.size, _FINITE_SCAN_BLOCK):
        bad = ~np.isfinite(flat[start : start + _FINITE_SCAN_BLOCK])
        n = int(np.count_nonzero(bad))
        if n and first < 0:
            first = start + int(np.argmax(bad))
        count += n
    return count, first


def check_finite_tensor(name: str, arr: np.ndarray) -> None:
    """Refuse a pushed tensor with NaN/inf values (RequestError naming it), before any engine sees it.

    Why at the server: a non-finite weight can only ever produce non-finite (or meaningless) log-probs,
    and would be discovered one Generate later, after the trainer had moved on to that version. Refusing
    the push keeps the previous weights in service and names the culprit tensor at the step that caused
    it; doing it here, once, makes every engine refuse exactly the same pushes.
    """
    count, first = count_non_finite(arr)
    if count:
        index = tuple(int(i) for i in np.unravel_index(first, arr.shape))
        value = float(arr.reshape(-1)[first])
        raise RequestError(
            f"tensor {name!r}",
            f"{count} non-finite value(s), the first {value} at index {index}; refusing to serve them "
            "(the previous weights stay in service)",
        )


class TensorAssembler:
    """Reassembles streamed chunks into whole tensors, checking order, bounds, completeness and finiteness.

    The byte layout and the chunk header are `protocol.py`'s (`weight_chunks`, `tensor_from_bytes`).

    Chunks of a tensor must arrive in order and contiguously (offset == bytes received so far), so a gap,
    an overlap or a duplicate is detected without bookkeeping of byte ranges. Each tensor's values are
    checked for NaN/inf as soon as its last byte has arrived, so a bad push fails at the first bad tensor
    instead of after the whole stream.
    """

    def __init__(self, specs: dict[str, TensorSpec], current_version: int):
        self._specs = specs
        self._current_version = current_version
        self._buffers: dict[str, np.ndarray] = {}
        self._filled: dict[str, int] = {}
        self.version: int | None = None
        self.num_bytes = 0

    def add(self, chunk: rollout_pb2.WeightChunk) -> None:
        if self.version is None:
            if chunk.version < 1:
                raise RequestError("version", f"target weight version must be >= 1, got {chunk.version}")
            if chunk.version < self._current_version:
                raise RequestError(
                    "version", f"target version {chunk.version} is older than the version in service "
                    f"({self._current_version}); versions never go backwards",
                )
            self.version = chunk.version
        elif chunk.version != self.version:
            raise RequestError("version", f"chunk for {chunk.name!r} has version {chunk.version}, stream started with {self.version}")
        spec = check_chunk_header(chunk, self._specs)
        name = chunk.name
        if name not in self._buffers:
            self._buffers[name] = np.empty(_nbytes(spec), dtype=np.uint8)
            self._filled[name] = 0
        buf, filled = self._buffers[name], self._filled[name]
        if chunk.offset != filled:
            raise RequestError(f"tensor {name!r}", f"chunk at byte offset {chunk.offset}, expected {filled} (chunks must be in order, without gaps or overlaps)")
        end = filled + len(chunk.data)
        if end > buf.size:
            raise RequestError(f"tensor {name!r}", f"chunk ends at byte {end}, beyond the tensor's {buf.size} bytes")
        buf[filled:end] = np.frombuffer(chunk.data, dtype=np.uint8)
        self._filled[name] = end
        self.num_bytes += len(chunk.data)
        if end == buf.size:
            check_finite_tensor(name, self._typed(name))

    def _typed(self, name: str) -> np.ndarray:
        return tensor_from_bytes(self._buffers[name], self._specs[name])

    def finish(self) -> tuple[dict[str, np.ndarray], int]:
        """All tensors, complete, as arrays of the wire dtype and shape; and the target version."""
        if self.version is None:
            raise RequestError("chunks", "empty UpdateWeights stream")
        missing = sorted(set(self._specs) - set(self._buffers))
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise RequestError(f"tensor {missing[0]!r}", f"missing from the update: {missing[:5]}{more}")
        tensors = {}
        for name, buf in self._buffers.items():
            if self._filled[name] != buf.size:
                raise RequestError(f"tensor {name!r}", f"incomplete: {self._filled[name]} of {buf.size} bytes received")
            tensors[name] = self._typed(name)
        return tensors, self.version


def weights_digest(tensors: dict[str, np.ndarray]) -> int:
    """xxh3-64 over every tensor's name, dtype, shape and bytes, in name order.

    Why: a version number names one set of weights. A second push of the version in service is a retry (the
    client lost the answer, or a resumed trainer re-serves its checkpoint) when its weights are the same, and a
    second policy under one tag when they are not: every completion after it would carry a version that no longer
    says which weights sampled it. The digest tells the two apart whichever transport brought the tensors (the
    streamed and the shared-memory pushes lay the bytes out differently; this hashes the tensors, not the
    layout). It is one more pass over the bytes, about a memcpy: 5.6–7.8 ms for 50 MB here (~7–9 GB/s);
    its cost beside the push is `benchmarks/rollout.py`'s paired on/off measurement.
    """
    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        h.update(f"{name}\0{arr.dtype.name}\0{arr.shape}\0".encode())
        h.update(arr.reshape(-1).view(np.uint8))
    return h.intdigest()


def check_version_weights(version: int, served: tuple[int, int] | None, digest: int) -> bool:
    """Whether a push of `version` with weights `digest` repeats the push in service, `served` = (version,
    digest) or None; raises RequestError('version') for other weights under the version in service."""
    if served is None or served[0] != version:
        return False
    if served[1] != digest:
        raise RequestError("version", f"version {version} is in service with other weights (their digests differ); "
                           "a version names one set of weights: push these as a new version")
    return True


def _nbytes(spec: TensorSpec) -> int:
    try:
        return tensor_nbytes(spec)
    except TypeError as e:
        raise RequestError("dtype", f"unknown dtype {spec.dtype!r}") from e
