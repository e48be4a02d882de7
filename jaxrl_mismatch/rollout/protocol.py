"""The Rollout service's wire protocol, owned in one place: the constants both ends must agree on, the
mapping between the engine's types (`SamplingSpec`, `Completion`, `EngineInfo`) and the messages of
rollout.proto, in both directions, and the byte layout of pushed weight tensors (`weight_chunks` encodes,
`tensor_from_bytes` decodes; both weight transports use it).

Kept apart from `server.py` and `client.py` so that neither imports the other, and so that a field added to
a message is encoded and decoded by the same module: the client encodes a request and decodes a response,
the server (through `validation.parse_generate`) decodes the request and encodes the response. Nothing here
validates values (that is `validation.py`, before anything reaches an engine); what cannot be decoded at all
raises `MalformedMessageError`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from jaxrl_mismatch.rollout import rollout_pb2
from jaxrl_mismatch.rollout.engine import Completion, EngineInfo, SamplingSpec, TensorSpec

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
TOKEN_ENV = "JAXRL_ROLLOUT_TOKEN"

# Trailing metadata: `ERROR_KIND_KEY` names a machine-readable error kind.
ERROR_KIND_KEY = "jaxrl-error"
NON_FINITE = "non-finite-logprobs"  # INTERNAL; details under NON_FINITE_DETAIL_KEY
NON_FINITE_DETAIL_KEY = "jaxrl-non-finite"  # "prompt,sample,position,value,weight_version"
WEIGHT_RELOAD_FAILED = "weight-reload-failed"  # INTERNAL; the previous weights stay in service
ENGINE_UNUSABLE = "engine-unusable"  # FAILED_PRECONDITION; the server must be restarted
SHM_UNREACHABLE = "shm-unreachable"  # FAILED_PRECONDITION on UpdateWeightsShm: push over UpdateWeights instead
# RESOURCE_EXHAUSTED on Generate: `serve --max-concurrent-generates` calls are in progress. Clients retry it like
# UNAVAILABLE; a RESOURCE_EXHAUSTED without it is gRPC's own message-size limit, which no retry can fix.
SERVER_BUSY = "server-busy"


def is_printable_ascii(token: str) -> bool:
    """Whether `token` can travel as gRPC metadata (`authorization: Bearer <token>`): printable ASCII only."""
    return all(" " <= c <= "~" for c in token)


def read_token(token_file: str | None, *, file_label: str, env_label: str, missing: str) -> str:
    """The shared token from `token_file`, else $JAXRL_ROLLOUT_TOKEN (`token_from_bytes`); ValueError whose message
    names the source (`file_label` / `env_label`), or is `missing` when there is no token. `serve` and `train`
    read it so, and word the error for their own flags or config fields."""
    if token_file:
        try:
            with open(token_file, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"{file_label}: cannot read it ({e.strerror})") from None
        source = file_label
    else:
        raw = os.fsencode(os.environ.get(TOKEN_ENV, ""))  # the variable's bytes, undecodable ones included
        source = env_label
    try:
        return token_from_bytes(raw)
    except ValueError as e:
        raise ValueError(f"{source}: {e}" if raw.strip() else missing) from None


def token_from_bytes(raw: bytes) -> str:
    """The shared token in `raw` (a token file's or $JAXRL_ROLLOUT_TOKEN's bytes), surrounding whitespace removed;
    ValueError if there is none, or if it is not printable ASCII: it travels as gRPC metadata, which must be
    ASCII (with any other byte a server would start, and then no client could ever push). The message gives the
    offending byte's position only, never the token."""
    raw = raw.strip()
    if not raw:
        raise ValueError("is empty or unset")
    bad = next((i for i, b in enumerate(raw) if not 0x20 <= b <= 0x7E), None)
    if bad is not None:
        raise ValueError(f"the token must be printable ASCII (it travels as gRPC metadata); the byte at offset {bad} "
                         "is not (`openssl rand -hex 16` makes a good one)")
    return raw.decode("ascii")


# Lines `jaxrl-mismatch serve` prints (JSON payload after the prefix); the ready payload is also written
# atomically to `--ready-file`, which is what a launcher polls.
READY_PREFIX = "JAXRL_ROLLOUT_READY"
LISTENING_PREFIX = "JAXRL_ROLLOUT_LISTENING"

# Transport limit on both sides. Requests are bounded far below it by `Limits`; weight tensors
# travel in chunks of a few MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# A prompt token costs at most 5 bytes on the wire (varint int32, packed), a completion token at most
# 14 (token varint + float32 logprob + kept-count varint). These defaults keep requests below ~11 MB and the
# responses' tokens below ~59 MB; `response_bytes_bound` also counts each sample's framing and its routing.
DEFAULT_MAX_REQUEST_PROMPT_TOKENS = 1 << 21
DEFAULT_MAX_REQUEST_COMPLETION_TOKENS = 1 << 22
COMPLETION_TOKEN_BYTES = 14
# One Completion's framing besides its per-token arrays: message and field tags and lengths, finish reason,
# weight version, the Routing message's own fields (counted generously: it is at most ~70 bytes).
SAMPLE_OVERHEAD_BYTES = 96
PROMPT_OVERHEAD_BYTES = 6  # one PromptCompletions tag + length
RESPONSE_OVERHEAD_BYTES = 1024  # the GenerateResponse's server_id and framing

FINISH_REASONS = {"stop": rollout_pb2.FINISH_REASON_STOP, "length": rollout_pb2.FINISH_REASON_LENGTH}
_FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}
_SPEC_DEFAULTS = SamplingSpec()


class MalformedMessageError(ValueError):
    """A message from the other end that cannot be decoded (the client reports it as a `RolloutError`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """A server's per-request token limits, advertised in GetInfo: a client splits a larger batch over requests."""

    max_request_prompt_tokens: int = DEFAULT_MAX_REQUEST_PROMPT_TOKENS
    max_request_completion_tokens: int = DEFAULT_MAX_REQUEST_COMPLETION_TOKENS
    # The engine's routing bytes per token (`EngineInfo.routing_bytes_per_token`): what a return_routing
    # request adds to its response, which must stay within MAX_MESSAGE_BYTES (`response_bytes_bound`).
    routing_bytes_per_token: int = 0


def prompt_response_bytes(prompt_len: int, spec: SamplingSpec, routing_bytes_per_token: int) -> int:
    """An upper bound on what one prompt's `spec.n` samples add to a GenerateResponse: each sample's tokens
    (`COMPLETION_TOKEN_BYTES` each), its framing, and with `return_routing` its expert ids for the prompt's
    and its own tokens (the prompt's routing travels once per sample)."""
    routing = routing_bytes_per_token * (prompt_len + spec.max_tokens) if spec.return_routing else 0
    return PROMPT_OVERHEAD_BYTES + spec.n * (SAMPLE_OVERHEAD_BYTES + spec.max_tokens * COMPLETION_TOKEN_BYTES
                                             + routing)


def response_bytes_bound(prompt_lens: Sequence[int], spec: SamplingSpec, routing_bytes_per_token: int) -> int:
    """An upper bound on the encoded size of the GenerateResponse to these prompts: a request is refused
    (server) or split (client) when it could exceed MAX_MESSAGE_BYTES, which gRPC would only report after
    the whole batch was generated, as RESOURCE_EXHAUSTED."""
    return RESPONSE_OVERHEAD_BYTES + sum(prompt_response_bytes(n, spec, routing_bytes_per_token) for n in prompt_lens)


# -- Generate ------------------------------------------------------------------------------------------------------


def request_to_proto(prompts: Sequence[Sequence[int]], spec: SamplingSpec) -> rollout_pb2.GenerateRequest:
    """The GenerateRequest of `spec.n` samples per prompt (`quantize_strength` sent only when not 1)."""
    return rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(token_ids=list(p)) for p in prompts],
        n=spec.n,
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        seed=spec.seed,
        stop_token_ids=list(spec.stop_token_ids),
        exact=spec.exact,
        logit_noise_std=spec.logit_noise_std,
        return_routing=spec.return_routing,
        quantize_strength=spec.quantize_strength if spec.quantize_strength != 1.0 else None,
        prompt_offset=spec.prompt_offset,
    )


def _optional(req: rollout_pb2.GenerateRequest, field: str):
    return getattr(req, field) if req.HasField(field) else getattr(_SPEC_DEFAULTS, field)


def spec_from_proto(req: rollout_pb2.GenerateRequest) -> SamplingSpec:
    """The request's SamplingSpec as sent, unchecked: unset optional fields take `SamplingSpec`'s defaults."""
    return SamplingSpec(
        n=int(_optional(req, "n")),
        max_tokens=int(req.max_tokens),
        temperature=float(_optional(req, "temperature")),
        top_p=float(_optional(req, "top_p")),
        top_k=int(_optional(req, "top_k")),
        seed=int(_optional(req, "seed")),
        stop_token_ids=tuple(int(t) for t in req.stop_token_ids),
        exact=bool(req.exact),
        logit_noise_std=float(_optional(req, "logit_noise_std")),
        return_routing=bool(req.return_routing),
        quantize_strength=float(_optional(req, "quantize_strength")),
        prompt_offset=int(req.prompt_offset),
    )


def routing_to_proto(routing, num_prompt_tokens: int) -> rollout_pb2.Routing:
    """`Completion.routing` ([tokens, layers, k] uint8/uint16) as the packed `Routing` message."""
    arr = np.ascontiguousarray(routing)
    if arr.ndim != 3 or arr.dtype not in (np.uint8, np.uint16):
        raise ValueError(f"routing must be a [tokens, layers, k] uint8/uint16 array, got {arr.dtype}{arr.shape}")
    return rollout_pb2.Routing(expert_ids=arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(),
                               num_layers=arr.shape[1], top_k=arr.shape[2], itemsize=arr.dtype.itemsize,
                               num_prompt_tokens=num_prompt_tokens)


def routing_from_proto(pb: rollout_pb2.Routing, num_tokens: int) -> np.ndarray:
    """The `[tokens, layers, k]` expert ids of a `Routing` message (uint8 / uint16)."""
    dtype = {1: np.dtype("<u1"), 2: np.dtype("<u2")}.get(pb.itemsize)
    if dtype is None or pb.num_layers < 1 or pb.top_k < 1:
        raise MalformedMessageError(f"malformed routing: itemsize {pb.itemsize}, num_layers {pb.num_layers}, "
                                    f"top_k {pb.top_k}")
    want = num_tokens * pb.num_layers * pb.top_k * dtype.itemsize
    if len(pb.expert_ids) != want:
        raise MalformedMessageError(f"malformed routing: {len(pb.expert_ids)} bytes for {num_tokens} tokens x "
                                    f"{pb.num_layers} layers x top-{pb.top_k} ({want} expected)")
    return np.frombuffer(pb.expert_ids, dtype).reshape(num_tokens, pb.num_layers, pb.top_k).astype(dtype.newbyteorder("="))


def completions_to_proto(completions: list[list[Completion]], server_id: str,
                         prompts: list[list[int]] | None = None) -> rollout_pb2.GenerateResponse:
    """The GenerateResponse of `completions[i][j]` (sample j of prompt i)."""
    resp = rollout_pb2.GenerateResponse(server_id=server_id)
    for i, samples in enumerate(completions):
        pc = resp.prompts.add()
        for c in samples:
            pb = pc.samples.add(
                token_ids=c.token_ids,
                logprobs=c.logprobs,
                finish_reason=FINISH_REASONS[c.finish_reason],
                weight_version=c.weight_version,
            )
            if c.kept_counts is not None:
                pb.kept_counts.extend(c.kept_counts)
            if c.routing is not None:
                n_prompt = len(prompts[i]) if prompts is not None else c.routing.shape[0] - len(c.token_ids)
                pb.routing.CopyFrom(routing_to_proto(c.routing, n_prompt))
    return resp


def completion_from_proto(pb: rollout_pb2.Completion) -> Completion:
    """One sample of a GenerateResponse."""
    routing = None
    if pb.HasField("routing"):
        routing = routing_from_proto(pb.routing, pb.routing.num_prompt_tokens + len(pb.token_ids))
    if len(pb.logprobs) != len(pb.token_ids):  # a short list would surface later as a padding error, not the RPC's
        raise MalformedMessageError(f"malformed completion: {len(pb.logprobs)} logprobs for {len(pb.token_ids)} tokens")
    if pb.kept_counts and len(pb.kept_counts) != len(pb.token_ids):
        raise MalformedMessageError(f"malformed completion: {len(pb.kept_counts)} kept_counts for "
                                    f"{len(pb.token_ids)} tokens")
    return Completion(
        token_ids=list(pb.token_ids),
        logprobs=list(pb.logprobs),
        finish_reason=_FINISH_NAMES.get(pb.finish_reason, "unspecified"),
        weight_version=pb.weight_version,
        routing=routing,
        kept_counts=list(pb.kept_counts) if pb.kept_counts else None,
    )


def completions_from_proto(resp: rollout_pb2.GenerateResponse) -> list[list[Completion]]:
    """`result[i][j]` = sample j of prompt i of a GenerateResponse."""
    return [[completion_from_proto(c) for c in pc.samples] for pc in resp.prompts]


# -- GetInfo -------------------------------------------------------------------------------------------------------


def info_to_proto(info: EngineInfo, *, server_id: str, limits: Limits, shm_host_id: str,
                  weight_specs: Mapping[str, TensorSpec] | None = None) -> rollout_pb2.GetInfoResponse:
    """The GetInfoResponse of an engine behind a server (`weight_specs` only when the caller asked for them)."""
    resp = rollout_pb2.GetInfoResponse(
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        dtype=info.dtype,
        engine=info.engine,
        weight_version=info.weight_version,
        max_model_len=info.max_model_len,
        server_id=server_id,
        max_request_prompt_tokens=limits.max_request_prompt_tokens,
        max_request_completion_tokens=limits.max_request_completion_tokens,
        options=list(info.options),
        quantize=info.quantize,
        shm_host_id=shm_host_id,
        routing_bytes_per_token=info.routing_bytes_per_token,
    )
    for name, spec in sorted((weight_specs or {}).items()):
        resp.weight_specs.add(name=name, shape=list(spec.shape), dtype=spec.dtype)
    return resp


def info_from_proto(resp: rollout_pb2.GetInfoResponse) -> EngineInfo:
    """The served engine's `EngineInfo` (an empty `quantize`, from a server before the field, reads "none")."""
    return EngineInfo(
        architecture=resp.architecture,
        vocab_size=resp.vocab_size,
        dtype=resp.dtype,
        engine=resp.engine,
        weight_version=resp.weight_version,
        max_model_len=resp.max_model_len,
        options=tuple(resp.options),
        quantize=resp.quantize or "none",
        routing_bytes_per_token=resp.routing_bytes_per_token,
    )


def limits_from_proto(resp: rollout_pb2.GetInfoResponse) -> Limits:
    return Limits(max_request_prompt_tokens=resp.max_request_prompt_tokens,
                  max_request_completion_tokens=resp.max_request_completion_tokens,
                  routing_bytes_per_token=resp.routing_bytes_per_token)


def weight_specs_from_proto(resp: rollout_pb2.GetInfoResponse) -> dict[str, TensorSpec]:
    """HF name -> (shape, wire dtype) of every tensor the engine expects in UpdateWeights."""
    return {s.name: TensorSpec(tuple(s.shape), s.dtype) for s in resp.weight_specs}


# ---------------------------------------------------------------------------------------- weight tensors
# One byte layout for a weight tensor, written by the trainer and read by the server on both weight
# transports (UpdateWeights chunks here, the UpdateWeightsShm buffer in `shm.py`): the array's values in
# C order, little-endian, as the numpy dtype named by `TensorSpec.dtype` ("bfloat16" is ml_dtypes').
# A `WeightChunk` carries the header of its tensor (`version`, `name`, `dtype`, `shape`) and the bytes
# [offset, offset + len(data)) of that layout; a tensor's chunks follow each other in offset order, and an
# empty tensor is one chunk with no data. Checks of the values (names, shapes, versions, gaps, NaN/inf)
# are `validation.py`'s.

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024  # far below MAX_MESSAGE_BYTES


def wire_dtype(name: str) -> np.dtype:
    """numpy dtype for a wire dtype name; bfloat16 comes from ml_dtypes (a jax dependency)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def little_endian(arr: np.ndarray) -> np.ndarray:
    """`arr` with little-endian byte order (a byte-swapped copy only for a big-endian dtype)."""
    arr = np.asarray(arr)
    return arr.astype(arr.dtype.newbyteorder("<")) if arr.dtype.byteorder == ">" else arr


def tensor_nbytes(spec: TensorSpec) -> int:
    """Bytes of a tensor of `spec` in the wire layout (TypeError for an unknown dtype name)."""
    return int(np.prod(spec.shape, dtype=np.int64)) * wire_dtype(spec.dtype).itemsize


def tensor_from_bytes(buf: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """The tensor of `spec` that the `uint8` buffer `buf` (exactly `tensor_nbytes(spec)` long) holds; a view."""
    return buf.view(wire_dtype(spec.dtype)).reshape(spec.shape)


def weight_chunks(
    tensors: Mapping[str, np.ndarray], version: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[rollout_pb2.WeightChunk]:
    """Split tensors (already of their wire dtype) into the UpdateWeights stream of `version`."""
    for name, arr in tensors.items():
        arr = np.asarray(little_endian(arr), order="C")  # (ascontiguousarray made a 0-d tensor shape (1,))
        raw = arr.reshape(-1).view(np.uint8)
        header = dict(version=version, name=name, dtype=arr.dtype.name, shape=list(arr.shape))
        if raw.size == 0:
            yield rollout_pb2.WeightChunk(offset=0, data=b"", **header)
        for off in range(0, raw.size, chunk_bytes):
            yield rollout_pb2.WeightChunk(offset=off, data=raw[off : off + chunk_bytes].tobytes(), **header)
