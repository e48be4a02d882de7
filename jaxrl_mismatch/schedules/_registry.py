"""Argument checking shared by the schedule, optimizer and controller registries (no jax: controllers use it)."""

from __future__ import annotations

import inspect
from typing import Any, Callable


def check_kwargs(kind: str, name: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Raise a `TypeError` naming unknown or missing arguments of `factory` and listing the accepted ones."""
    params = inspect.signature(factory).parameters
    accepted = [p for p in params if params[p].kind is not inspect.Parameter.VAR_KEYWORD]
    unknown = sorted(set(kwargs) - set(accepted))
    missing = sorted(
        p for p, spec in params.items()
        if spec.default is inspect.Parameter.empty
        and spec.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p not in kwargs
    )
    if unknown or missing:
        problems = []
        if unknown:
            problems.append(f"unknown argument(s) {unknown}")
        if missing:
            problems.append(f"missing required argument(s) {missing}")
        raise TypeError(f"{kind} {name!r}: {'; '.join(problems)}; accepted: {accepted}")
