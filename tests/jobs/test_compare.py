"""`jaxrl-mismatch compare`: the spec is validated up front (one line naming the field), the numbers of the
table follow their definitions on synthetic run logs, and a real grid of train subprocesses runs end to
end, resumes, and reports a failed run as a row rather than crashing."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl_mismatch.jobs import compare
from jaxrl_mismatch.report.summary import CollapseRule, RunResult, run_stats, summarize
from jaxrl_mismatch.runlog import RunWriter, read_jsonl
from jaxrl_mismatch.usage import UsageError
from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[2]

TINY_CONFIG = """
from jaxrl_mismatch.train.config import base_config


def get_config():
    c = base_config()
    c.steps = 2
    c.model.path = {model!r}
    c.task.num_train = 200
    c.task.num_val = 8
    c.rollout.group_size = 4
    c.rollout.max_tokens = 24
    c.batch.prompts_per_step = 4
    c.batch.max_oversample_rounds = 1
    c.trainer.chunk_size = 16
    c.optim.lr = 1e-3
    c.controller.name = "length_triggered_decay"
    c.eval.every = 0
    c.eval.k = 2
    c.eval.greedy = False
    c.checkpoint.every = 1
    c.log.tensorboard = False
    c.log.report = False
    return c
"""


def write_config(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "tiny_config.py"
    path.write_text(TINY_CONFIG.format(model=str(model)))
    return path


def write_spec(tmp_path: Path, spec: dict, name: str = "spec.py") -> Path:
    path = tmp_path / name
    path.write_text(f"def get_spec():\n    return {spec!r}\n")
    return path


@pytest.fixture
def fake_model(tmp_path) -> Path:
    """A directory that passes `check_paths` (validation never loads the weights)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


# -- the spec: bad input is one line naming the field ----------------------------------------------------
def _spec(tmp_path, fake_model, **fields) -> dict:
    base = {"config": str(write_config(tmp_path, fake_model)), "variants": {"a": {}, "b": {"optim.lr": 2e-3}},
            "seeds": [0], "out": str(tmp_path / "out")}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.parametrize("fields, needles", [
    ({"config": None}, ["config: missing"]),
    ({"config": "configs/no_such.py"}, ["config: configs/no_such.py", "does not exist"]),
    ({"variants": {"a": {"optim.schedul": "cosine"}}},
     ["variants.a: config.optim.schedul: unknown field", "did you mean config.optim.schedule"]),
    ({"variants": {"a": {"optim.lr": -1.0}}}, ["variants.a: config.optim.lr: must be > 0"]),
    ({"variants": {"a": {"optim.lr": "fast"}}}, ["variants.a: config.optim.lr: expected a number"]),
    ({"variants": {}}, ["variants: must be a non-empty dict"]),
    ({"variants": {"a/b": {}}}, ["variants: name 'a/b' is not a directory name"]),
    # its runs' folder took the name of an output: a traceback after the whole grid had trained
    ({"variants": {"table.md": {}}}, ["variants: name 'table.md' is one of the names compare writes in `out`"]),
    ({"variants": {".jaxrl-mismatch-compare": {}}}, ["variants: name '.jaxrl-mismatch-compare' is one of the"]),
    ({"seeds": []}, ["seeds: must be a non-empty list"]),
    ({"seeds": [0, 0]}, ["seeds: must be a non-empty list of distinct integers"]),
    # passed --dry-run, then every run failed on config.seed (compare exit 1)
    ({"seeds": [2**40]}, ["seeds: must be a non-empty list of distinct integers in [0, 2^31)"]),
    ({"name": "../../etc", "out": None}, ["name: '../../etc' is not a directory name"]),
    ({"variant": {}}, ["variant: unknown field", "did you mean 'variants'"]),
    ({"overrides": {"run_dir": "x"}}, ["overrides.run_dir: is set by the harness"]),
    ({"overrides": {"steps": 2.5}}, ["overrides: config.steps: expected an integer"]),
    # An open section parses a new key as a literal: the string "5" would reach the run as the int 5.
    ({"overrides": {"controller.kwargs.window": "5"}}, ["overrides.controller.kwargs.window: '5' would reach the run as 5"]),
    ({"collapse": {"frac": 2}}, ["collapse.frac: must be a number in (0, 1)"]),
    ({"collapse": {"metrc": "x"}}, ["collapse.metrc: unknown field"]),
    ({"baseline": "c"}, ["baseline: 'c' is not a variant; variants: a, b"]),
    ({"controls": {"a": "c"}}, ["controls.a: 'a' -> 'c' must pair two different variants; variants: a, b"]),
    ({"controls": {"a": "a"}}, ["controls.a: 'a' -> 'a' must pair two different variants"]),
    ({"controls": ["a", "b"]}, ["controls: must be a dict variant -> control variant"]),
    ({"controls": {"a": ["b"]}}, ["controls.a: 'a' -> ['b'] must pair two variant names (strings)"]),  # was a TypeError
    ({"metrics": ["reward/mean", {"metric": "lr", "scale": "cubic"}]}, ["metrics[1].scale"]),
    # its final value was paired against the baseline's, taken at another step
    ({"variants": {"a": {}, "b": {"steps": 7}}}, ["variants.b: runs 7 steps, the baseline 'a' 2"]),
    # a base model the grid warm-starts inside its own out (a run folder, say) or around it: the dry run passed,
    # the warm start then refused the folder compare had made, or train refused the run folder (exit 1)
    ({"out": "OUT", "variants": {"a": {"model.path": "OUT", "model.warmstart_if_missing": True}}},
     ["variants.a: model.path OUT is the grid's out OUT"]),
    ({"out": "OUT", "variants": {"a": {"model.path": "OUT/a/seed_0", "model.warmstart_if_missing": True}}},
     ["variants.a: model.path OUT/a/seed_0 is inside the grid's out OUT", "give it a path outside `out`"]),
    ({"out": "OUT/grid", "variants": {"a": {"model.path": "OUT", "model.warmstart_if_missing": True}}},
     ["variants.a: model.path OUT holds the grid's out OUT/grid"]),
])
def test_bad_spec_is_one_line_naming_the_field(tmp_path, fake_model, fields, needles):
    fields = json.loads(json.dumps(fields).replace("OUT", str(tmp_path / "o")))
    needles = [n.replace("OUT", str(tmp_path / "o")) for n in needles]
    path = write_spec(tmp_path, _spec(tmp_path, fake_model, **fields))
    with pytest.raises(UsageError) as e:
        compare.main([str(path), "--dry-run"])
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"spec {path}: ")
    for n in needles:
        assert n in message, (n, message)
    assert not (tmp_path / "o").exists()  # a dry run writes nothing


@pytest.mark.slow
def test_spec_file_problems_and_the_cli_exit_code(tmp_path, fake_model):
    with pytest.raises(UsageError, match="does not exist"):
        compare.main([str(tmp_path / "nope.py")])
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(UsageError, match="defines no get_spec"):
        compare.main([str(tmp_path / "empty.py")])
    (tmp_path / "broken.py").write_text("def get_spec(:\n")
    with pytest.raises(UsageError, match=r"cannot load it \(line 1\)"):
        compare.main([str(tmp_path / "broken.py")])
    # Through the command line: exit 2, one line, no traceback.
    path = write_spec(tmp_path, _spec(tmp_path, fake_model, seeds=[]))
    out = subprocess.run([sys.executable, "-m", "jaxrl_mismatch.cli", "compare", str(path)], capture_output=True,
                         text=True, cwd=REPO, env=child_env(), timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr
    assert lines[0].startswith("error: spec ") and "seeds:" in lines[0]


def test_spec_file_with_an_argument_holds_several_grids(tmp_path, fake_model):
    """`FILE:ARG` calls get_spec(ARG) (as `train --config FILE:ARG`); the default name carries the argument."""
    config = str(write_config(tmp_path, fake_model))
    path = tmp_path / "grids.py"
    path.write_text(f"""
LR = {{"low": 1e-4, "high": 1e-3}}


def get_spec(grid="low"):
    return {{"config": {config!r}, "variants": {{"a": {{"optim.lr": LR[grid]}}}}, "seeds": [0]}}
""")
    spec = compare.validate_spec(compare.load_spec(f"{path}:high"))
    assert spec.name == "grids_high" and spec.out == os.path.join("runs", "compare", "grids_high")
    assert "--config.optim.lr=0.001" in spec.jobs[0].argv
    assert compare.load_spec(str(path)).name == "grids"
    with pytest.raises(UsageError, match=r"^spec .*grids.py:mid: cannot load it: KeyError: 'mid'$"):
        compare.load_spec(f"{path}:mid")


def test_dry_run_prints_one_train_command_per_variant_and_seed(tmp_path, fake_model, capsys):
    spec = _spec(tmp_path, fake_model, seeds=[3, 4], overrides={"steps": 7, "optim.schedule_kwargs.decay_steps": 10,
                                                                "optim.schedule": "cosine"})
    spec["variants"] = {"a": {}, "b": {"optim.lr": 2e-3, "batch.dynamic_sampling": False}}
    assert compare.main([str(write_spec(tmp_path, spec)), "--dry-run", "--jobs", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(lines) == 4
    # Seed-major order; every override is a --config flag the train parser reads; run_dir and seed last.
    b4 = lines[3].split()
    assert b4[b4.index("train") + 1:b4.index("train") + 3] == ["--config", spec["config"]]
    assert b4[-2:] == [f"--config.run_dir={tmp_path / 'out' / 'b' / 'seed_4'}", "--config.seed=4"]
    assert {"--config.steps=7", "--config.optim.lr=0.002", "--config.batch.dynamic_sampling=false",
            "--config.log.progress=false"} <= set(b4)
    assert "--config.optim.lr=0.002" not in lines[0] and "seed_3" in lines[0]
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_which_runs_are_skipped_rerun_or_left_to_another_process(tmp_path, fake_model, capsys):
    """Finished (same command, exit 0, last step reached) → skipped; the same but made by another command,
    exited 0 before its last step, or killed → rerun; still running in a process of its own → left alone."""
    spec_path = write_spec(tmp_path, _spec(tmp_path, fake_model, seeds=[0, 1, 2], overrides={"steps": 3},
                                           variants={"a": {}, "b": {"optim.lr": 2e-3}}))
    spec = compare.validate_spec(compare.load_spec(str(spec_path)))
    jobs = {(j.variant, j.seed): j for j in spec.jobs}
    full = [{"step": s, "reward/mean": 0.5} for s in range(3)]
    other = list(jobs["a", 1].argv[:-1]) + ["--config.seed=9"]
    cases = {("a", 0): (full, {"returncode": 0}), ("a", 1): (full, {"returncode": 0, "command": other}),
             ("a", 2): (full[:2], {"returncode": 0}), ("b", 0): (full[:1], {"returncode": None, "pid": None})}
    for key, (recs, attempt) in cases.items():
        job = jobs[key]
        _write_run(Path(job.run_dir), recs)
        compare.write_attempts(job.run_dir, [{"command": list(job.argv), "wall_s": 1.0, **attempt}])
    # b seed 1: a live process whose command line is that run's (as an orphaned trainer's would be).
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--config.run_dir={jobs['b', 1].run_dir}"])
    try:
        # Right after spawning, /proc/PID/cmdline is briefly empty (the new image is still being set up).
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{proc.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        Path(jobs["b", 1].run_dir).mkdir(parents=True)
        compare.write_attempts(jobs["b", 1].run_dir, [{"command": list(jobs["b", 1].argv), "returncode": None,
                                                       "pid": proc.pid}])
        status = {key: compare.run_result(j).status for key, j in jobs.items()}
        assert status["a", 0] == "ok" and status["a", 1].startswith("made by another command (3/3 steps)")
        assert status["a", 2] == "exited 0 at 2/3 steps (stopped early)"
        assert status["b", 0] == "interrupted (1/3 steps)" and status["b", 2] == "not run"
        assert status["b", 1] == f"running (pid {proc.pid}, 0/3 steps)"
        assert compare.main([str(spec_path), "--dry-run"]) == 0
    finally:
        proc.kill()
        proc.wait()
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("# finished, skipped: ") and "seed_0" in lines[0]  # a seed 0 (seed-major order)
    assert lines[3].startswith("# running elsewhere, skipped: ") and "b/seed_1" in lines[3]
    assert sum(not line.startswith("#") for line in lines) == 4 and lines[-1].startswith("# 4 of 6 runs to do")
    assert "b seed 1 is still running in another process" in captured.err
    # Once that process is gone, the run is an interrupted one like any other.
    assert compare.run_result(jobs["b", 1]).status == "interrupted (0/3 steps)"


def test_a_spec_whose_override_keys_were_reordered_keeps_its_finished_runs(tmp_path, fake_model):
    """The recorded train command had to match flag for flag: reordering two override keys made a finished run
    "made by another command", rerun by the next invocation and left out of --table-only's statistics."""
    def job(overrides):
        spec = compare.validate_spec(compare.load_spec(str(write_spec(tmp_path, _spec(
            tmp_path, fake_model, seeds=[0], overrides=overrides, variants={"a": {}})))))
        return spec.jobs[0]

    first = job({"steps": 3, "optim.lr": 1e-3})
    _write_run(Path(first.run_dir), [{"step": s, "reward/mean": 0.5} for s in range(3)])
    compare.write_attempts(first.run_dir, [{"command": list(first.argv), "wall_s": 1.0, "returncode": 0,
                                            "config": json.loads(json.dumps(first.config))}])
    reordered = job({"optim.lr": 1e-3, "steps": 3})
    assert reordered.argv != first.argv and compare.run_result(reordered).status == "ok"
    assert compare.run_result(job({"optim.lr": 2e-3, "steps": 3})).status.startswith("made by another command")


def test_a_finished_run_made_from_an_edited_config_file_is_not_counted(tmp_path, fake_model):
    """The command names the config file by path: after an edit the same command is another run, and the paired
    table would have compared arms built from different configs."""
    spec_path = write_spec(tmp_path, _spec(tmp_path, fake_model, seeds=[0], overrides={"steps": 3}))
    spec = compare.validate_spec(compare.load_spec(str(spec_path)))
    job = spec.jobs[0]
    _write_run(Path(job.run_dir), [{"step": s, "reward/mean": 0.5} for s in range(3)])
    attempt = {"command": list(job.argv), "config": job.config, "returncode": 0, "wall_s": 1.0}
    compare.write_attempts(job.run_dir, [attempt])
    assert compare.run_result(job).status == "ok"
    compare.write_attempts(job.run_dir, [{k: v for k, v in attempt.items() if k != "config"}])
    assert compare.run_result(job).status == "ok"  # an attempt recorded before configs were kept: as before
    config = Path(compare.load_spec(str(spec_path)).config)
    config.write_text(config.read_text() + "\n\ndef _edited(c):\n    c.optim.lr = 3e-3\n    return c\n\n\n"
                      "_plain_get_config = get_config\nget_config = lambda: _edited(_plain_get_config())\n")
    edited = compare.validate_spec(compare.load_spec(str(spec_path))).jobs[0]
    assert edited.argv == job.argv
    compare.write_attempts(job.run_dir, [attempt])
    result = compare.run_result(edited)
    assert not result.ok and result.status.startswith("made from another config (3/3 steps; optim.lr: 0.001 → 0.003)")
    # what train lets a resume change (logging, plumbing) is no other config, as in train's resume check
    compare.write_attempts(job.run_dir, [{**attempt, "config": {**edited.config, "log": {"progress": False}}}])
    assert compare.run_result(edited).status == "ok"


def test_a_run_longer_than_the_grid_is_read_up_to_the_grids_last_step(tmp_path, fake_model):
    """`steps` lowered after a run went further (train then only warns and exits 0): the run counted as finished
    and its "final" was its own last step, so arms of different lengths were paired. It is read up to step
    steps − 1, as every other arm."""
    from jaxrl_mismatch.report.summary import CollapseRule, run_stats

    spec_path = write_spec(tmp_path, _spec(tmp_path, fake_model, seeds=[0], overrides={"steps": 3}))
    job = compare.validate_spec(compare.load_spec(str(spec_path))).jobs[0]
    _write_run(Path(job.run_dir), [{"step": -1, "val/accuracy": 0.1}]
               + [{"step": s, "reward/mean": 0.5, "val/accuracy": 0.2 + 0.1 * s} for s in range(5)])
    compare.write_attempts(job.run_dir, [{"command": list(job.argv), "config": {**job.config, "steps": 5},
                                          "returncode": 0, "wall_s": 1.0}])
    result = compare.run_result(job)
    assert result.ok and [r["step"] for r in result.records] == [-1, 0, 1, 2]
    stats = run_stats(result.records, CollapseRule())
    assert stats["val_final"] == pytest.approx(0.4) and stats["val_peak"] == pytest.approx(0.4)


def test_a_trimmed_run_whose_last_validation_is_before_the_grids_last_step_is_not_counted(tmp_path, fake_model):
    """Trimmed to the grid's length, a run validating every 2 steps had its last validation at step 1 of 3 steps: its
    "final" was step 1's while a run made at 3 steps validates at step 2, and the two were paired."""
    spec_path = write_spec(tmp_path, _spec(tmp_path, fake_model, seeds=[0], overrides={"steps": 3}))
    job = compare.validate_spec(compare.load_spec(str(spec_path))).jobs[0]
    _write_run(Path(job.run_dir), [{"step": -1, "val/accuracy": 0.1}]
               + [{"step": s, "reward/mean": 0.5, **({"val/accuracy": 0.2} if s % 2 else {})} for s in range(5)])
    compare.write_attempts(job.run_dir, [{"command": list(job.argv), "config": {**job.config, "steps": 5},
                                          "returncode": 0, "wall_s": 1.0}])
    result = compare.run_result(job)
    assert not result.ok and "validated last at step 1, not 2" in result.status


# -- the numbers: collapse and aggregation on synthetic logs -------------------------------------------
def _records(rewards, **other) -> list[dict]:
    recs = [{"step": s, "reward/mean": r} for s, r in enumerate(rewards)]
    for key, values in other.items():
        for rec, v in zip(recs, values):
            rec[key.replace("__", "/")] = v
    return recs


@pytest.mark.parametrize("rewards, rule, expected", [
    # Peak 0.8 at step 2; below 0.4 from step 4 to the end (4 points >= patience 3).
    ([0.2, 0.4, 0.8, 0.6, 0.3, 0.35, 0.2, 0.1], CollapseRule(frac=0.5, window=1, patience=3), 4),
    # A dip that recovers is no collapse ("stays below until the end").
    ([0.2, 0.8, 0.3, 0.7, 0.6], CollapseRule(frac=0.5, window=1, patience=1), None),
    # Ending on one bad step is no collapse when patience asks for 3.
    ([0.8, 0.8, 0.1], CollapseRule(frac=0.5, window=1, patience=3), None),
    ([0.8, 0.8, 0.1], CollapseRule(frac=0.5, window=1, patience=1), 2),
    # Trailing median over 2 (the mean of 2): [0.8, 0.8, 0.45, 0.1, 0.1] -> below 0.4 from step 3.
    ([0.8, 0.8, 0.1, 0.1, 0.1], CollapseRule(frac=0.5, window=2, patience=2), 3),
    # Trailing median over 3: one bad evaluation is smoothed away — [.3, .3, .3, .3, .3] never falls ...
    ([0.3, 0.3, 0.05, 0.3, 0.3], CollapseRule(frac=0.5, window=3, patience=1), None),
    # ... and a sustained fall is not: medians [.1, .2, .3, .3, .3, .1, .1], peak .3, below .15 from step 5.
    ([0.1, 0.3, 0.35, 0.3, 0.1, 0.1, 0.1], CollapseRule(frac=0.5, window=3, patience=2), 5),
    # A peak <= 0 is never collapsed from.
    ([0.0, 0.0, 0.0], CollapseRule(frac=0.5, window=1, patience=1), None),
    # Below from the first point on cannot happen (the peak is the first point itself).
    ([0.5, 0.1, 0.1], CollapseRule(frac=0.5, window=1, patience=2), 1),
])
def test_collapse_step_follows_its_definition(rewards, rule, expected):
    assert rule.step(_records(rewards)) == expected


def test_collapse_on_validation_accuracy_leaves_out_the_initial_validation():
    """The initial policy (step -1) is not a peak the run reached: a run that starts at 0.6 and trains at
    0.2-0.25 has not collapsed; one that reaches 0.6 in training and falls to 0.2 has."""
    recs = [{"step": -1, "val/accuracy": 0.6}, {"step": 0, "reward/mean": 0.5}, {"step": 9, "val/accuracy": 0.2},
            {"step": 19, "val/accuracy": 0.25}]
    assert CollapseRule(metric="val/accuracy", frac=0.5, window=1, patience=2).step(recs) is None
    recs[0]["step"] = 4
    assert CollapseRule(metric="val/accuracy", frac=0.5, window=1, patience=2).step(recs) == 9


def test_run_stats_over_a_runs_steps():
    n = 30
    length = np.linspace(10, 40, n)
    recs = [{"step": -1, "val/accuracy": 0.3, "val/greedy_accuracy": 0.4}]
    recs += _records([0.5] * n, mismatch__log_ppl_abs_diff=np.linspace(0.01, 0.1, n).tolist(),
                     mismatch__rho_std=[0.2] * n, length__mean=length.tolist(), time__step_s=[2.0] * n,
                     controller__scale=[1.0] * 10 + [0.5] * 10 + [0.25] * 10)
    recs[10]["val/accuracy"] = 0.7
    recs[-1]["val/accuracy"], recs[-1]["val/greedy_accuracy"] = 0.5, 0.45
    recs[5]["mismatch/rho_std"] = "nan"  # runlog writes non-finite values as strings: kept (see test_report_stats)
    s = run_stats(recs, CollapseRule())
    assert (s["val_final"], s["val_peak"], s["greedy_final"], s["greedy_peak"]) == (0.5, 0.7, 0.45, 0.45)
    assert s["log_ppl_abs_diff_mean"] == pytest.approx(0.055) and s["log_ppl_abs_diff_max"] == pytest.approx(0.1)
    assert math.isnan(s["rho_std_mean"])  # a NaN step makes the mean NaN, as the table says
    assert s["length_start"] == pytest.approx(length[:10].mean()) and s["length_end"] == pytest.approx(length[-10:].mean())
    assert s["lr_decays"] == 2 and s["step_time_s"] == pytest.approx(60.0) and s["steps_done"] == n
    assert s["collapse_step"] is None and s["collapsed"] == 0.0


def _write_run(run_dir: Path, records: list[dict]) -> None:
    w = RunWriter(str(run_dir), tensorboard=False)
    for r in records:
        w.write(r["step"], {k: v for k, v in r.items() if k != "step"})
    w.close()


def test_compare_never_writes_into_a_folder_of_the_users(tmp_path, fake_model):
    """A folder holding the user's own table.md is refused (it was overwritten); its content is kept."""
    from jaxrl_mismatch.usage import UsageError

    out = tmp_path / "out"
    out.mkdir()
    (out / "table.md").write_text("mine\n")
    spec_path = write_spec(tmp_path, _spec(tmp_path, fake_model))
    with pytest.raises(UsageError, match=r"out: .*out is a non-empty directory not written by `jaxrl-mismatch "
                                         r"compare` \(holds table.md; table.md is not compare's\)"):
        compare.main([str(spec_path), "--table-only"])
    assert sorted(p.name for p in out.iterdir()) == ["table.md"] and (out / "table.md").read_text() == "mine\n"
    (out / "table.md").unlink()  # an empty folder is taken, and marked as compare's
    assert compare.main([str(spec_path), "--table-only"]) == 0
    assert (out / compare.OUT_MARKER).is_file() and (out / "table.md").read_text() != "mine\n"
    assert compare.main([str(spec_path), "--table-only"]) == 0  # its own output again
    # A table the user has since added notes to is kept aside, not overwritten (it was, silently).
    ours = (out / "table.md").read_text()
    (out / "table.md").write_text(ours + "\nmy notes\n")
    assert compare.main([str(spec_path), "--table-only"]) == 0
    kept = [p for p in out.iterdir() if p.name.startswith("table.md.edited-")]
    assert len(kept) == 1 and kept[0].read_text() == ours + "\nmy notes\n" and (out / "table.md").read_text() == ours
    assert compare.main([str(spec_path), "--table-only"]) == 0  # unchanged since: replaced, nothing more kept
    assert len([p for p in out.iterdir() if p.name.startswith("table.md.edited-")]) == 1


def _legacy_out(tmp_path, fake_model) -> tuple[Path, Path]:
    """A compare output written before OUT carried the marker: compare's runs (compare.json records their
    train commands) and its table and figure."""
    spec_path = write_spec(tmp_path, _spec(tmp_path, fake_model, seeds=[0, 1]))
    spec = compare.validate_spec(compare.load_spec(str(spec_path)))
    for job in spec.jobs:
        _write_run(Path(job.run_dir), _records([0.5] * 2))
        compare.write_attempts(job.run_dir, [{"command": list(job.argv), "returncode": 0, "wall_s": 1.0}])
    assert compare.main([str(spec_path), "--table-only"]) == 0
    out = tmp_path / "out"
    (out / compare.OUT_MARKER).unlink()
    (out / "warmstart.log").write_text(f"\n=== {shlex.join(compare._warmstart_argv('m', '--layers 1'))}\nok\n")
    return spec_path, out


def test_an_unmarked_compare_output_is_resumed(tmp_path, fake_model):
    spec_path, out = _legacy_out(tmp_path, fake_model)
    assert sorted(p.name for p in out.iterdir()) == ["a", "b", "compare.png", "table.json", "table.md", "warmstart.log"]
    assert compare.main([str(spec_path), "--table-only"]) == 0
    assert (out / compare.OUT_MARKER).is_file()


def _user_table(out: Path) -> None:
    (out / "table.md").write_text("my own notes\n")


def _user_file_in_variant(out: Path) -> None:
    (out / "a" / "mydata.txt").write_text("user data\n")


def _user_run(out: Path) -> None:  # a training run of the user's (train's lock, no compare.json) as a seed folder
    (out / "a" / "seed_0" / compare.STATUS_FILE).unlink()
    (out / "a" / "seed_0" / "train.lock").write_text("pid 1 on host\n")


def _run_of_another_folder(out: Path) -> None:  # compare.json of a run made for another run_dir
    attempts = compare.read_attempts(str(out / "b" / "seed_1"))
    compare.write_attempts(str(out / "a" / "seed_1"), attempts)


def _unmarked_figure(out: Path) -> None:
    (out / "compare.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 100)


def _user_table_json(out: Path) -> None:
    (out / "table.json").write_text('{"results": [1, 2]}')


@pytest.mark.parametrize("change, foreign", [
    (_user_table, "table.md"), (_user_file_in_variant, "a/mydata.txt"), (_user_run, "a/seed_0"),
    (_run_of_another_folder, "a/seed_1"), (_unmarked_figure, "compare.png"), (_user_table_json, "table.json"),
])
def test_an_unmarked_folder_is_taken_only_when_all_of_it_is_compares(tmp_path, fake_model, change, foreign):
    """Without the marker, a folder is compare's only where every entry proves it: its runs' compare.json, its
    tables' content, its figure's mark. A variant-named folder or a table.md of the user's was overwritten."""
    spec_path, out = _legacy_out(tmp_path, fake_model)
    change(out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for flags in (["--table-only"], ["--dry-run"], []):
        with pytest.raises(UsageError, match=rf"out: {out} is a non-empty directory not written by `jaxrl-mismatch "
                                             rf"compare` \(holds .*; {foreign} is not compare's\); choose a new"):
            compare.main([str(spec_path), *flags])
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing changed, no marker


def test_the_reviewers_user_folder_is_refused(tmp_path, fake_model):
    """A user's folder with a subfolder named like a variant and its own table.md: was taken, table.md replaced."""
    out = tmp_path / "out"
    (out / "a").mkdir(parents=True)
    (out / "a" / "mydata.txt").write_text("user data\n")
    (out / "table.md").write_text("my own notes\n")
    spec_path = write_spec(tmp_path, _spec(tmp_path, fake_model))
    with pytest.raises(UsageError, match=r"is not compare's\); choose a new or empty directory as `out`"):
        compare.main([str(spec_path), "--table-only"])
    assert sorted(p.name for p in out.iterdir()) == ["a", "table.md"] and (out / "table.md").read_text() == "my own notes\n"


def test_dry_run_refuses_the_out_a_real_run_refuses(tmp_path, fake_model, capsys):
    """`--dry-run` with `out` an existing file printed the commands and exited 0; the real run refused it."""
    user_file = tmp_path / "notes.txt"
    user_file.write_text("mine\n")
    spec_path = write_spec(tmp_path, _spec(tmp_path, fake_model, out=str(user_file)))
    for flags in (["--dry-run"], []):
        with pytest.raises(UsageError, match=rf"^spec {spec_path}: out: {user_file} is a file; give a directory$"):
            compare.main([str(spec_path), *flags])
    assert capsys.readouterr().out == "" and user_file.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "notes.txt", "spec.py", "tiny_config.py"]


def test_table_only_aggregates_over_seeds_and_reports_failed_runs(tmp_path, fake_model, capsys):
    """Variant `a`: seed 0 collapses at step 12, seed 1 does not; variant `b`: seed 0 finished, seed 1 failed
    half-way. The statistics are over finished seeds; the failed run is a line under the table."""
    spec_path = write_spec(tmp_path, {
        "name": "synthetic", "config": str(write_config(tmp_path, fake_model)), "overrides": {"steps": 20},
        "variants": {"a": {}, "b": {"optim.lr": 2e-3}}, "seeds": [0, 1], "out": str(tmp_path / "out"),
        "collapse": {"metric": "reward/mean", "frac": 0.5, "window": 1, "patience": 3}})
    spec = compare.validate_spec(compare.load_spec(str(spec_path)))
    rewards = {("a", 0): [0.2] * 5 + [0.6] * 7 + [0.1] * 8, ("a", 1): [0.2] * 5 + [0.6] * 15,
               ("b", 0): [0.3] * 20, ("b", 1): [0.3] * 10}
    finals = {("a", 0): 0.1, ("a", 1): 0.6, ("b", 0): 0.4, ("b", 1): 0.35}
    for job in spec.jobs:
        key = (job.variant, job.seed)
        recs = _records(rewards[key], mismatch__log_ppl_abs_diff=[0.01 * (1 + job.seed)] * 20)
        recs[-1]["val/accuracy"] = finals[key]
        _write_run(Path(job.run_dir), recs)
        failed = key == ("b", 1)
        compare.write_attempts(job.run_dir, [{"command": list(job.argv), "returncode": 1 if failed else 0,
                                              "wall_s": 10.0 + job.seed}])
        if failed:
            Path(job.run_dir, compare.LOG_FILE).write_text("train: step 9\nerror: train: RuntimeError: boom\n")

    assert compare.main([str(spec_path), "--table-only"]) == 0
    table = json.loads((tmp_path / "out" / "table.json").read_text())
    a, b = table["variants"]["a"], table["variants"]["b"]
    assert (a["ok"], a["total"], a["collapsed"]) == (2, 2, 1)
    assert a["summary"]["collapse_step"] == {"mean": 12.0, "std": None, "n": 1}  # over the seed that collapsed
    assert a["summary"]["val_final"]["mean"] == pytest.approx(0.35)
    assert a["summary"]["val_final"]["std"] == pytest.approx(np.std([0.1, 0.6], ddof=1))
    assert a["summary"]["log_ppl_abs_diff_mean"]["mean"] == pytest.approx(0.015)
    assert a["summary"]["wall_s"]["mean"] == pytest.approx(10.5)
    assert (b["ok"], b["total"], b["collapsed"]) == (1, 2, 0)
    assert b["summary"]["val_final"] == {"mean": 0.4, "std": None, "n": 1}  # the failed seed is not in it
    failed = b["runs"][1]
    assert not failed["ok"] and failed["status"].startswith("failed (exit 1, 10/20 steps): error: train: RuntimeError")
    md = (tmp_path / "out" / "table.md").read_text()
    main_table = md.split("\n\n")[0]
    rows = {line.split(" | ")[0].strip("| "): line
            for line in main_table.splitlines() if line.startswith(("| a", "| b"))}
    assert "| 2/2 | 1/2 |" in rows["a"] and "0.350 ± 0.354" in rows["a"] and "| 12 |" in rows["a"]
    assert "| 1/2 | 0/1 |" in rows["b"] and "| – |" in rows["b"]
    assert "- b seed 1: failed (exit 1" in md
    # Paired against the first variant (the default baseline), over the seeds both finished: seed 0 only.
    assert table["baseline"] == "a" and list(table["paired"]) == ["b"]
    assert table["paired"]["b"]["val_final"]["per_seed"] == {"0": pytest.approx(0.3)}
    assert "| variant vs a | paired seeds |" in md and "| b | 1 | +0.300, 1/1 |" in md
    assert (tmp_path / "out" / "compare.png").stat().st_size > 10_000
    assert md in capsys.readouterr().out


def test_table_only_skips_lines_that_are_not_step_records_as_report_does(tmp_path, fake_model, capsys):
    """A line without an integer step (none, null, 1.5, 400 digits) is skipped with report's one warning line,
    once per file: it was `error: compare: KeyError: 'step'` (exit 1), or {"step": 1.5} became step 1 — and,
    written last, the "val acc final"."""
    spec_path = write_spec(tmp_path, {
        "config": str(write_config(tmp_path, fake_model)), "overrides": {"steps": 4}, "variants": {"a": {}},
        "seeds": [0], "out": str(tmp_path / "out")})
    spec = compare.validate_spec(compare.load_spec(str(spec_path)))
    (job,) = spec.jobs
    recs = _records([0.5] * 4)
    recs[-1]["val/accuracy"] = 0.3
    _write_run(Path(job.run_dir), recs)
    with open(Path(job.run_dir, "metrics.jsonl"), "a") as f:
        f.write('{"reward/mean": 0.5}\n{"step": null}\n{"step": 1.5, "val/accuracy": 0.99}\n')
        f.write('{"step": ' + "9" * 400 + ', "val/accuracy": 0.98}\n')
    compare.write_attempts(job.run_dir, [{"command": list(job.argv), "returncode": 0, "wall_s": 1.0}])
    assert compare.main([str(spec_path), "--table-only"]) == 0
    err = capsys.readouterr().err
    metrics = os.path.join(job.run_dir, "metrics.jsonl")
    assert err == f"warning: {metrics}: skipped 4 line(s) that are not step records (lines 5, 6, 7, 8)\n"
    v = json.loads((tmp_path / "out" / "table.json").read_text())["variants"]["a"]
    assert v["runs"][0]["status"] == "ok" and v["summary"]["val_final"]["mean"] == 0.3


def test_summarize_leaves_out_runs_that_did_not_finish():
    recs = _records([0.5] * 4)
    recs[-1]["val/accuracy"] = 0.5
    runs = [RunResult(seed=0, run_dir="x", status="ok", ok=True, records=recs),
            RunResult(seed=1, run_dir="y", status="interrupted (2/4 steps)", ok=False, records=recs[:2]),
            RunResult(seed=2, run_dir="z", status="not run", ok=False, records=[])]
    v = summarize({"v": runs}, CollapseRule())["v"]
    assert (v["ok"], v["total"]) == (1, 3)
    assert v["summary"]["val_final"] == {"mean": 0.5, "std": None, "n": 1}
    assert v["runs"][2]["stats"] == {"wall_s": None}


# -- end to end: a real grid of train subprocesses -------------------------------------------------------
@pytest.fixture(scope="module")
def base_model(tiny_base_model) -> Path:
    return tiny_base_model


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


@pytest.mark.slow
def test_grid_runs_end_to_end_resumes_and_reports_a_failed_run(base_model, tmp_path, monkeypatch, capsys):
    # The trainers are single-process CPU jobs: the test session's 8 fake devices must not reach them.
    monkeypatch.setenv("XLA_FLAGS", child_env().get("XLA_FLAGS", ""))
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # passes the path check; the trainer fails loading it
    out = tmp_path / "out"
    spec_path = write_spec(tmp_path, {
        "name": "e2e", "config": str(write_config(tmp_path, base_model)), "overrides": {"steps": 2},
        "variants": {"constant": {}, "cosine": {"optim.schedule": "cosine", "optim.schedule_kwargs.decay_steps": 4},
                     "broken": {"model.path": str(broken)}},
        "seeds": [0], "out": str(out)})
    assert compare.main([str(spec_path), "--jobs", "2"]) == 1  # one run failed; the grid went on
    table = json.loads((out / "table.json").read_text())["variants"]
    for name in ("constant", "cosine"):
        v = table[name]
        assert (v["ok"], v["total"]) == (1, 1), v["runs"]
        for key in ("log_ppl_abs_diff_mean", "log_ppl_abs_diff_max", "rho_std_mean", "val_final", "val_peak",
                    "length_start", "length_end", "step_time_s", "wall_s"):
            assert _finite(v["summary"][key]["mean"]), (name, key, v["summary"][key])
        assert [r["step"] for r in read_jsonl(str(out / name / "seed_0" / "metrics.jsonl"))] == [-1, 0, 1]
    assert table["broken"]["ok"] == 0 and table["broken"]["runs"][0]["status"].startswith("failed (exit ")
    lr = {name: [r["lr"] for r in read_jsonl(str(out / name / "seed_0" / "metrics.jsonl"))] for name in ("constant", "cosine")}
    assert lr["constant"][-1] == pytest.approx(1e-3) and lr["cosine"][-1] < 1e-3  # the variant reached its run
    assert (out / "compare.png").stat().st_size > 10_000
    md = (out / "table.md").read_text()
    assert "| constant | 1/1 |" in md and "| cosine | 1/1 |" in md and "| broken | 0/1 |" in md

    # Resumable: finished runs are skipped; the failed one is retried; an interrupted one is rerun with the
    # same command and resumes from its checkpoint (train reports "finished steps 2 → 2": nothing redone).
    capsys.readouterr()
    attempts = compare.read_attempts(str(out / "cosine" / "seed_0"))
    attempts[-1]["returncode"] = None  # as if the harness had been killed before the run ended
    compare.write_attempts(str(out / "cosine" / "seed_0"), attempts)
    assert compare.main([str(spec_path), "--jobs", "2"]) == 1
    printed = capsys.readouterr().out
    assert "1 of 3 runs already finished; skipping them" in printed
    assert len(compare.read_attempts(str(out / "constant" / "seed_0"))) == 1
    assert len(compare.read_attempts(str(out / "broken" / "seed_0"))) == 2
    cosine = compare.read_attempts(str(out / "cosine" / "seed_0"))
    assert len(cosine) == 2 and cosine[1]["command"] == cosine[0]["command"] and cosine[1]["returncode"] == 0
    log = (out / "cosine" / "seed_0" / compare.LOG_FILE).read_text()
    assert log.count("=== attempt") == 2 and "train: finished steps 2 → 2" in log
    assert [r["step"] for r in read_jsonl(str(out / "cosine" / "seed_0" / "metrics.jsonl"))] == [-1, 0, 1]


@pytest.mark.parametrize("name", compare.OUTPUT_FILES)
@pytest.mark.parametrize("kind", ["link", "folder"])
def test_a_link_or_folder_at_an_output_file_of_a_marked_folder_is_refused(tmp_path, fake_model, name, kind):
    """In compare's own (marked) folder, a symbolic link at table.md was replaced by the rename into place: the
    user's link deleted, its target left as it was. A link or a folder there is refused; nothing changes."""
    spec_path = write_spec(tmp_path, _spec(tmp_path, fake_model))
    assert compare.main([str(spec_path), "--table-only"]) == 0
    out = tmp_path / "out"
    target = tmp_path / "mine.txt"
    target.write_text("mine\n")
    (out / name).unlink(missing_ok=True)
    if kind == "link":
        (out / name).symlink_to(target)
    else:
        (out / name).mkdir()
    before = sorted((p.name, p.is_symlink()) for p in out.iterdir())
    for flags in (["--table-only"], ["--dry-run"]):
        with pytest.raises(UsageError, match=rf"out: {out / name} is "
                                             rf"{'a symbolic link' if kind == 'link' else 'not a file'}; compare "
                                             rf"replaces it with its own {name}: move it out of the way"):
            compare.main([str(spec_path), *flags])
    assert sorted((p.name, p.is_symlink()) for p in out.iterdir()) == before and target.read_text() == "mine\n"


def test_the_figure_leaves_out_failed_and_stopped_runs_as_the_table_does(tmp_path, fake_model, monkeypatch):
    """A failed seed (reward 0, stopped at step 5) averaged into the figure's mean line halved it, then the line
    jumped where the run ended: a training effect the table (finished runs only) does not show."""
    from jaxrl_mismatch.report import plot

    spec = compare.validate_spec(compare.load_spec(str(write_spec(tmp_path, _spec(
        tmp_path, fake_model, seeds=[0, 1, 2], overrides={"steps": 10}, variants={"a": {}})))))
    jobs = {j.seed: j for j in spec.jobs}
    for seed, steps, returncode in ((0, 10, 0), (1, 5, 1), (2, 10, 0)):
        _write_run(Path(jobs[seed].run_dir), [{"step": s, "reward/mean": 0.0 if seed == 1 else 0.5}
                                              for s in range(steps)])
        compare.write_attempts(jobs[seed].run_dir, [{"command": list(jobs[seed].argv), "config": jobs[seed].config,
                                                     "returncode": returncode, "wall_s": 1.0}])
    drawn = {}
    monkeypatch.setattr(plot, "plot_overlay", lambda groups, path, **kw: drawn.update(groups))
    compare.write_outputs(spec)
    assert [len(r) for r in drawn["a"]] == [10, 10]  # seeds 0 and 2; not the failed seed 1
    assert all(rec["reward/mean"] == 0.5 for run in drawn["a"] for rec in run)
