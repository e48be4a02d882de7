"""How benchmark result JSON records a path (relative to the repository root when inside it), where it may be
written, and how it is written.

Results are committed; an absolute path would name one machine's checkout (or a worktree that no longer
exists) and change on every rerun. Relative paths and paths outside the repository are kept as given.

A benchmark never overwrites what it did not write (`check_out`, called right after the flags are parsed,
before the measurement): its `--out` must be new or a result of the same script — a JSON object whose
`"benchmark"` key names the script (`write_json` records it in every result; the committed results carry it
too). A Markdown table written beside the JSON (`.md`, same stem) may be replaced only when that JSON is
such a result: the two are written together. Anything else is refused with one line, exit code 2.

The same check runs again right before the result is written (`write_json`, for the JSON and its table both,
before either is written): a file or symbolic link that appeared at `--out` while the benchmark measured (or a
result replaced by something else) is refused the same way, exit code 2, and nothing is written. Each file
written is named on stdout (`wrote PATH`); the default `--out` is the committed result the README quotes, so a
rerun without `--out` replaces it.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = "benchmark"  # the key of a result JSON naming the script that wrote it
RECORDED = "recorded"  # the key of when it was written and the machine's load then


def repo_relative(path: str | os.PathLike | None) -> str | None:
    """An absolute `path` inside the repository as a path relative to its root; anything else unchanged."""
    if path is None or not os.path.isabs(path):
        return None if path is None else str(path)
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)


def repo_relative_args(args: dict) -> dict:
    """A copy of parsed arguments with every absolute path inside the repository made relative to it."""
    return {k: repo_relative(v) if isinstance(v, (str, os.PathLike)) else v for k, v in args.items()}


def script_name(script: str | os.PathLike) -> str:
    """How a result names the benchmark script (its `__file__`) that wrote it: `benchmarks/<name>.py`."""
    return f"benchmarks/{Path(script).name}"


def is_result(path: str | os.PathLike, script: str | os.PathLike) -> bool:
    """Whether `path` holds a result JSON written by `script` (its `MARKER` key names the script)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get(MARKER) == script_name(script)


def check_out(flag: str, path: str | os.PathLike, script: str | os.PathLike, *, table: bool = False) -> None:
    """Exit 2 with one line `error: ...` naming `flag` and the path unless `path` (and with `table` its `.md`
    sibling) may receive `script`'s result: new, or that script's earlier result (see the module doc). As a
    benchmark's other flag checks, before anything is measured; `write_json` runs it again before writing."""
    _check(flag, path, script, table=table)


def _check(flag: str, path: str | os.PathLike, script: str | os.PathLike, *, table: bool, note: str = "") -> None:
    from jaxrl_mismatch.outputs import check_out_file
    from jaxrl_mismatch.usage import UsageError

    what = f"a result of {script_name(script)}"
    try:
        check_out_file(flag, str(path), ours=lambda p: is_result(p, script), what=what)
        if table:
            check_out_file(flag, str(Path(path).with_suffix(".md")), ours=lambda _: is_result(path, script),
                           what=f"the table of {what}")
    except UsageError as e:
        print(f"error: {e}{note}", file=sys.stderr)
        sys.exit(2)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a file atomically: a temporary sibling renamed into place, as every output of the package is written
    (`jaxrl_mismatch.outputs.staged_file`), creating its folder. An interrupted run leaves the previous file
    intact, never a half-written one. Unchecked and silent: a benchmark's result goes through `write_json` (which
    checks `--out` again and names what it wrote); this alone is for a benchmark's own scratch files."""
    from jaxrl_mismatch.outputs import staged_file

    with staged_file(str(path)) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj: dict, script: str | os.PathLike, *, table: str | None = None,
               flag: str = "--out") -> None:
    """Write `script`'s result JSON (indented, ending in a newline; `MARKER` first) atomically, as `write_text`,
    and with `table` that Markdown text beside it (`.md`, same stem), each followed by a line `wrote PATH`.

    First `flag`'s check (`check_out`) runs again on both paths, so a file or symbolic link that appeared there
    while the benchmark ran is not replaced: one line `error: ...`, exit 2, nothing written.

    Every result also records when it was written and the machine's load then (`RECORDED`: the UTC time and
    the 1/5/15-minute load averages), so a number quoted from it can be told from a loaded machine's; a result
    that records its own is kept as it is."""
    _check(flag, path, script, table=table is not None,
           note=" (checked again before writing the result: nothing was written)")
    recorded = {"utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "loadavg_at_write": [round(x, 2) for x in os.getloadavg()]}
    write_text(path, json.dumps({MARKER: script_name(script), RECORDED: recorded, **obj}, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
    if table is not None:
        md = Path(path).with_suffix(".md")
        write_text(md, table)
        print(f"wrote {md}", flush=True)
