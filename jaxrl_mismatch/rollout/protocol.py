"""Wire constants of the Rollout service that both ends must agree on (client, server, launcher).

Kept apart from `server.py` and `client.py` so that neither imports the other: the service name for
health checks, the token's environment variable, the trailing-metadata keys that carry machine-readable
error kinds, the ready/listening lines a launcher waits for, and the transport's message-size limit.
"""

from __future__ import annotations

from jaxrl_mismatch.rollout import rollout_pb2

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
TOKEN_ENV = "JAXRL_ROLLOUT_TOKEN"

# Trailing metadata: `ERROR_KIND_KEY` names a machine-readable error kind.
ERROR_KIND_KEY = "jaxrl-error"
NON_FINITE = "non-finite-logprobs"  # INTERNAL; details under NON_FINITE_DETAIL_KEY
NON_FINITE_DETAIL_KEY = "jaxrl-non-finite"  # "prompt,sample,position,value,weight_version"
WEIGHT_RELOAD_FAILED = "weight-reload-failed"  # INTERNAL; the previous weights stay in service
ENGINE_UNUSABLE = "engine-unusable"  # FAILED_PRECONDITION; the server must be restarted
SHM_UNREACHABLE = "shm-unreachable"  # FAILED_PRECONDITION on UpdateWeightsShm: push over UpdateWeights instead

# Lines `jaxrl-mismatch serve` prints (JSON payload after the prefix); the ready payload is also written
# atomically to `--ready-file`, which is what a launcher polls.
READY_PREFIX = "JAXRL_ROLLOUT_READY"
LISTENING_PREFIX = "JAXRL_ROLLOUT_LISTENING"

# Transport limit on both sides. Requests are bounded far below it by `validation.Limits`; weight tensors
# travel in chunks of a few MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
