"""The benchmark scripts' argument parser and types: an error is one line; a count of 0 or a temperature of 0 is refused when the flags are
parsed (argparse's `error: argument --FLAG: ...`, exit 2), before anything is built or measured. Without them a
zero count measured nothing and then failed on the median of an empty list, or wrote NaN rates and "0 tokens
differ" as a result.

Counts are also bounded above by int32 (`INT32_MAX`): token ids, vocabulary sizes, sequence lengths and positions
are int32 arrays in JAX (and in the numpy arrays fed to it), so a larger count failed after the flags were
accepted (OverflowError, MemoryError) or silently wrapped around. Where a count sizes an array, a script also
checks the array against the machine's memory (`check_fits`) before building anything.

`--help` shows each script's first docstring paragraph (`description`) and every flag's default.
"""

from __future__ import annotations

import argparse
import math
import os

from jaxrl_mismatch import usage
from jaxrl_mismatch.usage import FLOAT32_MAX, FLOAT32_TINY
from jaxrl_mismatch.usage import INT32_MAX  # noqa: F401 - the scripts' bound, re-exported (update_step_gpu)



def description(doc: str | None) -> str:
    """The first paragraph of a script's docstring (up to its first blank line): what `--help` shows above the
    flags. (Its first line alone cut sentences mid-way.)"""
    return (doc or "").strip().split("\n\n", 1)[0]


class ArgumentParser(usage.ArgumentParser):
    """The project's parser (an error is `UsageError("PROG: message (see --help)")`), ending a standalone script
    as `--out`'s check does: one line `error: ...` naming the flag, exit 2, instead of argparse's usage block.
    `--help` lists every flag's default (`(default: X)`, unless the flag's help mentions `%(default)s` itself or
    the default is None/False, whose meaning the help text gives)."""

    def error(self, message: str):
        usage.exit_on_usage_error(super().error, message)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        default, text = action.default, action.help
        if (action.option_strings and text is not argparse.SUPPRESS and default not in (None, False, argparse.SUPPRESS)
                and "%(default)" not in (text or "")):
            action.help = f"{text} (default: %(default)s)" if text else "default: %(default)s"
        return action


def positive_int(text: str) -> int:
    """An integer in 1..INT32_MAX (repeats, iterations, prompts, sizes)."""
    return _int(text, 1)


def nonneg_int(text: str) -> int:
    """An integer in 0..INT32_MAX (warm-up steps, seeds, staleness)."""
    return _int(text, 0)


def positive_float(text: str) -> float:
    """A number > 0 that float32 holds (temperatures, learning rates, peak rates): --lr 1e99 was inf in the float32
    step (a traceback from torch's Adam), --temperature 1e99 inf in the float32 head (recorded as 1e99)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    if not FLOAT32_TINY <= x <= FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"expected a number in float32's range [{FLOAT32_TINY:.4g}, "
                                         f"{FLOAT32_MAX:.4g}], got {text!r}")
    return x


def _int(text: str, low: int) -> int:
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if x < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {x}")
    if x > INT32_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer in {low}..{INT32_MAX} (int32), got {x}")
    return x


def check_fits(ap: argparse.ArgumentParser, flags: str, nbytes: float, what: str) -> None:
    """One line naming `flags` (exit 2, through `ap.error`) when `what`, one array the flags size, needs more than
    this machine's physical memory on its own: the run could only end in a MemoryError (or the OOM killer) after
    the flags were accepted. A lower bound on what the run needs, so it never refuses a run that fits (nor any run
    where the OS does not say its memory)."""
    total = usage.physical_memory_bytes()
    if total is not None and nbytes > total:
        ap.error(f"{flags}: {what} alone needs {_gb(nbytes)}, more than this machine's {_gb(total)} of memory")


def _gb(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


def check_model(flag: str, path: str, config=None, *, missing: str = "") -> None:
    """Exit 2 with one line `error: FLAG PATH: ...` unless `path` holds a policy checkpoint a run can use, checked
    as the package's jobs check a user's model folder, before anything is measured: a directory with a readable
    config.json of a supported architecture and weight files that open (`jobs._inputs.model_config`), a tokenizer
    that loads and fits the model's vocabulary (as `train` loads it), and, given the run's `config` (with
    `model.path` = `path`), what the trainer checks of the model against it (`config_checks.check_model`) and an
    arithmetic task's task.json (`jobs._inputs.task_json`). (A folder whose config.json is no model's, or a saved
    model without its tokenizer, otherwise failed with a traceback inside the measurement.) `missing` is appended
    when `path` does not exist (how to make it)."""
    if missing and not os.path.lexists(path):
        usage.exit_on_usage_error(_raise, f"{flag} {path}: does not exist; {missing}")
    usage.exit_on_usage_error(_check_model, flag, str(path), config)


def _raise(message: str):
    raise usage.UsageError(message)


def _check_model(flag: str, path: str, config) -> None:
    from jaxrl_mismatch.data.tokenizer import load_tokenizer
    from jaxrl_mismatch.jobs._inputs import model_config, task_json

    cfg = model_config(flag, path)
    try:
        load_tokenizer(path).check_model_vocab(cfg.vocab_size)
    except (OSError, ValueError) as e:
        raise usage.UsageError(f"{flag} {path}: {e}") from None
    if config is None:
        return
    from jaxrl_mismatch.train.config_checks import check_model as check_against_config

    if config.task.name == "arithmetic":
        task_json(flag, path)
    try:
        check_against_config(config, cfg)
    except usage.UsageError as e:
        raise usage.UsageError(f"{flag} {path}: {e}") from None
