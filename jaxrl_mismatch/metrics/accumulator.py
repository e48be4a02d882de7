"""Step records from per-update statistics: the key convention and the host-side ``StatsAccumulator``.

A training step runs several updates (PPO epochs × minibatches; microbatches and data shards inside each).
Averaging each update's *finished* metric (a fraction, a mean) into the step record is wrong whenever the
updates hold different numbers of tokens. So θ-dependent metrics leave the jitted step as **sufficient
statistics** whose key says how they combine — ``<how>:<name>`` — and become metrics only here, once per step.

==========  ==========================================  ==============================================
``how``     combined over updates (and microbatches)    result ``<name>``
==========  ==========================================  ==============================================
``sum``     Σ                                           the total
``num``     Σ, paired with ``den:<name>``               Σ num / Σ den (token / sequence means, fractions)
``den``     Σ                                           (the denominator of ``num:<name>``)
``max``     max (−inf = none seen)                      the maximum
``min``     min (+inf = none seen)                      the minimum
``mean``    unweighted mean over the adds               per-update scalars: ``loss/*``, ``grad/*``
``last``    the last value added                        running state, e.g. the loss scale
==========  ==========================================  ==============================================

``sum``/``num``/``den``/``max``/``min`` combine exactly (up to float rounding) under any split of the step's
rows into minibatches, microbatches or shards; ``mean``/``last`` are for values that only exist per update.
A ratio with Σ den = 0, or a max/min that saw nothing, is ``nan`` ("no data"), never a made-up value.

This module is plain Python + numpy (no jax import, no tracing); the jit-side combiner for microbatches is
``metrics.update.combine_stats``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

REDUCTIONS = ("sum", "num", "den", "max", "min", "mean", "last")


def split_key(key: str) -> tuple[str, str]:
    """``"num:ppo/clip_frac_low"`` → ``("num", "ppo/clip_frac_low")``; a clear error for any other key."""
    how, sep, name = key.partition(":") if isinstance(key, str) else ("", "", "")
    if not sep or how not in REDUCTIONS or not name:
        raise ValueError(f"statistic key {key!r} is not '<how>:<name>' with how in {list(REDUCTIONS)} "
                         f"(see metrics/accumulator.py)")
    return how, name


def _kind(how: str) -> str:
    return "ratio" if how in ("num", "den") else how


def _scalar(key: str, value: Any) -> float:
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"statistic {key!r} must be a scalar, got shape {arr.shape}")
    return float(arr.reshape(()))


class StatsAccumulator:
    """Combines the statistics of a step's updates into the step's metrics (host side, numpy).

    ``add(stats)`` takes one dict of ``<how>:<name>`` scalars (jax arrays, numpy or Python numbers — e.g.
    ``metrics.update_stats`` of one update, plus the step's own ``mean:loss/…`` / ``last:loss_scale/…``);
    ``result()`` returns ``{name: float}``, e.g. ``ppo/clip_frac_low`` = clipped tokens / tokens over the
    whole step. Accumulation is in float64. Tip: ``jax.device_get`` a dict before ``add`` to fetch it in one
    transfer.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._kinds: dict[str, str] = {}     # name -> "ratio" | how
        self._values: dict[str, float] = {}  # key -> running value
        self._counts: dict[str, int] = {}    # key -> number of adds (for mean)

    def add(self, stats: Mapping[str, Any]) -> None:
        """Fold one update's statistics in (all keys are checked before any is applied)."""
        parsed = []
        kinds = dict(self._kinds)
        for key, value in stats.items():
            how, name = split_key(key)
            kind = _kind(how)
            if kinds.setdefault(name, kind) != kind:
                raise ValueError(f"metric {name!r} is reduced two ways: {kinds[name]!r} and {kind!r} ({key!r})")
            parsed.append((key, how, _scalar(key, value)))
        self._kinds = kinds
        for key, how, x in parsed:
            old = self._values.get(key)
            if how in ("sum", "num", "den", "mean"):
                self._values[key] = x if old is None else old + x
            elif how == "max":  # np.maximum/np.minimum: a NaN wins in any order, as in jit's combine_stats
                self._values[key] = x if old is None else float(np.maximum(old, x))
            elif how == "min":
                self._values[key] = x if old is None else float(np.minimum(old, x))
            else:  # last
                self._values[key] = x
            self._counts[key] = self._counts.get(key, 0) + 1

    def result(self) -> dict[str, float]:
        """The step's metrics ``{name: float}`` (in first-seen order); does not reset."""
        out: dict[str, float] = {}
        for name, kind in self._kinds.items():
            if kind == "ratio":
                num, den = self._values.get(f"num:{name}"), self._values.get(f"den:{name}")
                if num is None or den is None:
                    missing = "den" if den is None else "num"
                    raise ValueError(f"statistic {name!r} has no {missing}:{name} (num: and den: come in pairs)")
                out[name] = num / den if den > 0 else math.nan
            elif kind == "mean":
                key = f"mean:{name}"
                out[name] = self._values[key] / self._counts[key]
            else:
                v = self._values[f"{kind}:{name}"]
                none_seen = (kind == "max" and v == -math.inf) or (kind == "min" and v == math.inf)
                out[name] = math.nan if none_seen else v
        return out
