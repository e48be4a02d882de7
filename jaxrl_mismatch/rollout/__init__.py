"""Rollout: the gRPC service between the trainer and a generation engine (built-in JAX or vLLM).

The trainer uses `RolloutClient`; `jaxrl-mismatch serve` runs `server.main`. Importing this package
loads neither JAX nor vLLM (the engines and `sampling` are imported where they are used), so a vLLM
server process and a light client stay light. See docs/rollout.md.
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
