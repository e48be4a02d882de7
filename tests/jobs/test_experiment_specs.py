"""The experiment specs of issue 19 (experiments/e0-e3) say what their docstrings claim: 5 paired seeds and
a named baseline in every grid, only the weighting differing between E2's variants, E1's controllers
firing at the onset / at step 0 / late, E0's control at the trigger's mean LR, and every grid valid.

Which checks wait for issue 19 items 1-2: E1 and E2 name `rollout.quantize` and `rollout.mismatch_onset_step`
(branch i19). Every grid whose fields all exist in this checkout's config schema is validated in full, as
`compare` validates it before running; for the others the test asserts that the only unknown fields are those
(nothing else can be misspelt), and once they are merged the same test validates those grids in full too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from jaxrl_mismatch.jobs import compare
from jaxrl_mismatch.objectives import objective_config
from jaxrl_mismatch.report.summary import CollapseRule
from jaxrl_mismatch.schedules.controllers import make_controller
from jaxrl_mismatch.train.config import OPEN_SECTIONS, base_config

REPO = Path(__file__).resolve().parents[2]
ISSUE19_ROLLOUT_FIELDS = {"rollout.quantize", "rollout.mismatch_onset_step", "rollout.mismatch_ramp_steps"}


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"_spec_{name}", REPO / "experiments" / f"{name}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


GRIDS = ["e0_controls.py", *(f"e1_timing.py:{s}" for s in _module("e1_timing").SOURCES),
         *(f"e2_corrections.py:{s}" for s in _module("e2_corrections").SOURCES),
         *(f"e3_precision.py:{a}" for a in [*_module("e3_precision").ALGORITHMS, "exact", "long_ppo", "long_exact", "long_ppo@1e-4",
                                                                          "discover_ppo", "discover_exact",
                                                                          "discover_exact_pg_seq_is"]),
         *(f"e4_staleness.py:{s}" for s in _module("e4_staleness").SOURCES), "e4_staleness.py:int8@3e-4"]


def _known(key: str) -> bool:
    """Whether `key` is a field of this checkout's config schema (or a key of an open section)."""
    return key in set(_flat(base_config())) or any(key.startswith(s + ".") for s in OPEN_SECTIONS)


def _flat(c, prefix=""):
    for k, v in c.items():
        if hasattr(v, "items") and f"{prefix}{k}" not in OPEN_SECTIONS:
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


@pytest.mark.parametrize("grid", GRIDS)
def test_every_grid_has_5_paired_seeds_a_baseline_and_is_valid(grid, monkeypatch):
    monkeypatch.chdir(REPO)  # the specs' paths are relative to the repository root, as on the command line
    spec = compare.load_spec(f"experiments/{grid}")
    assert len(spec.seeds) >= 5 and spec.baseline in spec.variants
    # Smoothed rules that do not fire on the no-mismatch reference run (tests/test_report_stats.py); E3 judges
    # the training reward, as the FP16 paper's sanity test does.
    val_rule = CollapseRule(metric="val/accuracy", frac=0.5, window=3, patience=3)
    rule = CollapseRule() if grid.startswith("e3_") else val_rule
    assert spec.collapse == rule
    assert 0 < spec.overrides["checkpoint.every"] <= 20  # resumable: an interrupted run loses <= 20 steps
    keys = set(spec.overrides) | {k for v in spec.variants.values() for k in v}
    unknown = {k for k in keys if not _known(k)}
    assert unknown <= ISSUE19_ROLLOUT_FIELDS, unknown
    if not unknown:
        spec = compare.validate_spec(spec)
        assert len(spec.jobs) == len(spec.seeds) * len(spec.variants)


@pytest.mark.parametrize("source", list(_module("e2_corrections").SOURCES))
def test_e2_variants_differ_only_in_the_importance_weight(source, monkeypatch):
    monkeypatch.chdir(REPO)
    spec = compare.load_spec(f"experiments/e2_corrections.py:{source}")
    configs = {name: dataclasses.asdict(objective_config(v["objective.preset"])) for name, v in spec.variants.items()}
    weight = {"correction", "correction_cap", "correction_low"}
    rest = {name: {k: x for k, x in c.items() if k not in weight} for name, c in configs.items()}
    assert all(r == rest["dapo"] for r in rest.values()), rest
    assert rest["dapo"]["eps_low"] == 0.2 and rest["dapo"]["eps_high"] == 0.28  # the same clip for every arm
    assert {c["correction"] for c in configs.values()} == {"none", "token_tis", "seq_sum_mis", "icepop"}
    assert all(set(v) == {"objective.preset"} for v in spec.variants.values())  # nothing else per variant


def _cuts(kwargs: dict, diffs: list[float]) -> list[int]:
    """Steps at which the controller built from `kwargs` lowers its scale, fed `log_ppl_abs_diff`s."""
    ctrl = make_controller("metric_triggered", **kwargs)
    scales = [1.0] + [ctrl.update(step, {"mismatch/log_ppl_abs_diff": d}) for step, d in enumerate(diffs)]
    return [step for step, (a, b) in enumerate(zip(scales, scales[1:])) if b < a]


def _kwargs(variant: dict) -> dict:
    return {k.removeprefix("controller.kwargs."): v for k, v in variant.items() if k.startswith("controller.kwargs.")}


def test_e1_staircases_start_at_the_onset_at_step_0_and_late():
    m = _module("e1_timing")
    spec = m.get_spec("int8")
    # Before the onset the fp32 pair (~1.7e-7, docs/experiments.md); from it a bf16-level mismatch (1.8e-3).
    diffs = [1.7e-7] * m.ONSET + [1.8e-3] * (m.STEPS - m.ONSET)
    cuts = {name: _cuts(_kwargs(v), diffs) for name, v in spec["variants"].items() if "controller.name" in v}
    assert cuts["triggered"][0] == m.ONSET and cuts["staircase_step0"][0] == 0 and cuts["staircase_late"][0] == m.LATE
    # The same staircase in all three, shifted: a cut every 10 steps until the floor 0.1 (4 cuts; the late one
    # is cut short by the end of the run).
    assert [c - cuts["triggered"][0] for c in cuts["triggered"]] == [0, 10, 20, 30] == cuts["staircase_step0"]
    assert cuts["staircase_late"] == [c for c in range(m.LATE, m.STEPS, 10)][:4]
    assert spec["overrides"]["rollout.mismatch_onset_step"] == m.ONSET and spec["baseline"] == "triggered"


def test_e0_control_runs_at_the_trigger_s_mean_lr():
    m = _module("e0_controls")
    spec = m.get_spec()
    ctrl = make_controller("metric_triggered", **_kwargs(spec["variants"]["mismatch_triggered"]))
    scales = [ctrl.update(step, {"mismatch/log_ppl_abs_diff": 0.9}) for step in range(m.STEPS)]  # σ = 3: ~0.9
    mean_lr = m.LR * sum(scales) / m.STEPS
    assert spec["variants"]["constant_trigger_mean_lr"]["optim.lr"] == pytest.approx(mean_lr, rel=1e-12)
    assert mean_lr == pytest.approx(7e-4 * 13.75 / 80)  # 10·0.5 + 10·0.25 + 10·0.125 + 50·0.1 = 13.75


def test_e3_grids_compare_precisions_of_one_algorithm():
    m = _module("e3_precision")
    for algorithm in m.ALGORITHMS:
        for grid in (algorithm, f"long_{algorithm}", f"discover_{algorithm}"):
            spec = m.get_spec(grid)
            assert list(spec["variants"]) == ["bf16", "fp16", "fp32"]
            # Trainer and engine in the same precision in every arm; the algorithm is in the shared overrides.
            assert [(v["trainer.precision"], v["rollout.dtype"]) for v in spec["variants"].values()] == [
                ("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")]
            assert not any(k.startswith("objective.") for v in spec["variants"].values() for k in v)
            assert spec["controls"] == {"fp16": "fp32"}
            if spec["overrides"]["objective.preset"].startswith("drgrpo"):
                max_tokens = spec["overrides"].get("rollout.max_tokens", m.MAX_TOKENS)
                assert spec["overrides"]["objective.overrides.max_len"] == max_tokens
    for grid in ("exact", "long_exact", "discover_exact"):
        exact = m.get_spec(grid)["variants"]
        assert {k: x for k, x in exact["bf16_exact"].items() if k != "rollout.exact"} == exact["bf16"]
        assert exact["bf16_exact"]["rollout.exact"] is True
    # The default task's exact grid has the other default grids' steps and PPO's objective, in its own directory.
    assert m.get_spec("exact")["overrides"] == m.get_spec("ppo")["overrides"]
    assert m.get_spec("exact")["out"] == "runs/compare/e3_short_exact"
    assert m.get_spec("long_exact")["overrides"]["steps"] == m.EXACT_STEPS
    with pytest.raises(ValueError, match="unknown grid 'grpo'"):
        m.get_spec("grpo")
    with pytest.raises(ValueError, match="unknown grid 'long_grpo'"):
        m.get_spec("long_grpo")
    # The default task and the :long one differ in config and batch, not in the algorithm.
    short, long = m.get_spec("ppo"), m.get_spec("long_ppo")
    assert short["config"] == "configs/arith_length_cpu.py" and long["config"].endswith(":long")
    assert short["out"] == "runs/compare/e3_short_ppo" and long["out"] == "runs/compare/e3_precision_ppo"
    # `@LR` changes only the LR and the directory; the first :long grids' directories (3e-4) keep their names.
    at = m.get_spec("long_ppo@1e-4")
    assert at["overrides"]["optim.lr"] == 1e-4 and at["out"] == "runs/compare/e3_precision_ppo_lr0.0001"
    assert long["overrides"]["optim.lr"] == m.LONG_LR
    assert {k: x for k, x in at["overrides"].items() if k != "optim.lr"} == {
        k: x for k, x in long["overrides"].items() if k != "optim.lr"}
    assert m.get_spec("ppo@1e-4")["out"] == "runs/compare/e3_short_ppo_lr0.0001"
    # :long_discover: the default task's batch and steps, :long's response budget, its own config and directory.
    disc = m.get_spec("discover_ppo")
    assert disc["config"].endswith(":long_discover") and disc["out"] == "runs/compare/e3_discover_ppo"
    assert disc["overrides"] == {**short["overrides"], "rollout.max_tokens": m.LONG_MAX_TOKENS,
                                 "objective.overrides.max_len": m.LONG_MAX_TOKENS}
    with pytest.raises(ValueError, match="unknown grid 'discover_grpo'"):
        m.get_spec("discover_grpo")
    # exact_ALGO: the exact grid of another algorithm — that algorithm's objective, bf16 vs bf16 + exact.
    ex = m.get_spec("discover_exact_pg_seq_is")
    assert list(ex["variants"]) == ["bf16", "bf16_exact"] and ex["out"] == "runs/compare/e3_discover_exact_pg_seq_is"
    assert ex["overrides"] == m.get_spec("discover_pg_seq_is")["overrides"]
    assert m.get_spec("discover_exact")["overrides"] == disc["overrides"]  # plain `exact` stays PPO
    with pytest.raises(ValueError, match="unknown grid 'exact_grpo'"):
        m.get_spec("exact_grpo")
    for bad, msg in (("ppo@fast", "not a number"), ("ppo@0", "must be > 0")):
        with pytest.raises(ValueError, match=msg):
            m.get_spec(bad)


def test_e3_summary_reads_every_number_from_the_grids_and_counts_the_intervals(tmp_path):
    m = _module("e3_summary")

    def cell(mean, lo, hi, wins, ties=0, n=5):
        return {"val_final": {"mean": mean, "ci95": None if lo is None else [lo, hi], "wins": wins, "n": n,
                              "losses": n - wins - ties, "ties": ties}}

    def variant(final, collapsed, ok=5):
        return {"summary": {"val_final": {"mean": final}}, "collapsed": collapsed, "ok": ok, "total": 5}

    (tmp_path / "e3_short_ppo.json").write_text(json.dumps({
        "variants": {"bf16": variant(0.41, 0), "fp16": variant(0.45, 1), "fp32": variant(0.43, 0)},
        "paired": {"fp16": cell(0.04, 0.01, 0.07, 5), "fp32": cell(0.02, -0.01, 0.05, 3)},
        "paired_controls": {"fp16 vs fp32": cell(0.02, -0.03, 0.07, 3)}}))
    (tmp_path / "e3_short_exact.json").write_text(json.dumps({
        "variants": {"bf16": variant(0.40, 0), "bf16_exact": variant(0.38, 2)},
        "paired": {"bf16_exact": cell(-0.02, -0.05, -0.001, 1)}}))
    text, counts = m.summary(tmp_path)
    assert "| `ppo` | 0.410 / 0.450 / 0.430 | 0 / 1 / 0 | +0.040 [+0.010, +0.070], 5/5 |" in text
    assert "| `exact` | 0.400 / 0.380 | 0 / 2 | −0.020 [−0.050, −0.001], 1/5 |" in text
    assert counts["intervals"] == 4 and counts["excluding_zero"] == ["ppo fp16 − bf16", "exact bf16_exact − bf16"]
    # another algorithm's exact grid gets its own row and interval
    (tmp_path / "e3_short_exact_pg_seq_is.json").write_text((tmp_path / "e3_short_exact.json").read_text())
    text, counts = m.summary(tmp_path)
    assert "| `exact_pg_seq_is` | 0.400 / 0.380 |" in text and counts["intervals"] == 5
    assert "seq_tis" in counts["missing"] and "ppo" not in counts["missing"]
    # The :long_discover grids are read from their own files.
    (tmp_path / "e3_discover_ppo.json").write_text((tmp_path / "e3_short_ppo.json").read_text().replace("0.41", "0.31"))
    text, counts = m.summary(tmp_path, "discover")
    assert "| `ppo` | 0.310 / 0.450 / 0.430 |" in text and "exact" in counts["missing"]
    out = tmp_path / "fig" / "e3.png"
    out.parent.mkdir()
    m.figure(tmp_path, "short", out)  # ppo's three comparisons and the exact grid's one
    assert out.read_bytes()[:4] == b"\x89PNG" and [p.name for p in out.parent.iterdir()] == ["e3.png"]
    # An unfinished grid: fp16 with 1 of 5 seeds (no interval), a tie named; it crashed on the missing interval.
    (tmp_path / "e3_short_ppo.json").write_text(json.dumps({
        "variants": {"bf16": variant(0.41, 0), "fp16": variant(0.45, 1, ok=1), "fp32": variant(0.43, 0, ok=4)},
        "paired": {"fp16": cell(0.04, None, None, 1, n=1), "fp32": cell(0.0, -0.01, 0.01, 1, ties=2, n=4)},
        "paired_controls": {"fp16 vs fp32": cell(0.02, None, None, 1, n=1)}}))
    text, counts = m.summary(tmp_path)
    assert ("| `ppo` | 0.410 / 0.450 (n=1/5) / 0.430 (n=4/5) | 0 / 1/1 / 0/4 | +0.040, 1/1 | "
            "+0.000 [−0.010, +0.010], 1/4 (2 tied) | +0.020, 1/1 |") in text
    assert counts["intervals"] == 3  # the ppo grid's one interval and the two exact grids'
    m.figure(tmp_path, "short", out)


def test_e4_variants_differ_only_in_objective_and_staleness_and_the_control_skips_s0():
    m = _module("e4_staleness")
    variants = m.get_spec("int8")["variants"]
    assert len(variants) == len(m.OBJECTIVES) * len(m.STALENESS) + sum(map(len, m.CONTROLS.values()))
    assert "decoupled_tis_s0" not in variants and "decoupled_tis_s2" in variants
    for name, v in variants.items():
        s = int(name.rsplit("_s", 1)[1])
        assert v == {"objective.preset": name.rsplit("_s", 1)[0], "rollout.max_staleness": s,
                     "rollout.fixed_staleness": s > 0}
    # Every control pairs two variants at the same staleness.
    controls = m.get_spec("int8")["controls"]
    assert controls["decoupled_s2"] == "naive_ppo_s2" and controls["decoupled_tis_s4"] == "decoupled_s4"
    assert all(v.rsplit("_s", 1)[1] == c.rsplit("_s", 1)[1] and c in variants for v, c in controls.items())


def test_e4_summary_lays_out_the_grid_by_staleness_and_reads_the_paired_controls():
    m = _module("e4_summary")

    def variant(final, std, collapsed, ok=5):
        return {"summary": {"val_final": {"mean": final, "std": std}}, "collapsed": collapsed, "ok": ok, "total": 5}

    d = {"variants": {"naive_ppo_s1": variant(0.3, 0.04, 0), "decoupled_s1": variant(0.1, 0.07, 2),
                      "decoupled_s2": variant(0.05, None, 0, ok=1)},  # one finished seed: no spread (it crashed)
         "paired_controls": {"decoupled_s1 vs naive_ppo_s1": {
             "val_final": {"mean": -0.2, "ci95": [-0.3, -0.1], "wins": 0, "n": 5, "losses": 4, "ties": 1}}}}
    text = m.summary(d)
    assert "| 1 | 0.300 ± 0.040 (0/5 collapsed) | 0.100 ± 0.070 (2/5 collapsed) | – | – |" in text
    assert "| 1 | −0.200 [−0.300, −0.100], 0/5 (1 tied) | – | – |" in text
    assert "| 0 | – | – | – | – |" in text
    assert "| 2 | – | 0.050 (0/1 collapsed, n=1/5) | – | – |" in text


def test_e4_summary_figure_draws_the_seeds_and_leaves_only_the_png(tmp_path):
    m = _module("e4_summary")
    runs = lambda *finals: [{"ok": True, "stats": {"val_final": f}} for f in finals]  # noqa: E731
    d = {"variants": {"naive_ppo_s0": {"runs": runs(0.2, 0.3, 0.25)}, "decoupled_s1": {"runs": runs(0.1, 0.05)},
                      "decoupled_s2": {"runs": runs(0.04)}}}
    out = tmp_path / "e4.png"
    m.figure(d, out, "E4 test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and [p.name for p in tmp_path.iterdir()] == ["e4.png"]


def test_e4_lr_control_runs_naive_and_decoupled_at_s0_and_s2_at_the_other_lr_in_its_own_directory():
    m = _module("e4_staleness")
    spec, main = m.get_spec("int8@3e-4"), m.get_spec("int8")
    assert sorted(spec["variants"]) == ["decoupled_s0", "decoupled_s2", "naive_ppo_s0", "naive_ppo_s2"]
    assert all(spec["variants"][v] == main["variants"][v] for v in spec["variants"])
    assert spec["overrides"] == {**main["overrides"], "optim.lr": 3e-4}
    assert spec["out"] == "runs/compare/e4_staleness_int8_lr0.0003" and main["out"] == "runs/compare/e4_staleness_int8"
    assert spec["controls"] == {"decoupled_s0": "naive_ppo_s0", "decoupled_s2": "naive_ppo_s2"}
    for bad, msg in (("int8@fast", "not a number"), ("int8@-1", "must be > 0"), ("int4", "unknown mismatch source")):
        with pytest.raises(ValueError, match=msg):
            m.get_spec(bad)


@pytest.mark.parametrize("script", ["e3_summary.py", "e4_summary.py"])
def test_summary_figure_never_overwrites_a_file_it_did_not_write(script, tmp_path):
    """`--figure` on an existing file that is not a figure (here text named .png) is refused in one line, exit 2,
    and the file is left as it was."""
    import subprocess
    import sys

    victim = tmp_path / "notes.png"
    victim.write_text("not a figure\n")
    r = subprocess.run([sys.executable, str(REPO / "experiments" / script), "--figure", str(victim)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--figure" in r.stderr
    assert victim.read_text() == "not a figure\n"
