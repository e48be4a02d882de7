"""User-facing errors of the command line: one line naming what is wrong, exit code 2, no traceback.

Any layer may raise `UsageError` for input a user supplied (a flag, a config field, a file, a run
directory); `cli.main` prints it as `error: <message>` and exits 2. `ArgumentParser` is argparse with
its errors routed the same way (argparse itself prints a usage block and exits from inside the parser).
"""

from __future__ import annotations

import argparse
import os
from typing import NoReturn


class UsageError(ValueError):
    """Bad input from the user; the message names the flag, field or file at fault."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors raise `UsageError` (one line) instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see --help)")


def existing_file(flag: str, path: str) -> str:
    """`path` if it is a readable file, else a UsageError naming the flag."""
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise UsageError(f"{flag} {path}: {what}; expected a file")
    return path


def existing_dir(flag: str, path: str) -> str:
    """`path` if it is a directory, else a UsageError naming the flag."""
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise UsageError(f"{flag} {path}: {what}; expected a directory")
    return path


def port(text: str) -> int:
    """argparse type of a TCP port: 0 (pick a free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is outside 0-65535 (0 picks a free port)")
    return value
