"""Count XLA compilations of a jitted function (the LR-from-the-host contract is "never recompile").

Uses jax.monitoring's public event listener: every backend compile emits a duration event tagged
with the jitted function's name. Used by tests and by `benchmarks/update_step.py`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compilations(fun_name: str) -> Iterator[dict[str, int]]:
    """Yields a dict whose "compiles" entry counts backend compilations of `jit(fun_name)` inside the block."""
    counts = {"compiles": 0}

    def listener(event, duration, **kwargs):
        del duration
        if event == BACKEND_COMPILE and kwargs.get("fun_name") == f"jit({fun_name})":
            counts["compiles"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
