"""User-facing errors of the command line: one line naming what is wrong, a documented exit code, no traceback.

Any layer may raise `UsageError` for input a user supplied (a flag, a config field, a file, a run
directory); `cli.main` prints it as `error: <message>` and exits 2. `ArgumentParser` is argparse with
its errors routed the same way (argparse itself prints a usage block and exits from inside the parser).
A failure of the environment rather than of the input (a checkpoint that cannot be written or read back)
is an `EnvironmentFailure`, printed the same way with its own exit code (`EXIT_CODES`).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import stat
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


def first_line(e: BaseException) -> str:
    """An exception's message as one line (its first; its type's name when it has none), for one-line errors."""
    return (str(e).splitlines() or [type(e).__name__])[0]


class UsageError(ValueError):
    """Bad input from the user; the message names the flag, field or file at fault."""


class Terminated(BaseException):
    """SIGTERM while a command wrote an output (`outputs.staged_dir` / `staged_file`), raised so its temporary is
    removed; `cli.main` says so and exits 143 (the signal's own code). A BaseException, as KeyboardInterrupt."""


class RepeatedOptionError(UsageError):
    """An option given twice (`ArgumentParser`); `dest` is its argparse destination, for a caller that appended
    the option itself (train's warm start appends `--out`) and words the refusal its own way."""

    def __init__(self, message: str, dest: str):
        super().__init__(message)
        self.dest = dest


# The exit codes of every subcommand (docs and `jaxrl-mismatch --help` list them).
EXIT_CODES = {
    0: "finished",
    1: "unexpected failure (a bug or an unforeseen error; --debug shows the traceback)",
    2: "bad input: a flag, config field, file or directory (nothing was changed)",
    3: "the rollout server failed for good (a resumable checkpoint was written)",
    4: "storage failure: a checkpoint could not be written or read back (the previous one is intact)",
    130: "interrupted (Ctrl-C)",
    143: "stopped by SIGTERM after checkpointing the current step (rerun to resume)",
}
EXIT_STORAGE = 4
EXIT_STOPPED = 143


def exit_on_usage_error(check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`check(*args, **kwargs)` for a standalone script (a benchmark, an experiment summary), with a `UsageError`
    turned into what `cli.main` makes of it: one line `error: <message>` on stderr and exit code 2."""
    try:
        return check(*args, **kwargs)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


class EnvironmentFailure(RuntimeError):
    """Not the user's input: the environment failed (storage, I/O). The message is one line; `exit_code`
    is one of `EXIT_CODES`."""

    exit_code = EXIT_STORAGE


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors raise `UsageError` (one line) instead of printing usage and exiting, and which refuses
    an option given twice (argparse let the last one win: `export --out a --out b` wrote b without a word)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see --help)")

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):
        self._refuse_repeats(sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(args, namespace)

    def _refuse_repeats(self, argv: list[str]) -> None:
        """UsageError naming an option that takes one value (or is one switch) and is given twice, by any of its
        names or abbreviations; options meant to repeat (append, count) may. Up to "--" and up to a subcommand:
        a subcommand's parser checks its own options."""
        seen: dict[argparse.Action, str] = {}
        for token in argv:
            if token == "--":
                return
            if not token.startswith("-") or token == "-":
                if any(token in getattr(a, "choices", None) or () for a in self._subparsers_actions()):
                    return
                continue
            name = token.split("=", 1)[0]
            action = self._option_string_actions.get(name)
            if action is None and self.allow_abbrev and name.startswith("--"):
                found = {a for s, a in self._option_string_actions.items() if s.startswith(name)}
                action = found.pop() if len(found) == 1 else None
            if action is None or isinstance(action, (argparse._AppendAction, argparse._AppendConstAction,
                                                     argparse._CountAction, argparse._HelpAction)):
                continue
            if action in seen:
                what = f"{name} given twice" if seen[action] == name else f"{seen[action]} and {name} both given"
                raise RepeatedOptionError(f"{self.prog}: {what}; give {'/'.join(action.option_strings)} once (see "
                                          "--help)", action.dest)
            seen[action] = name

    def _subparsers_actions(self) -> list[argparse.Action]:
        return [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]


def listing(names: Sequence[str], shown: int = 3) -> str:
    """The first `shown` names and how many there are, for a one-line error: "a, b, c, ... (7 entries)"."""
    names = list(names)
    return ", ".join(names[:shown]) + (f", ... ({len(names)} entries)" if len(names) > shown else "")


def mode_kind(mode: int) -> str:
    """What a file of this `st_mode` is, for an error: "a directory", "a file", "a FIFO", "a socket", ..."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return f"a file of type {stat.S_IFMT(mode):#o}"


def path_kind(path: str) -> str:
    """What `path` is, for an error about a path that is not the file or directory expected: "does not exist",
    "is a directory", "is a FIFO", ... (a FIFO given as a config file was reported as "no such file")."""
    try:
        return "is " + mode_kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return "does not exist"
    except NotADirectoryError:
        return "does not exist (a folder on its path is a file)"
    except OSError as e:
        return f"cannot be looked at ({e.strerror})"


def existing_file(flag: str, path: str) -> str:
    """`path` if it is a readable file, else a UsageError naming the flag."""
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path}: {path_kind(path)}; expected a file")
    return path


def existing_dir(flag: str, path: str) -> str:
    """`path` if it is a directory, else a UsageError naming the flag."""
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: {path_kind(path)}; expected a directory")
    return path


def int_list(flag: str, text: str) -> list[int]:
    """Comma-separated integers (at least one), else a UsageError naming the flag."""
    if not text.strip():
        raise UsageError(f"{flag}: expected at least one integer")
    try:  # an empty entry ("1,,2", "1,") is a typo, not a list of fewer values
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from None


SEED_LIMIT = 2**31  # seeds key numpy generators, nnx.Rngs and the engines' int32 sampling streams
INT32_MAX = 2**31 - 1  # the largest count a flag may give where it reaches an int32 (the rollout protocol, JAX arrays)
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max / .tiny, without importing numpy
FLOAT32_TINY = 1.1754943508222875e-38


def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say): what the jobs check a size flag's
    arrays against before they are built, so a size that cannot fit is one line, not a MemoryError later."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_seed(flag: str, value: int) -> int:
    """`value` if it is a seed in [0, 2^31), else a UsageError naming the flag (a huge seed failed deep inside a
    job with numpy's or C's own overflow, a negative one was taken by some and refused by others)."""
    if not 0 <= value < SEED_LIMIT:
        raise UsageError(f"{flag} must be in [0, 2^31), got {value}")
    return value


def port(text: str) -> int:
    """argparse type of a TCP port: 0 (pick a free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is outside 0-65535 (0 picks a free port)")
    return value


def host_port(flag: str, text: str) -> tuple[str, int]:
    """(host, port) of a server address `host:port` (`[v6]:port` for IPv6); UsageError naming `flag` for an
    address without a port, a port outside 1-65535, or an empty host."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not port_text.isdigit() or (":" in host and not host.startswith("[")):
        raise UsageError(f"{flag} {text!r}: needs host:port (e.g. 10.0.0.5:50051, [::1]:50051)")
    if not host.strip("[]"):
        raise UsageError(f"{flag} {text!r}: empty host; use host:port")
    value = int(port_text)
    if not 1 <= value <= 65535:
        raise UsageError(f"{flag} {text!r}: port {value} is outside 1-65535")
    return host.strip("[]"), value


def call_file_function(path: str, function: str, label: str, *args: Any) -> Any:
    """`function(*args)` of the Python file `path` (a config or spec file); any failure to load or run it is
    one UsageError starting with `label` (e.g. "--config FILE")."""
    if not os.path.isfile(path):
        raise UsageError(f"{label}: {path_kind(path)}; expected a Python file")
    name = f"_jaxrl_file_{abs(hash(os.path.abspath(path)))}"
    # The loader is named: for a file not ending in .py, spec_from_file_location finds none and returns None.
    spec = importlib.util.spec_from_file_location(name, path, loader=importlib.machinery.SourceFileLoader(name, path))
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        fn = getattr(module, function, None)
        if fn is None:
            raise UsageError(f"{label}: defines no {function}()")
        return fn(*args)
    except UsageError:
        raise
    except SystemExit as e:  # sys.exit() in the file ended the command with its code and no word of why
        raise UsageError(f"{label}: cannot load it: it called sys.exit({e.code!r})") from None
    except Exception as e:  # noqa: BLE001 - a broken user file is bad input: one line naming it
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise UsageError(f"{label}: cannot load it{where}: {type(e).__name__}: {e}") from None
