"""Host-side LR controllers: small deterministic objects that watch training metrics and scale the LR.

They implement the closed-loop idea of the LR paper (Zhang, Li et al., "Beyond Precision: Training-Inference
Mismatch is an Optimization Problem and Simple LR Scheduling Fixes It", arXiv:2602.01826):
a fixed, epoch-timed schedule decays too early or too late because the collapse step does not scale
with the dataset (Sec. 2 "Key Finding 2", Figs. 6–7), so the decay is timed from what the run observes.

Contract shared by every controller (plain Python, no jax/numpy, deterministic):

* `update(step, metrics) -> float` consumes the metrics observed at training step `step` (strictly
  increasing) and returns the LR *multiplier* in (0, 1] for the updates that follow: before step `step`'s
  update when its metrics are known then (docs/schedules.md's example), from step `step + 1`'s in the trainer,
  whose step metrics include the update's (train/loop.py). It is the value for `optim.set_lr_scale`; the effective LR is `schedule(count) × scale` (the optimizer's
  `learning_rate` is the one and only base LR — controllers carry none).
* `state_dict()` is a JSON-able dict (kind, format, config, state of Python ints/floats/lists) that
  goes into the checkpoint; `load_state_dict()` restores it into a controller built with the same
  config, after which it continues exactly as an uninterrupted one would.
* `metrics()` exposes the internals for logging (`scale`, trigger/surge step, period, decays, …) —
  never an LR: the caller logs the actual LR. Missing quantities are `-1` for steps and `nan` for values.
* A non-finite observation (e.g. the grad norm of an FP16 overflow step that was skipped) is ignored
  and counted (`num_nonfinite`), never a crash of the run.

Checkpoints written before state format 2 (no `"format"` key) load as follows: a `lr0` in the saved
config is dropped when it is 1.0 (the multiplier-only behaviour) and refused otherwise (an `lr0` ≠ 1
made `update` return an absolute LR); `length_triggered_decay` states migrate (see its docstring);
`metric_triggered` states are refused, because their alarm rule (first decay at 1.8 × the alarm step)
no longer exists and their future decays cannot be reproduced.
"""

from __future__ import annotations

import abc
import math
from typing import Any, ClassVar, Iterable, Mapping, Sequence

from jaxrl_mismatch.schedules._registry import check_kwargs

STATE_FORMAT = 2  # version of `state_dict()`; 1 = unversioned (with `lr0` in the config)


def step_decay_scale(step: int, first_decay_step: int, decay_period: int, floor: float, factor: float = 0.5) -> float:
    """Host twin of `pure.step_decay_schedule` (multiplier only): `max(factor^n, floor)`.

    `n = 0` before `first_decay_step`, then `1 + (step − first_decay_step) // decay_period`
    (LR paper Sec. 2, "decay LR by half every decay_period until it reaches a minimal floor").
    """
    if first_decay_step < 0 or step < first_decay_step:
        return 1.0
    n = 1 + (step - first_decay_step) // decay_period
    return _floored(factor**n, floor)


# factor^n within this relative distance above the floor is the floor: 0.1^2 = 0.010000000000000002 > 0.01 made a
# third "decay" (to 0.01, nothing in float32) counted in num_decays, controller/scale and the report's lr_decays.
_FLOOR_RTOL = 1e-9


def _floored(scale: float, floor: float) -> float:
    return floor if scale <= floor * (1 + _FLOOR_RTOL) else scale


def _decays_to_floor(floor: float, factor: float) -> int:
    n = 0
    while _floored(factor**n, floor) > floor:
        n += 1
    return n


def _check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                  low_open: bool = False, high_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value!r}")


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_decay(floor: float, factor: float) -> None:
    _check_number("floor", floor, low=0.0, high=1.0, low_open=True)
    _check_number("factor", factor, low=0.0, high=1.0, low_open=True, high_open=True)



class MissingMetricError(KeyError):
    """A controller's metric is not in the step's metrics (a typo, or a metric this run does not log)."""

    def __init__(self, controller: str, metric: str, available: Iterable[str]) -> None:
        self.metric, self.available = metric, sorted(available)
        self.field = "metric"  # the argument that named it; a combined controller prefixes `controllers[i].`
        super().__init__(f"{controller} needs metric {metric!r}; got {self.available}")

class Controller(abc.ABC):
    """Base class: step bookkeeping, the scale, and (de)serialisation of `_state`."""

    kind: ClassVar[str]

    def __init__(self) -> None:
        self._state: dict[str, Any] = {"last_step": -1, "scale": 1.0, "num_nonfinite": 0}

    @property
    def scale(self) -> float:
        """The multiplier in effect after the last `update` (1.0 before any)."""
        return self._state["scale"]

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """Constructor arguments (JSON-able); stored in `state_dict` to catch mismatched resumes."""

    @abc.abstractmethod
    def _advance(self, step: int, metrics: Mapping[str, Any]) -> float:
        """Consume one step's metrics; return the new scale."""

    def update(self, step: int, metrics: Mapping[str, Any]) -> float:
        """Observe `metrics` of training step `step`; return the LR multiplier for that step's update."""
        if isinstance(step, bool) or not hasattr(step, "__index__"):
            raise TypeError(f"step must be an int, got {step!r}")
        step = int(step)
        if step <= self._state["last_step"] or step < 0:
            raise ValueError(f"steps must be >= 0 and strictly increasing: got {step} after {self._state['last_step']}")
        scale = float(self._advance(step, metrics))
        self._state["last_step"] = step
        self._state["scale"] = scale
        return scale

    def _read(self, metrics: Mapping[str, Any], key: str) -> float | None:
        """`metrics[key]` as a float, or None (counted) when it is not finite."""
        if key not in metrics:
            raise MissingMetricError(type(self).__name__, key, metrics)
        value = float(metrics[key])
        if not math.isfinite(value):
            self._state["num_nonfinite"] += 1
            return None
        return value

    def metrics(self) -> dict[str, float]:
        return {"scale": self.scale, "num_nonfinite": float(self._state["num_nonfinite"])}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "format": STATE_FORMAT, "config": self.config(), "state": _copy(self._state)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = self._upgraded(state)
        _check_same_config(self.kind, self.config(), state.get("config", {}))
        missing = sorted(set(self._state) - set(state.get("state", {})))
        if missing:
            raise ValueError(f"{self.kind} state is missing field(s) {missing}")
        self._state = _copy(dict(state["state"]))

    def _upgraded(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Check the kind; bring an older-format state to `STATE_FORMAT` (or refuse with the reason)."""
        if state.get("kind") != self.kind:
            raise ValueError(f"state is for controller {state.get('kind')!r}, not {self.kind!r}")
        version = state.get("format", 1)
        if version == STATE_FORMAT:
            return _copy(dict(state))
        if version != 1:
            raise ValueError(f"{self.kind} state has format {version!r}; this version reads formats 1 and {STATE_FORMAT}")
        state = _copy(dict(state))
        state["config"] = _drop_lr0(self.kind, state.get("config", {}))
        state["format"] = STATE_FORMAT
        return self._upgrade_v1(state)

    def _upgrade_v1(self, state: dict[str, Any]) -> dict[str, Any]:
        """Migrate a format-1 state whose `lr0` was already removed (default: nothing else changed)."""
        return state


def _drop_lr0(kind: str, config: Mapping[str, Any]) -> dict[str, Any]:
    config = dict(config)
    lr0 = config.pop("lr0", 1.0)
    if lr0 != 1.0:
        raise ValueError(
            f"{kind} state was saved with lr0={lr0!r}: controllers no longer carry a base LR (update() returns "
            f"only the multiplier; the base LR is optim.learning_rate), and with lr0 != 1 the saved controller "
            f"returned an absolute LR. Resume with a fresh controller, or from a checkpoint saved with lr0=1.0")
    return config


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def _check_same_config(kind: str, mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> None:
    differing = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if differing:
        details = ", ".join(f"{k}: saved {theirs.get(k)!r} vs now {mine.get(k)!r}" for k in differing)
        raise ValueError(
            f"{kind} state was saved with a different config ({details}); build the controller with the saved config"
        )


class ConstantScale(Controller):
    """No control: always 1. The neutral element for configs that switch controllers off."""

    kind = "constant"

    def config(self) -> dict[str, Any]:
        return {}

    def _advance(self, step: int, metrics: Mapping[str, Any]) -> float:
        return 1.0


class LengthTriggeredDecay(Controller):
    """The LR paper's length-triggered step decay (blog Sec. 3 "Response Length Determines the Decay Schedule").

    The paper: the average response length shows "a sharp surge that consistently precedes validation
    performance degradation" (Fig. 12: ~1000 → 3000–4000 tokens around step 100), and "a delay factor
    of 1.8x the start of the surge" is the best decay period (Fig. 13: 125 too early, 204 best, 250 too
    late); then "decay LR by half every decay_period until it reaches a minimal floor (e.g. 1/10th)"
    (Sec. 2). Fed the per-step mean response length (`metric`, default `"length/mean"`):

    * settled level (baseline) = the running **minimum** of the `baseline_window`-step moving mean of
      the length. It follows the level the run settles at, wherever that is: a run that starts long
      (e.g. 3000 tokens for 10 steps) and settles at 900 has baseline 900, so a later rise to 2800 is a
      3.1× surge. (A mean of the first steps would have stayed at ~1950 and never fired.) A moving
      mean, not single steps, so noise lowers it only a little: under ±30 % i.i.d. noise the minimum
      of a 20-step mean over a long run sits ~10 % below the level (std of the mean ≈ 4 %);
    * surge = the moving average of the last `window` observations reaches `surge_ratio × baseline`
      (paper: lengths roughly triple). Averaging makes single-step spikes harmless: one spike of
      `k × level` lifts the mean by `(k − 1)/window × level`;
    * surge step (onset) = the step where the surge *started*, not where the average caught up: the
      centre of the first 3-step median above `onset_ratio × baseline` since the last median at or
      below it (a 3-median ignores single-step spikes and dips). For a step change at `s` it is
      exactly `s`; for a ramp it is where the ramp crossed `onset_ratio` (default a quarter of the
      way to the surge level, 1.5× for ratio 3). If the median is quiet when the average fires (the
      surge has already receded), the onset falls back to the start of the averaging window;
    * `decay_period = round(period_factor × onset)` (`decay_period=<int>` fixes it instead) and, as in
      the paper's scheduler which counts from the start of training, the halvings land on multiples of
      the period: `period, 2·period, …` — the first one at ≈ 1.8 × the surge step. The decay never acts
      before the trigger: if the trigger fires after `period` (a late detection, or a short fixed
      period), the first halving is at the trigger step and the next ones every `period` after it.
      Halving stops at `floor` (paper: 1/10). The trigger fires once.

    Detection starts at the `min_steps_before_detect`-th observation (default `baseline_window`; at least
    `baseline_window`): with every step observed, step index N − 1. (`MetricTriggered` counts the other way:
    it first evaluates the observation after its N-th, step index N; both kept as the recorded runs used them.)
    A format-1 state (baseline = mean of the first `baseline_window` lengths) migrates: its saved
    baseline seeds the running minimum; a state that had already fired continues its staircase exactly.
    """

    kind = "length_triggered_decay"

    def __init__(self, *, metric: str = "length/mean", surge_ratio: float = 3.0, baseline_window: int = 20,
                 window: int = 10, period_factor: float | None = None, decay_period: int | None = None,
                 floor: float = 0.1, factor: float = 0.5, min_steps_before_detect: int | None = None,
                 onset_ratio: float | None = None):
        super().__init__()
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be a non-empty metric name, got {metric!r}")
        _check_number("surge_ratio", surge_ratio, low=1.0, low_open=True)
        _check_int("baseline_window", baseline_window, 1)
        _check_int("window", window, 3)
        if period_factor is not None:
            _check_number("period_factor", period_factor, low=0.0, low_open=True)
        if decay_period is not None:
            _check_int("decay_period", decay_period, 1)
            if period_factor is not None and period_factor != 1.8:  # it sets the period from the onset, which
                # decay_period fixes instead (1.8, the default, as configs write it out, is not a choice made)
                raise ValueError(f"period_factor={period_factor!r} does nothing with decay_period={decay_period!r} "
                                 "(a fixed period replaces period_factor × onset); give one of them")
        _check_decay(floor, factor)
        if min_steps_before_detect is not None:
            _check_int("min_steps_before_detect", min_steps_before_detect, 0)
        if onset_ratio is None:
            onset_ratio = 1.0 + (surge_ratio - 1.0) / 4.0
        _check_number("onset_ratio", onset_ratio, low=1.0, high=surge_ratio, high_open=True)
        self.metric = metric
        self.surge_ratio = float(surge_ratio)
        self.baseline_window = baseline_window
        self.window = window
        self.period_factor = 1.8 if period_factor is None else float(period_factor)  # LR paper Sec. 3: ≈ 1.8
        self.decay_period = decay_period
        self.floor = float(floor)
        self.factor = float(factor)
        self.min_steps_before_detect = baseline_window if min_steps_before_detect is None else min_steps_before_detect
        self.onset_ratio = float(onset_ratio)
        # `baseline` is None until `baseline_window` lengths were seen (JSON null: strict JSON stays valid).
        self._state.update({"num_observed": 0, "baseline": None, "recent_values": [], "recent_steps": [],
                            "onset_candidate": -1, "trigger_step": -1, "onset_step": -1, "period": -1,
                            "first_decay_step": -1})

    def config(self) -> dict[str, Any]:
        return {"metric": self.metric, "surge_ratio": self.surge_ratio, "baseline_window": self.baseline_window,
                "window": self.window, "period_factor": self.period_factor, "decay_period": self.decay_period,
                "floor": self.floor, "factor": self.factor, "min_steps_before_detect": self.min_steps_before_detect,
                "onset_ratio": self.onset_ratio}

    @property
    def baseline(self) -> float:
        """The settled length level (running minimum of the `baseline_window` moving mean); nan before."""
        b = self._state["baseline"]
        return math.nan if b is None else b

    def _mean_of_last(self, n: int) -> float:
        values = self._state["recent_values"]
        return sum(values[-n:]) / n if len(values) >= n else math.nan

    def _observe(self, step: int, metrics: Mapping[str, Any]) -> int | None:
        """Update the statistics with this step; return the onset step if the surge trigger fires now."""
        length = self._read(metrics, self.metric)
        if length is None:
            return None
        s = self._state
        keep = max(self.window, self.baseline_window, 3)
        s["num_observed"] += 1
        s["recent_values"] = (s["recent_values"] + [length])[-keep:]
        s["recent_steps"] = (s["recent_steps"] + [step])[-keep:]
        level = self._mean_of_last(self.baseline_window)
        if not math.isnan(level):
            s["baseline"] = level if s["baseline"] is None else min(s["baseline"], level)
        baseline = self.baseline
        if math.isnan(baseline) or len(s["recent_values"]) < 3:
            return None
        median3 = sorted(s["recent_values"][-3:])[1]
        if median3 <= self.onset_ratio * baseline:
            s["onset_candidate"] = -1
        elif s["onset_candidate"] < 0:
            s["onset_candidate"] = s["recent_steps"][-2]
        if s["trigger_step"] >= 0 or s["num_observed"] < max(self.min_steps_before_detect, self.baseline_window):
            return None
        if self._mean_of_last(self.window) >= self.surge_ratio * baseline:
            return s["onset_candidate"] if s["onset_candidate"] >= 0 else s["recent_steps"][-self.window]
        return None

    def _advance(self, step: int, metrics: Mapping[str, Any]) -> float:
        onset = self._observe(step, metrics)
        s = self._state
        if onset is not None and s["trigger_step"] < 0:
            period = self.decay_period if self.decay_period is not None else max(1, round(self.period_factor * onset))
            s.update(trigger_step=step, onset_step=onset, period=period, first_decay_step=max(period, step))
        return step_decay_scale(step, s["first_decay_step"], max(s["period"], 1), self.floor, self.factor)

    @property
    def num_decays(self) -> int:
        s = self._state
        if s["first_decay_step"] < 0 or s["last_step"] < s["first_decay_step"]:
            return 0
        n = 1 + (s["last_step"] - s["first_decay_step"]) // s["period"]
        return min(n, _decays_to_floor(self.floor, self.factor))

    def metrics(self) -> dict[str, float]:
        s = self._state
        return {**super().metrics(), "trigger_step": float(s["trigger_step"]), "decay_period": float(s["period"]),
                "first_decay_step": float(s["first_decay_step"]), "num_decays": float(self.num_decays),
                "baseline": self.baseline, "windowed_mean": self._mean_of_last(self.window),
                "surge_step": float(s["onset_step"])}

    def _upgrade_v1(self, state: dict[str, Any]) -> dict[str, Any]:
        # Format 1 kept the sum of the first `baseline_window` lengths as its baseline; that mean seeds the
        # running minimum (the new rule's estimate can only be lower). Everything else carries over.
        old = dict(state.get("state", {}))
        n = old.get("num_observed", 0)
        window = state["config"].get("baseline_window", self.baseline_window)
        old["baseline"] = old.pop("baseline_sum", 0.0) / window if n >= window else None
        state["state"] = old
        return state


class MetricTriggered(Controller):
    """Cut the LR as soon as a health metric alarms: a threshold crossing or an upward trend.

    The LR paper's other warning signs rise together with the collapse: the mismatch `log_ppl_abs_diff`
    (Figs. 2(c), 5(a)) and the time-smoothed, length-normalised grad norm (Fig. 3: "the increase in
    gradient norm matches the degradation of performance and the growth of training-inference
    mismatch"); the objective-hacking paper's mismatch (§2: the std of ρ over a step's tokens) is a
    third. Unlike the length surge — an *early* warning, hence the paper's 1.8× delay — these
    alarms mean the instability is under way, so the controller cuts at the alarm itself (in the trainer, from the
    update right after the alarm step's).

    Alarm at step t (evaluated every step once `min_steps_before_detect` = N observations have passed, i.e. from
    the (N+1)-th: step index N when every step is observed; `LengthTriggeredDecay` starts at its N-th):

    * `threshold` is set and the (optionally EMA-smoothed) metric is `>= threshold`, or
    * `trend_window` and `trend_slope` are set and the least-squares slope of the smoothed metric over
      its last `trend_window` observations (per training step) exceeds `trend_slope`.

    `ema` in [0, 1) smooths as `s ← ema·s + (1−ema)·x`, starting from the first value (no zero bias);
    the paper smooths the grad norm over time for the same reason (Fig. 3).

    Response (`on_alarm`):

    * `"step"` (default): multiply the scale by `factor` on the first alarm step. With `decay_period`
      set, multiply again on any later alarm step at least `decay_period` steps after the previous cut
      (i.e. every `decay_period` steps while the alarm persists); with `decay_period=None`, cut once.
      Never below `floor`.
    * `"decay"`: the LR paper's staircase started by the alarm with an explicit `decay_period`:
      `max(factor^n, floor)` with `n = 1 + (t − alarm step) // decay_period` — the first cut on the alarm
      step, then every `decay_period` steps whether or not the alarm persists.
    """

    kind = "metric_triggered"
    ON_ALARM = ("step", "decay")

    def __init__(self, metric: str, *, threshold: float | None = None, trend_window: int | None = None,
                 trend_slope: float | None = None, ema: float | None = None, min_steps_before_detect: int = 0,
                 on_alarm: str = "step", decay_period: int | None = None, floor: float = 0.1, factor: float = 0.5):
        super().__init__()
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be a non-empty metric name, got {metric!r}")
        if threshold is not None:
            _check_number("threshold", threshold)
        if (trend_window is None) != (trend_slope is None):
            raise ValueError("trend_window and trend_slope must be given together")
        if trend_window is not None:
            _check_int("trend_window", trend_window, 2)
            _check_number("trend_slope", trend_slope)
        if threshold is None and trend_window is None:
            raise ValueError("MetricTriggered needs a threshold, or trend_window and trend_slope, or both")
        if ema is not None:
            _check_number("ema", ema, low=0.0, high=1.0, high_open=True)
        _check_int("min_steps_before_detect", min_steps_before_detect, 0)
        if on_alarm not in self.ON_ALARM:
            raise ValueError(f"unknown on_alarm {on_alarm!r}; valid: {list(self.ON_ALARM)}")
        if decay_period is not None:
            _check_int("decay_period", decay_period, 1)
        elif on_alarm == "decay":
            raise ValueError("on_alarm='decay' needs an explicit decay_period (steps between cuts); "
                             "a metric alarm does not derive its period from the alarm step")
        _check_decay(floor, factor)
        self.metric = metric
        self.threshold = None if threshold is None else float(threshold)
        self.trend_window = trend_window
        self.trend_slope = None if trend_slope is None else float(trend_slope)
        self.ema = None if ema is None else float(ema)
        self.min_steps_before_detect = min_steps_before_detect
        self.on_alarm = on_alarm
        self.decay_period = decay_period
        self.floor = float(floor)
        self.factor = float(factor)
        # `smoothed` is meaningless until num_observed > 0 (kept a number so the state stays strict JSON).
        self._state.update({"num_observed": 0, "smoothed": 0.0, "trend_values": [], "trend_steps": [],
                            "alarm": False, "trigger_step": -1, "last_decay_step": -1, "num_decays": 0})

    def config(self) -> dict[str, Any]:
        return {"metric": self.metric, "threshold": self.threshold, "trend_window": self.trend_window,
                "trend_slope": self.trend_slope, "ema": self.ema,
                "min_steps_before_detect": self.min_steps_before_detect, "on_alarm": self.on_alarm,
                "decay_period": self.decay_period, "floor": self.floor, "factor": self.factor}

    def slope(self) -> float:
        """Least-squares slope (metric units per step) over the trend window; nan until it is full."""
        xs, ys = self._state["trend_steps"], self._state["trend_values"]
        if self.trend_window is None or len(xs) < self.trend_window:
            return math.nan
        x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - x_mean) ** 2 for x in xs)
        return sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sxx

    def _observe(self, step: int, metrics: Mapping[str, Any]) -> bool | None:
        """Update the statistics; return whether the alarm is on (None: no finite observation this step)."""
        value = self._read(metrics, self.metric)
        if value is None:
            return None
        s = self._state
        if self.ema is None or s["num_observed"] == 0:
            s["smoothed"] = value
        else:
            s["smoothed"] = self.ema * s["smoothed"] + (1.0 - self.ema) * value
        s["num_observed"] += 1
        if self.trend_window is not None:
            s["trend_values"] = (s["trend_values"] + [s["smoothed"]])[-self.trend_window:]
            s["trend_steps"] = (s["trend_steps"] + [step])[-self.trend_window:]
        if s["num_observed"] <= self.min_steps_before_detect:
            return False
        crossed = self.threshold is not None and s["smoothed"] >= self.threshold
        slope = self.slope()
        trending = self.trend_slope is not None and not math.isnan(slope) and slope > self.trend_slope
        return crossed or trending

    def _advance(self, step: int, metrics: Mapping[str, Any]) -> float:
        s = self._state
        alarm = self._observe(step, metrics)
        if alarm is not None:
            s["alarm"] = alarm
        if alarm and s["trigger_step"] < 0:
            s["trigger_step"] = step
        if self.on_alarm == "decay":
            scale = step_decay_scale(step, s["trigger_step"], self.decay_period or 1, self.floor, self.factor)
            if scale != s["scale"]:
                s["num_decays"] += 1
                s["last_decay_step"] = step
            return scale
        scale = s["scale"]
        due = s["last_decay_step"] < 0 or (self.decay_period is not None
                                           and step - s["last_decay_step"] >= self.decay_period)
        if alarm and due and scale > self.floor:
            scale = _floored(scale * self.factor, self.floor)
            s["num_decays"] += 1
            s["last_decay_step"] = step
        return scale

    def metrics(self) -> dict[str, float]:
        s = self._state
        smoothed = s["smoothed"] if s["num_observed"] else math.nan
        return {**super().metrics(), "alarm": float(s["alarm"]), "trigger_step": float(s["trigger_step"]),
                "last_decay_step": float(s["last_decay_step"]), "num_decays": float(s["num_decays"]),
                "smoothed": smoothed, "slope": self.slope()}

    def _upgrade_v1(self, state: dict[str, Any]) -> dict[str, Any]:
        raise ValueError(
            "metric_triggered state was saved by the old alarm rule (first decay at 1.8 × the alarm step, "
            "issue 13), whose future decays the new rule (on_alarm='step' | 'decay', acting at once) cannot "
            "reproduce; resume with a fresh controller (it re-arms from the next step's metrics)")


class Combined(Controller):
    """Several controllers at once: the scale is the product (default) or the minimum of theirs.

    Every child sees the same `(step, metrics)`. "product" lets independent triggers stack (a length
    surge and a mismatch alarm both halve); "min" lets the most cautious one win.
    """

    kind = "combined"
    MODES = ("product", "min")

    def __init__(self, controllers: Sequence[Controller], mode: str = "product"):
        super().__init__()
        if not controllers or not all(isinstance(c, Controller) for c in controllers):
            raise ValueError(f"Combined needs a non-empty sequence of Controller instances, got {controllers!r}")
        if mode not in self.MODES:
            raise ValueError(f"unknown combine mode {mode!r}; valid modes: {list(self.MODES)}")
        self.controllers = list(controllers)
        self.mode = mode

    def config(self) -> dict[str, Any]:
        return {"mode": self.mode, "children": [[c.kind, c.config()] for c in self.controllers]}

    def _advance(self, step: int, metrics: Mapping[str, Any]) -> float:
        # All children advance or none: a missing metric for the second child must not leave the
        # first one a step ahead (the caller may fix the metrics and retry the same step).
        saved = [child.state_dict() for child in self.controllers]
        try:
            for i, child in enumerate(self.controllers):
                try:
                    child.update(step, metrics)
                except MissingMetricError as e:
                    e.field = f"controllers[{i}].{e.field}"  # which child's argument (config: kwargs.controllers)
                    raise
        except Exception:
            for child, state in zip(self.controllers, saved):
                child.load_state_dict(state)
            raise
        scales = [child.scale for child in self.controllers]
        return math.prod(scales) if self.mode == "product" else min(scales)

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out["num_nonfinite"] = 0.0  # the children read the metrics; this one reads none itself: its count is theirs
        for i, child in enumerate(self.controllers):
            theirs = child.metrics()
            out.update({f"{i}_{child.kind}/{k}": v for k, v in theirs.items()})
            out["num_nonfinite"] += theirs["num_nonfinite"]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "children": [c.state_dict() for c in self.controllers]}

    def _upgrade_v1(self, state: dict[str, Any]) -> dict[str, Any]:
        # Format 1 ignored the children's own lr0 (only their scales combined): drop it whatever its value.
        for child in state.get("children", []):
            if isinstance(child, dict) and child.get("format", 1) == 1:
                child["config"] = {k: v for k, v in child.get("config", {}).items() if k != "lr0"}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = self._upgraded(state)
        children = state.get("children", [])
        if len(children) != len(self.controllers):
            raise ValueError(f"combined state has {len(children)} children, this controller {len(self.controllers)}")
        # Children check (and migrate) their own config and state; all load or none does.
        saved = [child.state_dict() for child in self.controllers]
        try:
            for child, child_state in zip(self.controllers, children):
                child.load_state_dict(child_state)
            config = dict(state.get("config", {}))
            config["children"] = [[c.kind, c.config()] for c in self.controllers]
            super().load_state_dict({**state, "config": config})
        except Exception:
            for child, child_saved in zip(self.controllers, saved):
                child.load_state_dict(child_saved)
            raise


def combine(*controllers: Controller, mode: str = "product") -> Combined:
    """`Combined(controllers, mode)`, e.g. `combine(LengthTriggeredDecay(), MetricTriggered(...), mode="min")`."""
    return Combined(controllers, mode=mode)


CONTROLLERS: dict[str, type[Controller]] = {
    ConstantScale.kind: ConstantScale,
    LengthTriggeredDecay.kind: LengthTriggeredDecay,
    MetricTriggered.kind: MetricTriggered,
    Combined.kind: Combined,
}


def make_controller(name: str, **kwargs: Any) -> Controller:
    """Build a controller by registry name; for "combined", `controllers` may be specs `{"name": ..., **kw}`.

    Unknown names raise `ValueError` listing the valid ones; unknown or missing arguments raise
    `TypeError` listing the accepted ones; bad values raise `ValueError` naming the argument.
    """
    if name not in CONTROLLERS:
        raise ValueError(f"unknown controller {name!r}; valid controllers: {sorted(CONTROLLERS)}")
    cls = CONTROLLERS[name]
    check_kwargs("controller", name, cls, kwargs)
    if cls is Combined:
        specs = kwargs.get("controllers", ())
        kwargs["controllers"] = [
            spec if isinstance(spec, Controller) else make_controller(**_spec(spec)) for spec in specs
        ]
    return cls(**kwargs)


def _spec(spec: Any) -> dict[str, Any]:
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ValueError(f"a combined controller's child must be a Controller or a dict with a 'name', got {spec!r}")
    return dict(spec)
