"""The engine interface behind the rollout server: what every backend (built-in JAX, vLLM) provides.

Weights cross the wire in Hugging Face naming and layout (the names in the checkpoint's safetensors
files, torch `[out, in]` linear layout), so that vLLM can load a pushed tensor as it would a checkpoint
and the JAX engine maps it through `models.hf_io` exactly like a checkpoint load.
"""

from __future__ import annotations

import abc
import dataclasses
import threading

import numpy as np

# The dtype names an engine computes in. Written out here (not taken from `precision.DTYPES`, which must
# equal it: tests/rollout/test_engine_dtypes.py) because the server and the vLLM engine import this module
# without importing JAX.
ENGINE_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """One Generate request's sampling settings (validated by the server before reaching an engine)."""

    n: int = 1  # samples per prompt
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    exact: bool = False  # batch-invariant log-probs equal to the trainer's exact scorer (models/exact.py)
    logit_noise_std: float = 0.0  # controlled mismatch: sample from softmax((logits + σ·ε) / T), ε ~ N(0, 1)
    return_routing: bool = False  # MoE: also return each token's chosen experts per sparse layer (Completion.routing)
    # Engines serving quantized weights (EngineInfo.quantize): this request's weights are W + s·(Q(W) − W)
    # (models/quantize.py `blend`); 1 = as served, 0 = full precision. No effect on an unquantized engine.
    quantize_strength: float = 1.0
    # Index of prompt 0 in the caller's whole batch: prompt i draws its randomness as prompt prompt_offset + i
    # of a request with this seed, so a batch split into requests (limits, several servers) samples the same.
    prompt_offset: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completion:
    """One sampled continuation.

    logprobs[t] is log μ(token_ids[t]) under the distribution the token was actually sampled from
    (after temperature / top-p / top-k processing), see docs/rollout.md on comparability with the trainer.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was produced, and is included) | "length"
    weight_version: int
    # MoE routing replay (SamplingSpec.return_routing): routing[t, j] = the k experts the j-th sparse layer's
    # router chose for token t of prompt + token_ids (as model input), [len(prompt) + len(token_ids), layers, k],
    # uint8 (<= 256 experts) or uint16. None when not requested.
    routing: np.ndarray | None = None
    # Top-k / top-p: kept_counts[t] = how many tokens the truncation kept when token t was sampled (the
    # support μ was renormalised over; the trainer renormalises π over its own `kept_counts[t]` most likely
    # tokens, `models.truncation`). None when the request did not truncate or the engine does not report it.
    kept_counts: list[int] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineInfo:
    architecture: str  # HF `architectures[0]`, e.g. "Qwen3ForCausalLM"
    vocab_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    engine: str  # "jax" | "vllm"
    weight_version: int
    max_model_len: int
    # optional SamplingSpec features supported: "exact", "logit_noise_std", "routing" (return_routing),
    # "quantize_strength", "kept_counts" (top-k/top-p completions carry Completion.kept_counts)
    options: tuple[str, ...] = ()
    quantize: str = "none"  # weight quantization the engine serves with: none | int8 | fp8 (models/quantize.py)
    # wire bytes of one token's expert ids in a completion's routing (sparse layers × k × itemsize); 0: no routing
    routing_bytes_per_token: int = 0


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name of the wire format, e.g. "float32"


class GenerationCancelled(RuntimeError):
    """`Engine.generate_cancellable` stopped because its caller went away; nothing is returned."""


class Engine(abc.ABC):
    """A generation backend. Implementations must make `update_weights` atomic with respect to `generate`."""

    @abc.abstractmethod
    def info(self) -> EngineInfo: ...

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """Sample `spec.n` completions for each prompt; result[i][j] is sample j of prompt i."""

    def generate_cancellable(self, prompts: list[list[int]], spec: SamplingSpec,
                             cancelled: threading.Event) -> list[list[Completion]]:
        """`generate` for a caller that may go away (a timed-out or cancelled RPC, a server shutting down): an
        engine that works in parts stops between them once `cancelled` is set and raises `GenerationCancelled`,
        so abandoned work does not hold the server's threads. The default runs `generate` to the end."""
        return self.generate(prompts, spec)

    @abc.abstractmethod
    def weight_specs(self) -> dict[str, TensorSpec]:
        """HF tensor name -> expected shape, for validating an UpdateWeights stream before applying it."""

    @abc.abstractmethod
    def update_weights(self, tensors: dict[str, np.ndarray], version: int) -> None:
        """Replace the full weight set and set the weight version, atomically.

        `tensors` have passed the server's checks (`validation.TensorAssembler`: exactly the names, shapes
        and dtype of `weight_specs`, every floating value finite), once for all engines. An engine raises
        ValueError to refuse a set (INVALID_ARGUMENT; old weights stay), WeightReloadError when applying a
        valid set failed, EngineUnusableError when it can no longer serve (see server.py for the codes).
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources (called on server shutdown)."""


class WeightReloadError(RuntimeError):
    """The engine failed while applying a weight set that had passed validation (an internal error).

    Not a malformed request, so the server answers INTERNAL rather than INVALID_ARGUMENT. `restored` says
    whether the engine then put the previous weights back: if True, the old weights and version are in
    service and the engine keeps serving (the trainer may push again); if False, the engine's parameters
    may be half-updated, it refuses every further call, and the server process must be restarted.
    """

    def __init__(self, message: str, *, restored: bool):
        super().__init__(message)
        self.restored = restored


class EngineUnusableError(RuntimeError):
    """The engine cannot serve any more (unknown weight state after a failed reload and restore, or closed).

    The server answers FAILED_PRECONDITION, not UNAVAILABLE: retrying against this process cannot succeed,
    only a restart of the server (which reloads the checkpoint) can, so clients must not back off and retry.
    """


def resolve_max_model_len(requested: int | None, max_position_embeddings: int | None) -> int:
    """The prompt + completion limit an engine serves with; the same rule for every engine.

    None means the model's `max_position_embeddings`. Left to itself vLLM would derive the default from
    several config keys (and scale it by some RoPE-scaling factors), so the JAX and vLLM engines could
    validate the same request differently; resolving it here keeps `GetInfo.max_model_len` and the
    server's request checks identical across engines. A limit beyond the positions the model was built
    for is refused (vLLM refuses it too), rather than served with untrained positions.
    """
    if max_position_embeddings is None:
        if requested is None:
            raise ValueError("config.json has no max_position_embeddings; pass max_model_len explicitly")
        limit = requested
    else:
        limit = int(max_position_embeddings)
    value = limit if requested is None else int(requested)
    if value < 2:
        raise ValueError(f"max_model_len must be >= 2 (one prompt and one completion token), got {value}")
    if value > limit:
        raise ValueError(f"max_model_len {value} exceeds the model's max_position_embeddings {limit}")
    return value


class NonFiniteLogprobsError(RuntimeError):
    """An engine produced a NaN/inf log-prob for a sampled token (bad weights, overflow in fp16, ...).

    Raised instead of passing the value on: a non-finite μ turns every importance ratio of the batch
    into NaN, and the trainer would only notice after the update had already been applied.
    """

    def __init__(self, prompt: int, sample: int, position: int, value: float, weight_version: int, where: str = ""):
        super().__init__(
            f"non-finite logprob {value} at prompt {prompt}, sample {sample}, position {position} "
            f"(weight version {weight_version}){f' from {where}' if where else ''}"
        )
        self.prompt, self.sample, self.position, self.value = prompt, sample, position, value
        self.weight_version = weight_version


def check_finite_logprobs(completions: list[list[Completion]]) -> None:
    """Raise NonFiniteLogprobsError for the first non-finite log-prob in `completions[prompt][sample]`."""
    for i, samples in enumerate(completions):
        for j, c in enumerate(samples):
            lp = np.asarray(c.logprobs, dtype=np.float64)
            bad = np.flatnonzero(~np.isfinite(lp))
            if bad.size:
                t = int(bad[0])
                raise NonFiniteLogprobsError(i, j, t, float(lp[t]), c.weight_version)
