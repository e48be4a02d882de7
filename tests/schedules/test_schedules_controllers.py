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
    ctrl = C.LengthTriggeredDecay(lr0=1e-6)
    lrs = _run(ctrl, _surge_trace(2000, 10**9, 1.0, noise=0.3, seed=5))
    assert np.all(lrs == 1e-6)
    assert ctrl.metrics()["trigger_step"] == -1 and ctrl.metrics()["num_decays"] == 0


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("drift, spike_range", [(1.0, (4.0, 12.0)), (1.5, (2.0, 6.0))])
def test_noise_spikes_and_slow_drift_do_not_trigger(seed, drift, spike_range):
    # ±30% iid noise, a slow drift of the level to `drift`×, isolated single-step spikes (at most one
    # per averaging window) and one two-step 3× burst. With window 10 and ratio 3, the windowed mean
    # stays below 3× baseline by construction in the worst case (all noise at +30%):
    # (9·1.3 + 12·1.3)/10 = 2.73 without drift, (9·1.95 + 6·1.95)/10 = 2.93 at 1.5× drift.
    # (A lone spike above (10·3 − 9)/1 = 21× the level would trigger: a mean-based detector's bound,
    # documented in LengthTriggeredDecay.)
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


@pytest.mark.parametrize("stop", [15, 60, 104, 190, 700])  # in baseline, before/at/after trigger, at floor
def test_state_round_trips_through_json(stop):
    trace = _surge_trace(900, 100, 4.0, noise=0.3, seed=7)
    kwargs = dict(lr0=1e-6, window=8, baseline_window=16)
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


# ---------------------------------------------------------------- MetricTriggered

def test_threshold_crossing():
    values = np.concatenate([np.full(120, 0.01), np.full(400, 0.08)])
    ctrl = C.MetricTriggered("mismatch/log_ppl_abs_diff", threshold=0.05)
    scales = _run(ctrl, values, key="mismatch/log_ppl_abs_diff")
    assert ctrl.metrics()["trigger_step"] == 120
    period = round(1.8 * 120)
    assert _decay_steps(scales) == [period, 2 * period]


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
    assert _decay_steps(scales)[:2] == [trigger, trigger + 40]  # fixed period 40 < trigger: decay at once


def test_slope_is_least_squares():
    ctrl = C.MetricTriggered("m", trend_window=7, trend_slope=1e9)
    steps = [0, 1, 2, 4, 5, 8, 9]
    values = [0.3, 0.1, 0.5, 0.4, 0.9, 0.7, 1.3]
    for t, v in zip(steps, values):
        ctrl.update(t, {"m": v})
    assert ctrl.slope() == pytest.approx(np.polyfit(steps, values, 1)[0], rel=1e-12)


def test_metric_triggered_round_trip():
    values = 1.0 + np.random.default_rng(3).normal(0, 0.1, 500) + np.linspace(0, 2, 500)
    kw = dict(threshold=2.0, trend_window=20, trend_slope=0.01, ema=0.8)
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
                         mode=mode, lr0=2e-6)

    product, minimum, length_only, mm_only = build("product"), build("min"), C.LengthTriggeredDecay(), \
        C.MetricTriggered("mm", threshold=0.05, decay_period=100)
    for t, m in enumerate(metrics):
        p, q, a, b = product.update(t, m), minimum.update(t, m), length_only.update(t, m), mm_only.update(t, m)
        assert p == pytest.approx(2e-6 * a * b) and q == pytest.approx(2e-6 * min(a, b))
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
    with pytest.raises(KeyError, match="'mm'"):
        ctrl.update(0, {KEY: 1000.0})
    assert ctrl.controllers[0].state_dict()["state"]["last_step"] == -1
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
