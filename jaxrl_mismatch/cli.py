"""`jaxrl-mismatch` command line: one subcommand per job, each owned by its package.

Subcommands are imported lazily so that `jaxrl-mismatch serve` does not pay for the trainer's imports
and vice versa. Bad input anywhere (`usage.UsageError`: a flag, a config field, a file, a run directory)
ends as one line `error: ...` and exit code 2; a failure of the environment (`usage.EnvironmentFailure`:
storage) prints one line with its own code; anything else prints one line too and exits 1 (`usage.EXIT_CODES`
lists them all). `--debug` (before or after the subcommand) shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module, function taking argv list, one-line help)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("jaxrl_mismatch.jobs.train", "main", "run an RL training job from an ml_collections config"),
    "serve": ("jaxrl_mismatch.rollout.server", "main", "start a gRPC rollout server (jax or vllm engine)"),
    "report": ("jaxrl_mismatch.report.plot", "main", "write a PNG report of a run directory"),
    "export": ("jaxrl_mismatch.jobs.export", "main", "write a trained policy (any checkpoint step) as an HF checkpoint"),
    "compare": ("jaxrl_mismatch.jobs.compare", "main", "run a grid of config variants x seeds; table + overlay figure"),
    "analyze": ("jaxrl_mismatch.jobs.analyze", "main", "offline mismatch analysis (rollouts, BF16 softmax, attribution)"),
    "warmstart": ("jaxrl_mismatch.jobs.warmstart", "main", "supervised warm start of the tiny demo policy"),
    "perfectible": ("jaxrl_mismatch.jobs.perfectible", "main", "keep prompts the initial policy solves 20-80% of the time"),
}


def _usage() -> str:
    lines = ["usage: jaxrl-mismatch [--debug] COMMAND [ARGS...]   (COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<12} {doc}" for name, (_, _, doc) in _COMMANDS.items()]
    from jaxrl_mismatch.usage import EXIT_CODES

    lines += ["", "exit codes:"] + [f"  {code:<4} {what}" for code, what in EXIT_CODES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    as_program = argv is None  # the console script / `python -m`: may end the process itself
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv:  # no command: the usage on stderr and exit 2, as a missing argument is everywhere else
        print(_usage(), file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"error: unknown command {name!r}; valid: {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    from jaxrl_mismatch.usage import EnvironmentFailure, Terminated, UsageError

    module, func, _ = _COMMANDS[name]
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except UsageError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EnvironmentFailure as e:
        if debug:
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        if as_program:
            # A save that failed before orbax created its directory leaves orbax's non-daemon signalling
            # threads waiting (up to minutes) for a signal that never comes; the job's own resources are
            # closed by now (checkpointer, run log, rollout server, run lock), so exit without joining them.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.exit_code)
        return e.exit_code
    except PermissionError as e:  # a file or folder given to the command that it may not read or write
        if debug:
            raise
        print(f"error: {e.filename or name}: {e.strerror or e}", file=sys.stderr)
        return 2
    except Terminated:
        print("error: stopped by SIGTERM; the output being written was removed (nothing half-written is left)",
              file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - the one place that turns failures into a line for the user
        if debug:
            raise
        print(f"error: {name}: {type(e).__name__}: {str(e).strip() or '(no message)'}\n"
              "(not a usage error; rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
