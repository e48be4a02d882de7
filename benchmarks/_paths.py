"""How benchmark result JSON records a path (relative to the repository root when inside it), and how it is written.

Results are committed; an absolute path would name one machine's checkout (or a worktree that no longer
exists) and change on every rerun. Relative paths and paths outside the repository are kept as given.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repo_relative(path: str | os.PathLike | None) -> str | None:
    """An absolute `path` inside the repository as a path relative to its root; anything else unchanged."""
    if path is None or not os.path.isabs(path):
        return None if path is None else str(path)
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)


def repo_relative_args(args: dict) -> dict:
    """A copy of parsed arguments with every absolute path inside the repository made relative to it."""
    return {k: repo_relative(v) if isinstance(v, (str, os.PathLike)) else v for k, v in args.items()}


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a benchmark's result file (a JSON record, a Markdown table) atomically: a temporary sibling renamed
    into place, as every output of the package is written (`jaxrl_mismatch.outputs.staged_file`), creating its
    folder. An interrupted run leaves the previous result intact, never a half-written one."""
    from jaxrl_mismatch.outputs import staged_file

    with staged_file(str(path)) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj) -> None:
    """Write a benchmark's result JSON (indented, ending in a newline) atomically, as `write_text`."""
    write_text(path, json.dumps(obj, indent=2) + "\n")
