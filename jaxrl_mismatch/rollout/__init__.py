"""Rollout: the gRPC service between the trainer and a generation engine (built-in JAX or vLLM).

The trainer uses a `RolloutSession` (`session.py`: a launched or attached server, the typed `RolloutClient`,
weight versions and the recovery policy; several servers through `fleet.RolloutFleet`); `jaxrl-mismatch serve`
runs `server.main` around one engine (`jax_engine`, `vllm_engine`). Importing this package loads neither
JAX nor vLLM (the engines and `sampling` are imported where they are used), so a vLLM server process and a
light client stay light. See docs/rollout.md.
"""

from jaxrl_mismatch.rollout.client import (
    EngineMismatchError,
    RetryPolicy,
    RolloutClient,
    RolloutError,
    StaleCompletionError,
)
from jaxrl_mismatch.rollout.engine import (
    Completion,
    Engine,
    EngineInfo,
    NonFiniteLogprobsError,
    SamplingSpec,
    TensorSpec,
)

__all__ = [
    "Completion",
    "Engine",
    "EngineInfo",
    "EngineMismatchError",
    "NonFiniteLogprobsError",
    "RetryPolicy",
    "RolloutClient",
    "RolloutError",
    "SamplingSpec",
    "StaleCompletionError",
    "TensorSpec",
]
