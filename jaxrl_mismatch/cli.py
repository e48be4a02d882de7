"""`jaxrl-mismatch` command line: one subcommand per job, each owned by its package.

Subcommands are imported lazily so that `jaxrl-mismatch serve` does not pay for the trainer's imports
and vice versa.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function taking argv list, one-line help)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("jaxrl_mismatch.train.run", "main", "run an RL training job from an ml_collections config"),
    "serve": ("jaxrl_mismatch.rollout.server", "main", "start a gRPC rollout server (jax or vllm engine)"),
    "report": ("jaxrl_mismatch.report.plot", "main", "write a PNG report of a run directory"),
    "warmstart": ("jaxrl_mismatch.data.warmstart", "main", "supervised warm start of the tiny demo policy"),
    "perfectible": ("jaxrl_mismatch.train.perfectible_run", "main", "keep prompts the initial policy solves 20-80% of the time"),
}


def _usage() -> str:
    lines = ["usage: jaxrl-mismatch COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {doc}" for name, (_, _, doc) in _COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"jaxrl-mismatch: unknown command {name!r}; valid: {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = _COMMANDS[name]
    result = getattr(importlib.import_module(module), func)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
