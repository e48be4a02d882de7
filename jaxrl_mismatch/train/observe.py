"""Run observability: accumulate per-minibatch metrics with clu.metrics, write JSONL + TensorBoard.

Why these writers: `clu.metric_writers` imports TensorFlow (+1.4 GB), which this project otherwise never
needs. We keep clu's TF-free `clu.metrics` for accumulation and write TensorBoard event files with
tensorboardX (~1 MB) plus one JSONL file per run (`metrics.jsonl`, one object per step), which the
`report` command and any notebook read without TensorBoard.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import clu.metrics as clu_metrics
import jax
import numpy as np


def reduction(name: str) -> str:
    """How a metric combines over the updates of one step: extremes stay extremes, state is the last value."""
    if name.endswith(("_max", "/max")):
        return "max"
    if name.endswith(("_min", "/min")):
        return "min"
    if name.startswith("loss_scale/"):
        return "last"  # the scale and the skipped-step counter are running state, not per-update samples
    return "mean"


class StepAccumulator:
    """Combines the metrics of several update calls (PPO epochs × minibatches) into one step record.

    Means use a clu `Collection` of `Average` metrics, created on first use from the metric names (the
    step's metric dict is stable) and merged per update; `*_max` / `*_min` metrics keep their extreme and
    running state (`loss_scale/*`) its last value (`reduction`).
    """

    def __init__(self) -> None:
        self._cls = None
        self._names: tuple[str, ...] = ()
        self._acc = None
        self._other: dict[str, float] = {}

    def add(self, metrics: Mapping[str, jax.Array]) -> None:
        for n, v in metrics.items():
            how = reduction(n)
            if how != "mean":
                v = float(v)
                old = self._other.get(n)
                self._other[n] = v if old is None or how == "last" else (max(old, v) if how == "max" else min(old, v))
        metrics = {n: v for n, v in metrics.items() if reduction(n) == "mean"}
        names = tuple(sorted(metrics))
        if self._cls is None or names != self._names:
            if self._acc is not None:
                raise ValueError(f"metric names changed within a step: {sorted(set(names) ^ set(self._names))}")
            self._names = names
            # clu builds a dataclass whose fields must be identifiers ("mismatch/rho_mean_pi_0-0.1" is
            # not), so fields are positional (m0, m1, ...) and the names are kept alongside.
            self._cls = clu_metrics.Collection.create(
                **{f"m{i}": clu_metrics.Average.from_output(f"m{i}") for i in range(len(names))}
            )
        update = self._cls.single_from_model_output(**{f"m{i}": metrics[n] for i, n in enumerate(names)})
        self._acc = update if self._acc is None else self._acc.merge(update)

    def compute(self) -> dict[str, float]:
        """The step's metrics as Python floats; resets the accumulator."""
        out = dict(self._other)
        self._other = {}
        if self._acc is not None:
            computed = self._acc.compute()
            out.update({n: float(computed[f"m{i}"]) for i, n in enumerate(self._names)})
            self._acc = None
        return out


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
        self.path = os.path.join(run_dir, "metrics.jsonl")
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
