"""Host-side LR controllers on synthetic traces: timing, floor, robustness to noise, resume, errors."""

import ast
import json
import math
import pathlib

import numpy as np
import pytest

from jaxrl_mismatch.schedules import controllers as C

KEY = "length/mean"


def _surge_trace(n_steps, surge_step, ratio, noise=0.0, seed=0, base=1000.0, ramp=0):
    """Mean response length: `base` until `surge_step`, then `ratio × base` (linear over `ramp` steps)."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n_steps)
    level = 1.0 + (ratio - 1.0) * np.clip((steps - surge_step + 1) / max(ramp, 1), 0.0, 1.0)
    return base * level * (1.0 + rng.uniform(-noise, noise, n_steps))


def _run(controller, trace, key=KEY):
    return np.array([controller.update(t, {key: float(x)}) for t, x in enumerate(trace)])


def _decay_steps(scales):
    return list(np.flatnonzero(np.diff(scales) != 0) + 1)


@pytest.mark.parametrize("surge_step", [40, 100, 250])
@pytest.mark.parametrize("ratio, noise, seed", [(3.0, 0.0, 0), (4.0, 0.3, 1), (4.0, 0.3, 2), (3.5, 0.2, 3)])
def test_surge_decays_at_1_8_times_the_surge_step(surge_step, ratio, noise, seed):
    ctrl = C.LengthTriggeredDecay()
    scales = _run(ctrl, _surge_trace(surge_step * 9, surge_step, ratio, noise, seed))
    period = round(1.8 * surge_step)
    # Tolerance 0: for a step change the onset estimate (3-median above 1.5× baseline) is exact —
    # with ±30% noise the pre-surge lengths stay <= 1.3× and the surged ones >= 2.45× baseline — and
    # the moving average fires within `window` (10) steps, long before 1.8·s.
    m = ctrl.metrics()
    assert m["surge_step"] == surge_step and m["decay_period"] == period
    assert surge_step <= m["trigger_step"] <= surge_step + ctrl.window
    assert _decay_steps(scales) == [period, 2 * period, 3 * period, 4 * period]
    np.testing.assert_array_equal(scales[[0, period - 1, period, 2 * period, 3 * period]], [1, 1, 0.5, 0.25, 0.125])
    assert scales[4 * period] == scales[-1] == pytest.approx(0.1)  # 0.0625 would undershoot: floor
    assert scales.min() >= 0.1 and m["num_decays"] == 4


def test_ramped_surge_onset_within_the_ramp():
    # A gradual surge (1× → 4× over 30 steps from step 100): the onset is where the ramp crossed the
    # onset level (1.5× = 1/6 of the ramp, i.e. step ~105), so the first decay is 1.8 × that.
    ctrl = C.LengthTriggeredDecay()
    scales = _run(ctrl, _surge_trace(800, 100, 4.0, noise=0.1, seed=4, ramp=30))
    onset = ctrl.metrics()["surge_step"]
    assert 100 <= onset <= 100 + 30 / 6 + 3
    assert _decay_steps(scales)[0] == round(1.8 * onset)


def test_no_surge_never_decays():
    ctrl = C.LengthTriggeredDecay()
    scales = _run(ctrl, _surge_trace(2000, 10**9, 1.0, noise=0.3, seed=5))
    assert np.all(scales == 1.0)
    assert ctrl.metrics()["trigger_step"] == -1 and ctrl.metrics()["num_decays"] == 0


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("drift, spike_range", [(1.0, (4.0, 12.0)), (1.5, (2.0, 6.0))])
def test_noise_spikes_and_slow_drift_do_not_trigger(seed, drift, spike_range):
    # ±30% iid noise, a slow drift of the level to `drift`×, isolated single-step spikes (at most one
    # per averaging window) and one two-step 3× burst. The baseline (running minimum of the 20-step
    # mean) sits ~0.9× the initial level (std of a 20-mean of ±30% uniform noise ≈ 0.04), so the
    # trigger needs a 10-step mean ≥ ~2.7× it; the expected worst windows are (9 + 12)/10 = 2.1
    # without drift and 1.5·(9 + 6)/10 = 2.25 at 1.5× drift, > 10 noise std below.
    rng = np.random.default_rng(100 + seed)
    trace = _surge_trace(1500, 10**9, 1.0, noise=0.3, seed=seed) * np.linspace(1.0, drift, 1500)
    spikes = rng.choice(np.arange(30, 1490, 11), size=25, replace=False)
    trace[spikes] *= rng.uniform(*spike_range, spikes.size)
    trace[701:703] *= 3.0
    ctrl = C.LengthTriggeredDecay()
    assert np.all(_run(ctrl, trace) == 1.0)
    assert ctrl.metrics()["trigger_step"] == -1


def test_a_sustained_surge_under_the_same_noise_does_trigger():
    # The counterpart of the test above: same noise and spikes, but the level triples at step 300.
    rng = np.random.default_rng(7)
    trace = _surge_trace(1500, 300, 3.5, noise=0.3, seed=7)
    spikes = rng.choice(np.arange(30, 290, 11), size=10, replace=False)
    trace[spikes] *= rng.uniform(4.0, 12.0, spikes.size)
    ctrl = C.LengthTriggeredDecay()
    scales = _run(ctrl, trace)
    assert ctrl.metrics()["surge_step"] == 300 and _decay_steps(scales)[0] == 540


def test_late_trigger_starts_decay_at_the_trigger():
    # A fixed period shorter than the detection step: the first halving is at the trigger, not before.
    ctrl = C.LengthTriggeredDecay(decay_period=50)
    scales = _run(ctrl, _surge_trace(400, 150, 3.0))
    trigger = int(ctrl.metrics()["trigger_step"])
    assert trigger == 150 + ctrl.window - 1
    assert _decay_steps(scales) == [trigger, trigger + 50, trigger + 100, trigger + 150]


def _start_long_trace(n=600, noise=0.0, seed=0, surge_at=100, surge_level=2800.0):
    """Issue 13's trace: 3000 tokens for 10 steps, then 900, then `surge_level` from `surge_at`."""
    rng = np.random.default_rng(seed)
    trace = np.where(np.arange(n) < 10, 3000.0, np.where(np.arange(n) < surge_at, 900.0, surge_level))
    return trace * (1.0 + rng.uniform(-noise, noise, n))


def test_a_run_that_starts_long_and_settles_then_surges_fires():
    # Fails with the old baseline (mean of the first 20 steps = 1950, so 2800 < 3 × 1950 never fires):
    # the settled level is 900 and 2800 is a 3.1× surge that started at step 100.
    ctrl = C.LengthTriggeredDecay()
    scales = _run(ctrl, _start_long_trace())
    m = ctrl.metrics()
    assert m["baseline"] == 900.0 and m["surge_step"] == 100 and m["trigger_step"] == 109
    assert _decay_steps(scales) == [180, 360, 540]  # 1.8 × 100, then every 180 steps


@pytest.mark.parametrize("seed", range(4))
def test_a_run_that_starts_long_and_settles_does_not_fire_on_noise(seed):
    ctrl = C.LengthTriggeredDecay()
    assert np.all(_run(ctrl, _start_long_trace(1500, noise=0.3, seed=seed, surge_at=10**9)) == 1.0)
    assert ctrl.metrics()["trigger_step"] == -1 and 0.7 * 900 <= ctrl.metrics()["baseline"] <= 900


def test_update_returns_the_multiplier_and_metrics_report_no_lr():
    ctrl = C.LengthTriggeredDecay(decay_period=5)
    scales = _run(ctrl, _surge_trace(60, 25, 4.0))
    assert scales.max() == 1.0 and scales.min() == 0.1
    assert "lr" not in ctrl.metrics() and ctrl.metrics()["scale"] == 0.1
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['lr0'\]"):
        C.make_controller("length_triggered_decay", lr0=1e-6)


# Format-1 states (before issue 9/13), as the old controllers wrote them.
V1_LENGTH = {"kind": "length_triggered_decay", "config": {
    "lr0": 1.0, "period_factor": 1.8, "decay_period": None, "floor": 0.1, "factor": 0.5, "metric": "length/mean",
    "surge_ratio": 3.0, "baseline_window": 5, "window": 4, "min_steps_before_detect": 5, "onset_ratio": 1.5},
    "state": {"last_step": 12, "scale": 1.0, "num_nonfinite": 0, "trigger_step": 9, "onset_step": 7, "period": 13,
              "first_decay_step": 13, "num_observed": 13, "baseline_sum": 5000.0,
              "recent_values": [4000.0, 4000.0, 4000.0, 4000.0], "recent_steps": [9, 10, 11, 12],
              "onset_candidate": 7}}
V1_METRIC = {"kind": "metric_triggered", "config": {
    "lr0": 1.0, "period_factor": 1.8, "decay_period": None, "floor": 0.1, "factor": 0.5, "metric": "m",
    "threshold": 1.0, "trend_window": None, "trend_slope": None, "ema": None, "min_steps_before_detect": 0},
    "state": {"last_step": 0, "scale": 1.0, "num_nonfinite": 0, "trigger_step": -1, "onset_step": -1, "period": -1,
              "first_decay_step": -1, "num_observed": 1, "smoothed": 0.5, "trend_values": [], "trend_steps": []}}
V1_CONSTANT = {"kind": "constant", "config": {"lr0": 1.0},
               "state": {"last_step": 0, "scale": 1.0, "num_nonfinite": 0}}


def test_format_1_states_load_drop_lr0_1_and_refuse_other_lr0():
    fired = C.LengthTriggeredDecay(window=4, baseline_window=5)
    fired.load_state_dict(json.loads(json.dumps(V1_LENGTH)))
    # It had fired (onset 7, period 13): its staircase continues exactly: halvings at 13, 26, …
    assert [fired.update(t, {KEY: 4000.0}) for t in range(13, 28)] == [0.5] * 13 + [0.25] * 2
    assert fired.metrics()["baseline"] == 1000.0 and fired.state_dict()["format"] == C.STATE_FORMAT
    constant = C.ConstantScale()
    constant.load_state_dict(V1_CONSTANT)
    assert constant.update(1, {}) == 1.0
    combined = C.combine(C.ConstantScale(), C.LengthTriggeredDecay(window=4, baseline_window=5))
    combined.load_state_dict({"kind": "combined", "config": {"lr0": 1.0, "mode": "product", "children": [
        ["constant", {"lr0": 1.0}], ["length_triggered_decay", V1_LENGTH["config"]]]},
        "state": {"last_step": 12, "scale": 1.0, "num_nonfinite": 0},
        "children": [{**V1_CONSTANT, "state": {**V1_CONSTANT["state"], "last_step": 12}}, V1_LENGTH]})
    assert combined.update(13, {KEY: 4000.0}) == 0.5
    absolute = {**V1_CONSTANT, "config": {"lr0": 1e-6}}
    with pytest.raises(ValueError, match=r"saved with lr0=1e-06: controllers no longer carry a base LR"):
        C.ConstantScale().load_state_dict(absolute)
    with pytest.raises(ValueError, match="old alarm rule"):
        C.MetricTriggered("m", threshold=1.0).load_state_dict(V1_METRIC)


def test_format_1_length_state_that_has_not_fired_seeds_the_running_minimum():
    state = json.loads(json.dumps(V1_LENGTH))
    state["state"].update(trigger_step=-1, onset_step=-1, period=-1, first_decay_step=-1, onset_candidate=-1,
                          recent_values=[1000.0] * 4)
    ctrl = C.LengthTriggeredDecay(window=4, baseline_window=5)
    ctrl.load_state_dict(state)
    assert ctrl.metrics()["baseline"] == 1000.0  # 5000 / 5
    scales = [ctrl.update(t, {KEY: 3500.0 if t >= 20 else 1000.0}) for t in range(13, 80)]
    assert ctrl.metrics()["surge_step"] == 20 and scales[36 - 13] == 0.5


@pytest.mark.parametrize("stop", [15, 60, 104, 190, 700])  # in baseline, before/at/after trigger, at floor
def test_state_round_trips_through_json(stop):
    trace = _surge_trace(900, 100, 4.0, noise=0.3, seed=7)
    kwargs = dict(window=8, baseline_window=16)
    uninterrupted, first = C.LengthTriggeredDecay(**kwargs), C.LengthTriggeredDecay(**kwargs)
    want = _run(uninterrupted, trace)
    for t in range(stop):
        first.update(t, {KEY: float(trace[t])})
    saved = json.dumps(first.state_dict(), allow_nan=False)  # strict JSON
    resumed = C.LengthTriggeredDecay(**kwargs)
    resumed.load_state_dict(json.loads(saved))
    got = [resumed.update(t, {KEY: float(trace[t])}) for t in range(stop, trace.size)]
    assert got == list(want[stop:])  # bit-identical, not approximately
    assert _nan_eq(resumed.metrics(), uninterrupted.metrics())


def _nan_eq(a, b):
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def test_load_rejects_other_config_or_kind():
    state = C.LengthTriggeredDecay(window=8).state_dict()
    with pytest.raises(ValueError, match=r"different config \(window: saved 8 vs now 10\)"):
        C.LengthTriggeredDecay().load_state_dict(state)
    with pytest.raises(ValueError, match="'length_triggered_decay', not 'metric_triggered'"):
        C.MetricTriggered("x", threshold=1.0).load_state_dict(state)


def test_steps_must_increase_and_metric_must_exist():
    ctrl = C.LengthTriggeredDecay()
    ctrl.update(3, {KEY: 1.0})
    with pytest.raises(ValueError, match="strictly increasing"):
        ctrl.update(3, {KEY: 1.0})
    with pytest.raises(KeyError, match=r"needs metric 'length/mean'; got \['length'\]"):
        ctrl.update(4, {"length": 1.0})


def test_non_finite_observations_are_ignored_and_counted():
    # e.g. the grad norm of an FP16 overflow step: skipped, counted, and the run goes on unchanged.
    trace = _surge_trace(400, 100, 4.0)
    clean, dirty = C.LengthTriggeredDecay(), C.LengthTriggeredDecay()
    want = _run(clean, trace)
    nan_steps = {30, 250}
    got = [dirty.update(t, {KEY: float("nan") if t in nan_steps else float(x)}) for t, x in enumerate(trace)]
    assert dirty.metrics()["num_nonfinite"] == 2.0 and dirty.metrics()["surge_step"] == 100
    assert got == list(want)  # the skipped samples only leave the (noise-free) windowed mean unchanged
    # Combined reads no metric itself: its count is its children's (it said 0 whatever they skipped).
    both = C.combine(C.LengthTriggeredDecay(), C.MetricTriggered(KEY, threshold=1e9))
    for t, x in enumerate(trace[:40]):
        both.update(t, {KEY: float("nan") if t in nan_steps else float(x)})
    m = both.metrics()
    assert m["num_nonfinite"] == 2.0 and m["0_length_triggered_decay/num_nonfinite"] == 1.0
    assert m["1_metric_triggered/num_nonfinite"] == 1.0


# ---------------------------------------------------------------- MetricTriggered

def test_threshold_alarm_cuts_at_once_and_once():
    # Issue 13: the alarm at step 120 used to halve first at round(1.8 × 120) = 216. Now: at 120, once.
    values = np.concatenate([np.full(120, 0.01), np.full(400, 0.08)])
    ctrl = C.MetricTriggered("mismatch/log_ppl_abs_diff", threshold=0.05)
    scales = _run(ctrl, values, key="mismatch/log_ppl_abs_diff")
    assert ctrl.metrics()["trigger_step"] == 120
    assert _decay_steps(scales) == [120] and scales[119] == 1.0 and scales[120] == scales[-1] == 0.5
    assert ctrl.metrics()["num_decays"] == 1 and ctrl.metrics()["alarm"] == 1.0


@pytest.mark.parametrize("alarm_step", [0, 300])
def test_alarm_step_mode_acts_on_the_alarm_step(alarm_step):
    # Fails on the old rule: alarm at 300 first halved at 540; alarm at 0 gave period 1 (floor by step 4).
    values = np.where(np.arange(800) < alarm_step, 0.01, 0.2)
    ctrl = C.MetricTriggered("m", threshold=0.1, factor=0.5)
    scales = _run(ctrl, values, key="m")
    assert scales[alarm_step] == 0.5 and np.all(scales[:alarm_step] == 1.0)
    assert np.all(scales[alarm_step:] == 0.5)  # no decay_period: one cut


def test_alarm_step_mode_repeats_every_period_while_the_alarm_persists():
    # Alarm on over [300, 340), off, and on again from 500: cuts at 300, 310, 320, 330 (floor reached
    # at the 4th: 0.5^4 = 0.0625 < 0.1); in a second run with floor 0.01, none while the alarm is off
    # and the next one when it returns (≥ decay_period after the last).
    steps = np.arange(700)
    values = np.where(((steps >= 300) & (steps < 340)) | (steps >= 500), 0.2, 0.01)
    ctrl = C.MetricTriggered("m", threshold=0.1, decay_period=10)
    scales = _run(ctrl, values, key="m")
    assert _decay_steps(scales) == [300, 310, 320, 330]
    np.testing.assert_allclose(scales[[300, 310, 320, 330, 699]], [0.5, 0.25, 0.125, 0.1, 0.1])
    deep = C.MetricTriggered("m", threshold=0.1, decay_period=10, floor=0.01)
    scales = _run(deep, values, key="m")
    assert _decay_steps(scales) == [300, 310, 320, 330, 500, 510, 520]
    assert scales[-1] == pytest.approx(0.01) and deep.metrics()["num_decays"] == 7


def test_alarm_decay_mode_uses_its_own_period_from_the_alarm_step():
    # A brief alarm (steps 300-302) starts the LR paper's staircase with the given period, at once.
    values = np.where((np.arange(800) >= 300) & (np.arange(800) < 303), 0.2, 0.01)
    ctrl = C.MetricTriggered("m", threshold=0.1, on_alarm="decay", decay_period=50)
    scales = _run(ctrl, values, key="m")
    assert _decay_steps(scales) == [300, 350, 400, 450]
    np.testing.assert_allclose(scales[[299, 300, 349, 350, 450, 799]], [1, 0.5, 0.5, 0.25, 0.1, 0.1])
    assert ctrl.metrics()["num_decays"] == 4 and ctrl.metrics()["alarm"] == 0.0
    with pytest.raises(ValueError, match="on_alarm='decay' needs an explicit decay_period"):
        C.MetricTriggered("m", threshold=0.1, on_alarm="decay")
    with pytest.raises(ValueError, match=r"unknown on_alarm 'later'; valid: \['step', 'decay'\]"):
        C.MetricTriggered("m", threshold=0.1, on_alarm="later")


def test_ema_smoothing_ignores_a_single_spike_that_a_raw_threshold_takes():
    values = np.full(300, 0.01)
    values[80] = 0.2
    raw = C.MetricTriggered("m", threshold=0.05)
    smoothed = C.MetricTriggered("m", threshold=0.05, ema=0.9)
    _run(raw, values, key="m")
    _run(smoothed, values, key="m")
    assert raw.metrics()["trigger_step"] == 80
    assert smoothed.metrics()["trigger_step"] == -1


def test_upward_trend_triggers_and_flat_noise_does_not():
    rng = np.random.default_rng(11)
    noise = rng.normal(0.0, 0.05, 600)
    flat = 1.0 + noise
    rising = flat + np.where(np.arange(600) < 200, 0.0, 0.004 * (np.arange(600) - 200))
    kw = dict(trend_window=50, trend_slope=0.002, ema=0.5, decay_period=40)
    flat_ctrl, rising_ctrl = C.MetricTriggered("grad/norm", **kw), C.MetricTriggered("grad/norm", **kw)
    assert np.all(_run(flat_ctrl, flat, key="grad/norm") == 1.0)
    scales = _run(rising_ctrl, rising, key="grad/norm")
    trigger = rising_ctrl.metrics()["trigger_step"]
    assert 200 < trigger < 250  # the window must see > half its span rising at 2× the slope threshold
    assert _decay_steps(scales)[:2] == [trigger, trigger + 40]  # at once, then every 40 while it trends


def test_slope_is_least_squares():
    ctrl = C.MetricTriggered("m", trend_window=7, trend_slope=1e9)
    steps = [0, 1, 2, 4, 5, 8, 9]
    values = [0.3, 0.1, 0.5, 0.4, 0.9, 0.7, 1.3]
    for t, v in zip(steps, values):
        ctrl.update(t, {"m": v})
    assert ctrl.slope() == pytest.approx(np.polyfit(steps, values, 1)[0], rel=1e-12)


def test_metric_triggered_round_trip():
    values = 1.0 + np.random.default_rng(3).normal(0, 0.1, 500) + np.linspace(0, 2, 500)
    kw = dict(threshold=2.0, trend_window=20, trend_slope=0.01, ema=0.8, decay_period=30)
    a, b = C.MetricTriggered("m", **kw), C.MetricTriggered("m", **kw)
    want = _run(a, values, key="m")
    for t in range(123):
        b.update(t, {"m": float(values[t])})
    c = C.MetricTriggered("m", **kw)
    c.load_state_dict(json.loads(json.dumps(b.state_dict(), allow_nan=False)))
    assert [c.update(t, {"m": float(values[t])}) for t in range(123, 500)] == list(want[123:])


# ---------------------------------------------------------------- combination, registry, purity

def test_combined_product_and_min_and_round_trip():
    lengths = _surge_trace(600, 100, 4.0)
    mismatch = np.where(np.arange(600) < 150, 0.01, 0.1)
    metrics = [{KEY: float(l), "mm": float(m)} for l, m in zip(lengths, mismatch)]

    def build(mode):
        return C.combine(C.LengthTriggeredDecay(), C.MetricTriggered("mm", threshold=0.05, decay_period=100),
                         mode=mode)

    product, minimum, length_only, mm_only = build("product"), build("min"), C.LengthTriggeredDecay(), \
        C.MetricTriggered("mm", threshold=0.05, decay_period=100)
    for t, m in enumerate(metrics):
        p, q, a, b = product.update(t, m), minimum.update(t, m), length_only.update(t, m), mm_only.update(t, m)
        assert p == a * b and q == min(a, b)
    assert product.metrics()["0_length_triggered_decay/surge_step"] == 100
    assert product.metrics()["1_metric_triggered/trigger_step"] == 150

    uninterrupted = build("product")
    want = [uninterrupted.update(t, m) for t, m in enumerate(metrics)]
    half = build("product")
    for t in range(200):
        half.update(t, metrics[t])
    resumed = build("product")
    resumed.load_state_dict(json.loads(json.dumps(half.state_dict(), allow_nan=False)))
    assert [resumed.update(t, metrics[t]) for t in range(200, 600)] == want[200:]


def test_combined_is_atomic_when_a_metric_is_missing():
    ctrl = C.combine(C.LengthTriggeredDecay(), C.MetricTriggered("mm", threshold=1.0))
    with pytest.raises(KeyError, match="'mm'") as missing:
        ctrl.update(0, {KEY: 1000.0})
    # the argument that named it, as the trainer's error names the config field (kwargs.controllers[1].metric)
    assert missing.value.field == "controllers[1].metric"
    assert ctrl.controllers[0].state_dict()["state"]["last_step"] == -1
    with pytest.raises(C.MissingMetricError) as missing:
        C.MetricTriggered("mm", threshold=1.0).update(0, {})
    assert missing.value.field == "metric"
    ctrl.update(0, {KEY: 1000.0, "mm": 0.0})  # the same step can be retried


def test_make_controller_registry_and_errors():
    ctrl = C.make_controller("combined", mode="min", controllers=[
        {"name": "length_triggered_decay", "surge_ratio": 2.5},
        {"name": "metric_triggered", "metric": "rho/std", "threshold": 0.3},
    ])
    assert isinstance(ctrl, C.Combined) and ctrl.controllers[0].surge_ratio == 2.5
    assert isinstance(C.make_controller("constant"), C.ConstantScale)
    valid = r"\['combined', 'constant', 'length_triggered_decay', 'metric_triggered'\]"
    with pytest.raises(ValueError, match=r"unknown controller 'length'.*" + valid):
        C.make_controller("length")
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['surge'\].*accepted: \[.*'surge_ratio'"):
        C.make_controller("length_triggered_decay", surge=3.0)
    with pytest.raises(TypeError, match=r"missing required argument\(s\) \['metric'\]"):
        C.make_controller("metric_triggered", threshold=1.0)
    with pytest.raises(ValueError, match="needs a threshold, or trend_window and trend_slope"):
        C.make_controller("metric_triggered", metric="m")
    with pytest.raises(ValueError, match="trend_window and trend_slope must be given together"):
        C.MetricTriggered("m", trend_window=5)
    with pytest.raises(ValueError, match="surge_ratio must be > 1.0"):
        C.LengthTriggeredDecay(surge_ratio=1.0)
    with pytest.raises(ValueError, match="floor must be <= 1.0"):
        C.LengthTriggeredDecay(floor=2.0)
    with pytest.raises(ValueError, match="decay_period must be an int >= 1"):
        C.LengthTriggeredDecay(decay_period=0)
    with pytest.raises(ValueError, match="unknown combine mode 'max'"):
        C.combine(C.ConstantScale(), mode="max")
    with pytest.raises(ValueError, match="child must be a Controller or a dict with a 'name'"):
        C.make_controller("combined", controllers=[{"surge_ratio": 3.0}])


def test_controllers_do_not_import_jax():
    # Controllers run in the host loop and must stay importable/testable without jax or numpy.
    package = pathlib.Path(C.__file__).parent
    for module in ("controllers.py", "_registry.py"):
        tree = ast.parse((package / module).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {"jax", "numpy", "optax", "jaxrl_mismatch.schedules.pure"} & imported, (module, imported)


@pytest.mark.parametrize("factor, floor", [(0.1, 0.01), (0.2, 0.04), (0.5, 0.125)])
def test_the_floor_is_reached_in_as_many_decays_as_the_rule_says(factor, floor):
    """0.1^2 = 0.010000000000000002 lies just above a 0.01 floor: both controllers made a third "decay" (to 0.01,
    nothing in float32), counted in num_decays and controller/scale (the report's lr_decays said 3)."""
    want = round(math.log(floor) / math.log(factor))  # max(factor^n, floor) reaches the floor at this n
    d = C.LengthTriggeredDecay(decay_period=10, factor=factor, floor=floor, baseline_window=3, window=3)
    scales = [d.update(t, {"length/mean": 1000.0 if t < 3 else 4000.0}) for t in range(80)]
    assert len(set(scales)) == want + 1 and scales[-1] == floor and d.metrics()["num_decays"] == want
    m = C.MetricTriggered("m", threshold=1.0, on_alarm="decay", decay_period=10, factor=factor, floor=floor)
    scales = [m.update(t, {"m": 2.0}) for t in range(80)]
    assert len(set(scales)) == want and scales[-1] == floor and m.metrics()["num_decays"] == want
    assert C.step_decay_scale(100, 0, 10, floor, factor) == floor
