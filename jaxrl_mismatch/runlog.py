"""The run log: one JSONL record per step (`metrics.jsonl`) plus TensorBoard events — written by `train`,
read by `report` and the comparison tools.

Why these writers: `clu.metric_writers` imports TensorFlow (+1.4 GB), which this project otherwise never
needs. TensorBoard event files come from tensorboardX (~1 MB); `metrics.jsonl` is what `report`, `compare`
and any notebook read without TensorBoard.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Mapping

import numpy as np

from jaxrl_mismatch.outputs import staged_file
from jaxrl_mismatch.usage import UsageError, path_kind

METRICS_FILE = "metrics.jsonl"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.generic, np.ndarray)):
        v = v.item() if np.ndim(v) == 0 else v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # JSON has no NaN/inf; keep them visible as strings
    return v


class RunWriter:
    """Writes each step's scalars to `<run_dir>/metrics.jsonl` and TensorBoard event files.

    On resume the JSONL file is cut back to the lines before the resumed step, so a restarted run never shows
    a step twice; every other line is kept as it was, and the cut records are kept beside it as
    `metrics.jsonl.cut-<ns>` (`_split_at`). A fresh start (no step to resume) in a
    directory that already holds a metrics.jsonl renames that file to `metrics.jsonl.replaced-<ns>` (kept).
    """

    def __init__(self, run_dir: str, *, resume_from_step: int | None = None, tensorboard: bool = True) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, METRICS_FILE)
        if resume_from_step is not None and os.path.exists(self.path):
            kept, cut = _split_at(self.path, resume_from_step)
            if cut:
                # The records the resume redoes are kept beside the log, never deleted: after a crash they are
                # logged again, but after a damaged checkpoint or an accepted config change they are the only
                # record of the steps as first run. Written before the log is cut: a crash leaves both.
                aside = f"{self.path}.cut-{time.time_ns()}"
                _write_atomic(aside, cut)
                print(f"warning: {self.path}: the records of steps >= {resume_from_step}, which this resume redoes, "
                      f"are kept as {os.path.basename(aside)}", file=sys.stderr, flush=True)
            _write_atomic(self.path, kept)
        elif os.path.lexists(self.path):
            # A fresh start never deletes an earlier log: it is kept beside the new one, renamed. So is a symbolic
            # link to a missing file met at a resume: appending through it created its target outside the run.
            aside = f"{self.path}.replaced-{time.time_ns()}"
            os.rename(self.path, aside)
            what = "an earlier log of this run directory" if resume_from_step is None else "a dangling symbolic link"
            print(f"warning: {self.path}: {what}; kept as {os.path.basename(aside)}", file=sys.stderr, flush=True)
        self._f = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            # TensorBoard shows the events from `purge_step` on as this run writes them: a resume's redone steps
            # and a fresh start's steps are not shown twice beside the earlier events (kept on disk, not deleted).
            # The file name's own part is the second and host: a writer started within the same second as the
            # earlier one opened its file again and emptied it; the nanosecond suffix keeps each writer's own.
            self._tb = SummaryWriter(os.path.join(run_dir, "tb"), filename_suffix=f".{time.time_ns()}",
                                     purge_step=-1 if resume_from_step is None else resume_from_step)  # -1: step -1

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        record = {"step": int(step), **{k: _jsonable(v) for k, v in scalars.items()}}
        self._f.write(json.dumps(record) + "\n")
        self._tensorboard(step, scalars)

    def _tensorboard(self, step: int, scalars: Mapping[str, Any]) -> None:
        if self._tb is not None:
            for k, v in scalars.items():
                if isinstance(v, (int, float, np.generic)) and math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), int(step))

    def amend(self, step: int, scalars: Mapping[str, Any]) -> dict[str, Any]:
        """Add `scalars` to the last record of `step` (one written before a resume: a step whose validation a
        rollout failure interrupted), in place, so the log keeps one record per step; returns the merged record.
        The file is rewritten through `_write_atomic`; with no record of `step` left, one is written."""
        self._f.close()
        with open(self.path, "rb") as f:
            lines = [raw if raw.endswith(b"\n") else raw + b"\n" for raw in f]

        def of_step(raw: bytes) -> bool:
            obj = _parse(raw)
            return isinstance(obj, dict) and _is_step(obj.get("step")) and obj["step"] == step

        at = next((i for i in range(len(lines) - 1, -1, -1) if of_step(lines[i])), None)
        old = _parse(lines[at]) if at is not None else {}
        merged = {**old, "step": int(step), **{k: _jsonable(v) for k, v in scalars.items()}}
        line = (json.dumps(merged) + "\n").encode()
        if at is None:
            lines.append(line)
        else:
            lines[at] = line
        _write_atomic(self.path, lines)
        self._f = open(self.path, "a", buffering=1)
        self._tensorboard(step, scalars)
        return {**{k: v for k, v in old.items() if k != "step"}, **scalars}

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str) -> list[dict]:
    """The JSON objects of a JSONL file such as a run's metrics.jsonl, skipping lines that are not one (a
    torn last line left by a crash; see `read_jsonl_checked`)."""
    return read_jsonl_checked(path, require_step=False)[0]


# The steps `RunWriter` can write (an int64 step counter); a larger "step" is not a step record (it would
# overflow a float in every statistic taken over it).
MAX_STEP = 2**63


def _is_step(step: Any) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and -MAX_STEP < step < MAX_STEP


def _parse(raw: bytes) -> Any:
    """The JSON value of one line, or None if it is not one."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: JSONDecodeError, int digits limit
        return None


def _split_at(path: str, step: int) -> tuple[list[bytes], list[bytes]]:
    """(the lines of a metrics.jsonl a run resumed at `step` keeps, the step records of `step` and later it
    cuts), byte for byte. A line that is not a step record (a torn last line, a record whose "step" is no
    integer) is kept, ended by a newline so the next record starts a line of its own: `report` names it when it
    skips it. (The records were read with the unchecked reader: a "step" of "3" stopped the resume with a
    TypeError, and every line that was not a JSON object was dropped.)"""
    kept, cut = [], []
    with open(path, "rb") as f:
        for raw in f:
            obj = _parse(raw)
            line = raw if raw.endswith(b"\n") else raw + b"\n"
            is_cut = isinstance(obj, dict) and _is_step(obj.get("step")) and obj["step"] >= step
            (cut if is_cut else kept).append(line)
    return kept, cut


def _write_atomic(path: str, lines: list[bytes]) -> None:
    """`lines` as the file `path`, through `outputs.staged_file` (a hidden temporary sibling, made durable and
    renamed into place: a crash leaves the old file or the new one). A symbolic link to a file is written through,
    as the log's appends are: renaming over the link replaced the user's link with a plain file, and left its
    target holding the records the resume redoes."""
    if os.path.islink(path) and os.path.isfile(path):
        path = os.path.realpath(path)
    with staged_file(path) as tmp, open(tmp, "wb") as f:
        f.writelines(lines)


def read_jsonl_checked(path: str, *, require_step: bool = True) -> tuple[list[dict], list[int]]:
    """(the records of a metrics.jsonl, the line numbers skipped). A record is a JSON object, with an integer
    "step" (|step| < 2**63) if `require_step`; anything else (a torn line, non-UTF-8 bytes, another JSON value,
    a number too long for Python to parse, nesting too deep to parse) is skipped."""
    records, skipped = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            obj = _parse(raw)
            step = obj.get("step") if isinstance(obj, dict) else None
            if isinstance(obj, dict) and (not require_step or _is_step(step)):
                records.append(obj)
            else:
                skipped.append(lineno)
    return records, skipped


def _lines(numbers: list[int], shown: int = 5) -> str:
    text = ", ".join(map(str, numbers[:shown]))
    return f"line{'s' if len(numbers) > 1 else ''} {text}" + (f" and {len(numbers) - shown} more" if len(numbers) > shown else "")


def read_run(run_dir: str, *, warn: bool = True) -> list[dict]:
    """The step records of a run directory; UsageError naming the directory if it is not one, or the file if
    it holds no step record. Skipped lines are counted and named in one warning line on stderr."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isdir(run_dir):
        raise UsageError(f"{run_dir}: " + (f"{path_kind(run_dir)}, not a run directory" if os.path.exists(run_dir)
                                           else "no such run directory"))
    if not os.path.isfile(path):
        raise UsageError(f"{run_dir}: not a run directory (no {METRICS_FILE}; `jaxrl-mismatch train` writes one)")
    try:
        records, skipped = read_jsonl_checked(path)
    except OSError as e:
        raise UsageError(f"{path}: cannot read it ({e.strerror})") from None
    if not records:
        if skipped:
            raise UsageError(f"{path}: no step records; {len(skipped)} line(s) are not JSON objects with an integer "
                             f"'step' ({_lines(skipped)})")
        raise UsageError(f"{path}: no records yet")
    if skipped and warn:
        warn_skipped(path, skipped)
    return records


def warn_skipped(path: str, skipped: list[int]) -> None:
    """The one warning line on stderr for the `skipped` lines of `path`, the same from `report` and `compare`."""
    print(f"warning: {path}: skipped {len(skipped)} line(s) that are not step records ({_lines(skipped)})",
          file=sys.stderr, flush=True)
