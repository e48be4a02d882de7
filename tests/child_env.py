"""The environment of a process a test starts: this one's, less the session's 8 fake CPU devices.

The other XLA flags stay: tests/conftest.py gives the processes of a low-level test XLA:CPU's older emitters
through XLA_FLAGS, as the trainer's launcher passes a user's flags on to its rollout server."""

from __future__ import annotations

import os

from jaxrl_mismatch.rollout.launcher import server_env


def child_env(**extra: str) -> dict[str, str]:
    """`os.environ` without `--xla_force_host_platform_device_count`, updated with `extra`."""
    return server_env(os.environ) | extra
