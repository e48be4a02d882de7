"""User-facing errors of the command line: one line naming what is wrong, exit code 2, no traceback.

Any layer may raise `UsageError` for input a user supplied (a flag, a config field, a file, a run
directory); `cli.main` prints it as `error: <message>` and exits 2. `ArgumentParser` is argparse with
its errors routed the same way (argparse itself prints a usage block and exits from inside the parser).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any, NoReturn


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


def call_file_function(path: str, function: str, label: str, *args: Any) -> Any:
    """`function(*args)` of the Python file `path` (a config or spec file); any failure to load or run it is
    one UsageError starting with `label` (e.g. "--config FILE")."""
    if not os.path.isfile(path):
        raise UsageError(f"{label}: " + ("is a directory" if os.path.isdir(path) else "no such file"))
    spec = importlib.util.spec_from_file_location(f"_jaxrl_file_{abs(hash(os.path.abspath(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        fn = getattr(module, function, None)
        if fn is None:
            raise UsageError(f"{label}: defines no {function}()")
        return fn(*args)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken user file is bad input: one line naming it
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise UsageError(f"{label}: cannot load it{where}: {type(e).__name__}: {e}") from None
