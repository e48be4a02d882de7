"""Rollout: the gRPC service between the trainer and a generation engine (built-in JAX or vLLM).

The trainer uses a `RolloutSession` (`session.py`: a launched (`launcher.py`) or attached server, the typed
`RolloutClient`, weight versions and the recovery policy; several servers through `fleet.RolloutFleet`);
`jaxrl-mismatch serve` runs `server.main` around one engine (`jax_engine`, `vllm_engine`). `protocol.py`
owns the wire format both ends share (constants, message mappings, the weight-tensor layout);
`validation.py` checks every incoming RPC before an engine sees it; `shm.py` is the same-host weight
transport. In the JAX engine, `sampling` draws tokens, `exact_sampler` / `spec_exact` sample in exact mode
(μ bitwise equal to the trainer's exact scorer) and with injected mismatch; `mismatch_schedule` gives that
mismatch's strength per step (read by the training loop). Importing this package loads neither JAX nor vLLM (the engines and `sampling`
are imported where they are used), so a vLLM server process and a light client stay light. See
docs/rollout.md.
"""

from jaxrl_mismatch.rollout.client import (
    EngineMismatchError,
    ForeignCompletionError,
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
    "ForeignCompletionError",
    "NonFiniteLogprobsError",
    "RetryPolicy",
    "RolloutClient",
    "RolloutError",
    "SamplingSpec",
    "StaleCompletionError",
    "TensorSpec",
]
