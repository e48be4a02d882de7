"""The statistics of `compare`'s table, each against a hand-computed value: the paired t interval and win
count, final/peak as the mean of per-seed ratios, the peak without the initial validation, LR decays that
include a cut at step 0, the smoothed collapse rule on a real no-mismatch run, and the paired table."""

from __future__ import annotations

import json

import pytest

from jaxrl_mismatch.report.paired import paired_against, paired_difference, paired_markdown, t_interval
from jaxrl_mismatch.report.summary import CollapseRule, RunResult, run_stats, summarize, table_markdown, write_table


def test_t_interval_by_hand():
    # d = [.1, .2, .3, 0, .4]: mean .2; sd = sqrt((.01 + 0 + .01 + .04 + .04) / 4) = sqrt(.025) = .158114;
    # t_{0.975, 4} = 2.776 (t table); half width = 2.776 * .158114 / sqrt(5) = .19632.
    lo, hi = t_interval([0.1, 0.2, 0.3, 0.0, 0.4])
    assert lo == pytest.approx(0.2 - 0.19632, abs=1e-4) and hi == pytest.approx(0.2 + 0.19632, abs=1e-4)
    # Two differences: t_{0.975, 1} = 12.706; d = [1, 3]: sd = sqrt(2), half = 12.706 * sqrt(2) / sqrt(2).
    assert t_interval([1.0, 3.0]) == pytest.approx((2.0 - 12.706, 2.0 + 12.706), abs=1e-3)
    assert t_interval([0.5]) is None


def test_paired_difference_pairs_seed_by_seed():
    variant = {0: 0.5, 1: 0.4, 2: 0.3, 3: None, 5: 0.9}
    baseline = {0: 0.4, 1: 0.4, 2: 0.35, 3: 0.1, 4: 0.2}
    p = paired_difference(variant, baseline)
    # Seeds 0-2 only (3 has no value in the variant, 4 and 5 are not in both): d = [.1, 0, -.05].
    assert p["n"] == 3 and list(p["per_seed"]) == [0, 1, 2]
    assert p["per_seed"][0] == pytest.approx(0.1) and p["per_seed"][2] == pytest.approx(-0.05)
    assert p["mean"] == pytest.approx(0.05 / 3)
    assert (p["wins"], p["losses"], p["ties"]) == (1, 1, 1)
    assert p["ci95"][0] < p["mean"] < p["ci95"][1]


def _run(val: list[tuple[int, float]], scale: list[float] | None = None) -> list[dict]:
    steps = max(s for s, _ in val) + 1
    recs = [{"step": s, "reward/mean": 0.5} for s in range(steps)]
    if scale is not None:
        for r, v in zip(recs, scale):
            r["controller/scale"] = v
    at = {r["step"]: r for r in recs}
    out = []
    for s, v in val:
        if s < 0:
            out.append({"step": s, "val/accuracy": v})
        else:
            at[s]["val/accuracy"] = v
    return out + recs


def test_peak_leaves_out_the_initial_validation_and_final_over_peak_is_per_run():
    # The sigma = 3 constant run's shape: the initial policy is its best validation.
    s = run_stats(_run([(-1, 0.5), (9, 0.2), (19, 0.1)]), CollapseRule())
    assert (s["val_initial"], s["val_peak"], s["val_final"]) == (0.5, 0.2, 0.1)
    assert s["val_final_over_peak"] == pytest.approx(0.5)


def test_lr_decays_count_a_cut_at_step_0():
    # The mismatch-triggered staircase: x0.5 on step 0, then every 10 steps down to the floor 0.1 at step 30.
    scale = [0.5] * 10 + [0.25] * 10 + [0.125] * 10 + [0.1] * 10
    assert run_stats(_run([(39, 0.3)], scale), CollapseRule())["lr_decays"] == 4
    assert run_stats(_run([(39, 0.3)], [1.0] * 40), CollapseRule())["lr_decays"] == 0


def test_final_over_peak_over_seeds_is_the_mean_of_ratios_not_the_ratio_of_means():
    # Seed 0: final .1 / peak .2 = .5; seed 1: .3 / .3 = 1.  Mean of ratios .75; ratio of means .2 / .25 = .8.
    runs = [RunResult(seed=0, run_dir="a0", status="ok", ok=True, records=_run([(-1, 0.1), (9, 0.2), (19, 0.1)])),
            RunResult(seed=1, run_dir="a1", status="ok", ok=True, records=_run([(-1, 0.1), (9, 0.3), (19, 0.3)]))]
    table = summarize({"a": runs}, CollapseRule())
    assert table["a"]["summary"]["val_final_over_peak"]["mean"] == pytest.approx(0.75)
    assert [r["stats"]["val_final_over_peak"] for r in table["a"]["runs"]] == pytest.approx([0.5, 1.0])


# `no_mismatch` seed 0 of experiments/schedulers.py (lr 7e-4, no injected mismatch, 80 steps), rerun on this
# code (2026-11-25): validation at steps -1, 9, ..., 79 and the train reward of every step. It learns to 0.30,
# dips to 0.16 at step 29 (52 % of its peak) and ends at 0.28; single batches reward as little as 0.03.
NO_MISMATCH_VAL = [(-1, 0.1171875), (9, 0.234375), (19, 0.30078125), (29, 0.15625), (39, 0.2109375),
                   (49, 0.2734375), (59, 0.23828125), (69, 0.25390625), (79, 0.27734375)]
NO_MISMATCH_REWARD = [
    0.164, 0.234, 0.281, 0.242, 0.312, 0.352, 0.258, 0.219, 0.305, 0.211, 0.102, 0.273, 0.25, 0.141, 0.305, 0.195,
    0.32, 0.43, 0.227, 0.227, 0.273, 0.219, 0.25, 0.367, 0.258, 0.086, 0.195, 0.172, 0.094, 0.031, 0.188, 0.234,
    0.164, 0.305, 0.07, 0.227, 0.164, 0.32, 0.172, 0.195, 0.211, 0.156, 0.445, 0.242, 0.328, 0.352, 0.328, 0.211,
    0.211, 0.164, 0.242, 0.375, 0.375, 0.344, 0.281, 0.312, 0.32, 0.211, 0.219, 0.383, 0.305, 0.148, 0.125, 0.289,
    0.227, 0.234, 0.492, 0.375, 0.117, 0.266, 0.242, 0.359, 0.289, 0.281, 0.297, 0.305, 0.406, 0.047, 0.406, 0.305]
E_SPEC_RULE = CollapseRule(metric="val/accuracy", frac=0.5, window=3, patience=3)  # experiments/e*.py


def test_collapse_rules_do_not_fire_on_the_no_mismatch_run():
    recs = _run(NO_MISMATCH_VAL)
    for r, reward in zip((r for r in recs if r["step"] >= 0), NO_MISMATCH_REWARD):
        r["reward/mean"] = reward
    assert E_SPEC_RULE.step(recs) is None
    assert CollapseRule().step(recs) is None  # reward/mean, 10-point median, patience 10
    # Why smoothing: cut after the 0.047 batch of step 77, an unsmoothed one-point rule calls it a collapse.
    cut = [r for r in recs if r["step"] <= 77]
    assert CollapseRule(window=1, patience=1).step(cut) == 77 and CollapseRule().step(cut) is None
    # The validation rule does fire on a run that learns and loses it (sigma = 3 at lr 7e-4: 0.15 -> 0.03).
    collapsed = [(-1, 0.125), (9, 0.15), (19, 0.14), (29, 0.1), (39, 0.06), (49, 0.05), (59, 0.04), (69, 0.03),
                 (79, 0.03)]
    # medians: .15 .145 .14 .1 .06 .05 .04 .03 — below .5 x .15 = .075 from step 49 on.
    assert E_SPEC_RULE.step(_run(collapsed)) == 49


def test_paired_table_and_json(tmp_path):
    finals = {"base": [0.2, 0.3, 0.25], "better": [0.3, 0.35, 0.24]}
    table = summarize({v: [RunResult(seed=s, run_dir=f"{v}{s}", status="ok", ok=True,
                                     records=_run([(-1, 0.1), (9, 0.4), (19, f)])) for s, f in enumerate(fs)]
                       for v, fs in finals.items()}, CollapseRule())
    paired = paired_against(table, "base")
    assert list(paired) == ["better"]
    p = paired["better"]["val_final"]
    # d = [.1, .05, -.01]: mean .04667, sd .05508, t_{0.975, 2} = 4.303: half = 4.303 * .05508 / sqrt(3) = .13683.
    assert p["mean"] == pytest.approx(0.046667, abs=1e-5) and (p["wins"], p["n"]) == (2, 3)
    assert p["ci95"] == pytest.approx([0.046667 - 0.13683, 0.046667 + 0.13683], abs=1e-4)
    md = paired_markdown(paired, "base")
    assert "| better | 3 | +0.047 [-0.090, +0.183], 2/3 |" in md
    md_path, json_path = tmp_path / "t.md", tmp_path / "t.json"
    text = write_table(table, CollapseRule(), str(md_path), str(json_path), baseline="base")
    assert text == md_path.read_text() and md in text and table_markdown(table, CollapseRule()) in text
    saved = json.loads(json_path.read_text())
    assert saved["baseline"] == "base"
    assert saved["paired"]["better"]["val_final"]["per_seed"] == pytest.approx({"0": 0.1, "1": 0.05, "2": -0.01})
    assert [r["stats"]["val_final"] for r in saved["variants"]["better"]["runs"]] == [0.3, 0.35, 0.24]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.md"]  # no temporary left behind


def test_a_paired_cell_names_its_ties_and_nans_so_no_win_count_reads_as_all_lower():
    from jaxrl_mismatch.report.paired import PAIRED

    p = paired_difference({0: 0.5, 1: 0.5, 2: 0.4, 3: float("nan"), 4: 0.6}, {s: 0.5 for s in range(5)})
    assert (p["n"], p["wins"], p["losses"], p["ties"]) == (5, 1, 1, 2)
    row = paired_markdown({"v": {k: p for k, _, _ in PAIRED}}, "base").splitlines()[2]
    assert ", 1/5 (2 tied, 1 NaN) |" in row
    clean = paired_difference({0: 0.6, 1: 0.4}, {0: 0.5, 1: 0.5})
    assert paired_markdown({"v": {k: clean for k, _, _ in PAIRED}}, "b").splitlines()[2].endswith(", 1/2 |")


def test_controls_are_paired_with_the_variant_they_could_explain(tmp_path):
    # "better" beats "base" by +0.1 in every seed, but so does its control "lower_lr": against it, nothing.
    finals = {"base": [0.2, 0.3, 0.25], "better": [0.3, 0.4, 0.35], "lower_lr": [0.31, 0.39, 0.36]}
    table = summarize({v: [RunResult(seed=s, run_dir=f"{v}{s}", status="ok", ok=True,
                                     records=_run([(-1, 0.1), (9, 0.4), (19, f)])) for s, f in enumerate(fs)]
                       for v, fs in finals.items()}, CollapseRule())
    md_path, json_path = tmp_path / "t.md", tmp_path / "t.json"
    text = write_table(table, CollapseRule(), str(md_path), str(json_path), baseline="base",
                       controls={"better": "lower_lr"})
    saved = json.loads(json_path.read_text())
    assert saved["controls"] == {"better": "lower_lr"}
    c = saved["paired_controls"]["better vs lower_lr"]["val_final"]
    assert c["per_seed"] == pytest.approx({"0": -0.01, "1": 0.01, "2": -0.01}) and (c["wins"], c["n"]) == (1, 3)
    assert saved["paired"]["better"]["val_final"]["wins"] == 3
    assert "| variant vs its control |" in text and "| better vs lower_lr | 3 | -0.003 [" in text


def test_one_record_per_step_the_last_written_in_step_order():
    """A step written twice counts once (its last record), and "final" is the last step, not the last line: a
    duplicated step doubled Σ step time, and an earlier step written last became the final validation."""
    recs = [{"step": -1, "val/accuracy": 0.1}]
    recs += [{"step": s, "reward/mean": 0.5, "time/step_s": 1.0, **({"val/accuracy": 0.3} if s == 9 else {})}
             for s in range(10)]
    recs += [{"step": s, "reward/mean": 0.5, "time/step_s": 1.0} for s in range(5, 9)]  # steps 5-8 again
    recs.append({"step": 4, "reward/mean": 0.5, "time/step_s": 1.0, "val/accuracy": 0.9})  # step 4, written last
    s = run_stats(recs, CollapseRule())
    assert s["step_time_s"] == 10.0 and s["steps_done"] == 10.0
    assert (s["val_final"], s["val_peak"]) == (0.3, 0.9)
    from jaxrl_mismatch.report.summary import series
    assert series(recs, "val/accuracy") == ([-1, 4, 9], [0.1, 0.9, 0.3])


def test_non_finite_values_are_kept_not_skipped():
    """A NaN last validation is a NaN final (an earlier value was taken), an inf step makes the max inf (it was
    left out), whether logged as runlog's strings, JSON's NaN / Infinity or an integer too large for a float
    (OverflowError); the table lists the run and its JSON stays strict JSON."""
    import math

    recs = [{"step": s, "reward/mean": 0.5, "mismatch/log_ppl_abs_diff": 0.01} for s in range(10)]
    recs[4]["val/accuracy"], recs[9]["val/accuracy"] = 0.4, float("nan")
    recs[6]["mismatch/log_ppl_abs_diff"] = "inf"
    s = run_stats(recs, CollapseRule())
    assert math.isnan(s["val_final"]) and math.isnan(s["val_peak"]) and math.isnan(s["val_final_over_peak"])
    assert s["log_ppl_abs_diff_max"] == math.inf and s["log_ppl_abs_diff_mean"] == math.inf
    recs[6]["mismatch/log_ppl_abs_diff"], recs[9]["val/accuracy"] = 10**400, "nan"
    s = run_stats(recs, CollapseRule())
    assert s["log_ppl_abs_diff_max"] == math.inf and math.isnan(s["val_final"])
    assert s["collapsed"] == 0.0  # the collapse rule is on the finite values
    table = summarize({"v": [RunResult(seed=3, run_dir="r3", status="ok", ok=True, records=recs)]}, CollapseRule())
    md = table_markdown(table, CollapseRule())
    assert "Runs that logged NaN or inf" in md and "- v seed 3: val_final = nan" in md
    assert "log_ppl_abs_diff_max = inf" in md
    assert "| nan |" in md and "| inf |" in md


def test_table_json_is_strict_json_with_non_finite_values(tmp_path):
    recs = [{"step": 0, "reward/mean": 0.5, "val/accuracy": "nan", "mismatch/log_ppl_abs_diff": "inf"}]
    table = summarize({"v": [RunResult(seed=0, run_dir="r", status="ok", ok=True, records=recs)]}, CollapseRule())
    write_table(table, CollapseRule(), str(tmp_path / "t.md"), str(tmp_path / "t.json"))

    def refuse(token):
        raise AssertionError(f"{token} is not JSON")

    content = json.loads((tmp_path / "t.json").read_text(), parse_constant=refuse)
    stats = content["variants"]["v"]["runs"][0]["stats"]
    assert stats["val_final"] == "nan" and stats["log_ppl_abs_diff_max"] == "inf"  # as runlog writes them


def test_the_training_step_statistics_leave_out_the_step_minus_1_record():
    # A step -1 record holding training metrics (a hand-written or foreign log) is the initial validation's, not a
    # training step's: the means, max, lengths, decays and summed step time are over steps 0-2 only.
    recs = [{"step": -1, "val/accuracy": 0.1, "mismatch/log_ppl_abs_diff": 5.0, "mismatch/rho_std": 7.0,
             "time/step_s": 100.0, "length/mean": 1000.0, "controller/scale": 0.5}]
    recs += [{"step": s, "mismatch/log_ppl_abs_diff": 0.01, "mismatch/rho_std": 0.1, "time/step_s": t,
              "length/mean": 10.0, "controller/scale": 1.0} for s, t in enumerate((1.0, 1.0, 1.0))]
    s = run_stats(recs, CollapseRule())
    assert (s["log_ppl_abs_diff_mean"], s["log_ppl_abs_diff_max"]) == (pytest.approx(0.01), 0.01)
    assert s["rho_std_mean"] == pytest.approx(0.1) and s["step_time_s"] == 3.0
    assert (s["length_start"], s["length_end"], s["lr_decays"]) == (10.0, 10.0, 0.0)
    assert s["val_initial"] == 0.1 and s["steps_done"] == 3.0
