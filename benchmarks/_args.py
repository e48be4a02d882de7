"""The benchmark scripts' argument parser and types: an error is one line; a count of 0 or a temperature of 0 is refused when the flags are
parsed (argparse's `error: argument --FLAG: ...`, exit 2), before anything is built or measured. Without them a
zero count measured nothing and then failed on the median of an empty list, or wrote NaN rates and "0 tokens
differ" as a result."""

from __future__ import annotations

import argparse
import math

from jaxrl_mismatch import usage


class ArgumentParser(usage.ArgumentParser):
    """The project's parser (an error is `UsageError("PROG: message (see --help)")`), ending a standalone script
    as `--out`'s check does: one line `error: ...` naming the flag, exit 2, instead of argparse's usage block."""

    def error(self, message: str):
        usage.exit_on_usage_error(super().error, message)


def positive_int(text: str) -> int:
    """An integer >= 1 (repeats, iterations, prompts, sizes)."""
    return _int(text, 1)


def nonneg_int(text: str) -> int:
    """An integer >= 0 (warm-up steps, seeds, staleness)."""
    return _int(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0 (temperatures, learning rates, peak rates)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return x


def _int(text: str, low: int) -> int:
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if x < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {x}")
    return x
