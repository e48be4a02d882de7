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
from typing import Any, Mapping

import numpy as np

from jaxrl_mismatch.usage import UsageError

METRICS_FILE = "metrics.jsonl"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.generic, np.ndarray)):
        v = v.item() if np.ndim(v) == 0 else v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # JSON has no NaN/inf; keep them visible as strings
    return v


class RunWriter:
    """Writes each step's scalars to `<run_dir>/metrics.jsonl` and TensorBoard event files.

    On resume the JSONL file is truncated to the records before the resumed step, so a restarted run
    never shows a step twice.
    """

    def __init__(self, run_dir: str, *, resume_from_step: int | None = None, tensorboard: bool = True) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, METRICS_FILE)
        if resume_from_step is not None and os.path.exists(self.path):
            kept = [r for r in read_jsonl(self.path) if r.get("step", -1) < resume_from_step]
            with open(self.path, "w") as f:
                for r in kept:
                    f.write(json.dumps(r) + "\n")
        elif resume_from_step is None and os.path.exists(self.path):
            os.remove(self.path)
        self._f = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tb"))

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        record = {"step": int(step), **{k: _jsonable(v) for k, v in scalars.items()}}
        self._f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                if isinstance(v, (int, float, np.generic)) and math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), int(step))

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: str) -> list[dict]:
    """Read a run's metrics.jsonl (skipping a torn last line left by a crash)."""
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def read_run(run_dir: str) -> list[dict]:
    """The step records of a run directory; UsageError naming the directory if it is not one."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isdir(run_dir):
        raise UsageError(f"{run_dir}: no such run directory")
    if not os.path.isfile(path):
        raise UsageError(f"{run_dir}: not a run directory (no {METRICS_FILE}; `jaxrl-mismatch train` writes one)")
    records = read_jsonl(path)
    if not records:
        raise UsageError(f"{path}: no records yet")
    return records
