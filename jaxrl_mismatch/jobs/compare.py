"""`jaxrl-mismatch compare SPEC`: run a grid of config variants × seeds as train processes; table + overlay figure.

Usage: `jaxrl-mismatch compare SPEC[:ARG] [--jobs N] [--dry-run] [--table-only]`. Each run of the grid is a real
`jaxrl-mismatch train` process; then a table (Markdown + JSON) and an overlay figure summarise the grid.

Why subprocesses of the train command rather than `Trainer` objects in one process: every override goes
through the train command line, so everything `train` validates is validated the same way; each run has
its own rollout server, its own JAX runtime and its own log; a run that crashes is one failed row of
the table, not the end of the grid; and the command in a run's log reproduces that run alone.

The spec file is a Python file whose `get_spec()` returns a dict (`FILE:ARG` calls `get_spec(ARG)`, as
`train --config FILE:ARG` does for configs: one file can hold several grids, e.g. one per mismatch source):

    def get_spec():
        return {
            "name": "schedulers",                    # optional; default: the spec file's name (_ARG)
            "config": "configs/arith_length_cpu.py", # required: the train config (FILE or FILE:ARG)
            "overrides": {"steps": 150,              # optional: dotted config fields set in every variant
                          "rollout.logit_noise_std": 2.0},
            "variants": {                            # required, non-empty: name -> dotted overrides
                "constant": {},
                "cosine": {"optim.schedule": "cosine", "optim.schedule_kwargs.decay_steps": 600},
            },
            "seeds": [0, 1, 2],                      # required: distinct integers >= 0 (config.seed)
            "baseline": "constant",                  # optional: the variant the others are paired against
                                                     # (default: the first variant)
            "controls": {"cosine": "constant"},      # optional: variant -> the variant that could explain its
                                                     # result, paired seed by seed in a second table
            "out": "runs/compare/schedulers",        # optional; default runs/compare/NAME
            "metrics": ["reward/mean", "val/accuracy",          # optional: the figure's panels, each a
                        {"metric": ["grad/norm_clipped_per_token", "grad/norm"],  # metric name or a dict
                         "title": "grad norm / token", "scale": "log"}],       # (default: report.PANELS)
            "collapse": {"metric": "reward/mean", "frac": 0.5,  # optional: the collapse rule (trailing
                         "window": 10, "patience": 10},         # median; report.summary.CollapseRule)
        }

Relative paths (config, out, and the paths inside the config) are relative to the current directory,
as for `train`. A variant name is a directory name (letters, digits, `_.-`). Override values are Python
values; each becomes the flag `--config.FIELD=TEXT` and must read back as the same value. `run_dir` and
`seed` are the harness's (`OUT/VARIANT/seed_N`, N); `log.progress` defaults to false (a progress bar in a
log file is noise). Precedence: config file < `overrides` < the variant < run_dir/seed.

The run of VARIANT with seed N:

    python -m jaxrl_mismatch.cli train --config CONFIG --config.FIELD=VALUE ... \\
        --config.run_dir=OUT/VARIANT/seed_N --config.seed=N

logs its stdout and stderr to `OUT/VARIANT/seed_N/compare.log`, and `compare.json` next to it records
each attempt (command, exit code, wall time). A run is finished — and skipped by the next invocation —
when its last attempt ran the same command, exited 0, and its metrics.jsonl reached the configured last
step; any other run is (re)started with the same command, and `train` resumes it from its checkpoint.
Ctrl-C stops the running trainers gracefully (SIGTERM: they checkpoint the current step), so the same
command continues the grid. The whole spec is validated before anything runs: every variant's config is
loaded with its overrides and checked by `train.config_checks.validate` and `check_paths`; a bad field is one
line naming it (`spec S: variants.cosine: config.optim.schedul: unknown field (did you mean ...)`).

Parallel runs: `--jobs N` trainers at a time (default `default_jobs()`: one per core); with more than one,
each run is pinned to its own share of the cores (`taskset`, inherited by its rollout server) so that the
XLA thread pools of parallel runs stay within a budget. docs/experiments.md has the measurements.

Outputs (also from `--table-only`, which runs nothing): `OUT/table.md`, `OUT/table.json` (per variant:
mean ± sample std over finished seeds of initial/final/peak validation accuracy, final/peak, steps to
collapse, mismatch, lengths, LR decays, times — definitions in `report/summary.py`; then each variant
paired seed by seed against the baseline: wins k/n, mean difference and its 95 % t interval, the per-seed
differences in the JSON — `report/paired.py`) and `OUT/compare.png` (`report.plot.plot_overlay`: one panel
per metric, one line per variant = mean over seeds, min–max band). Both are written to a temporary
sibling and renamed into place.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import numbers
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Mapping, Sequence

from jaxrl_mismatch.outputs import file_fingerprint, staged_file
from jaxrl_mismatch.report.summary import CollapseRule, RunResult, summarize, write_table
from jaxrl_mismatch.runlog import METRICS_FILE, read_jsonl_checked, warn_skipped
from jaxrl_mismatch.train.config_resume import config_changes
from jaxrl_mismatch.train.runlock import HARNESS_LOG_FILE, HARNESS_STATUS_FILE
from jaxrl_mismatch.usage import (EXIT_STOPPED, SEED_LIMIT, ArgumentParser, UsageError, call_file_function,
                                  listing, path_kind)

PROG = "jaxrl-mismatch compare"
SPEC_FIELDS = ("name", "config", "overrides", "variants", "seeds", "baseline", "controls", "out", "metrics",
               "collapse")
HARNESS_FIELDS = ("run_dir", "seed")  # set per run by the harness; a spec may not set them
HARNESS_DEFAULTS = {"log.progress": False}  # a spec may override these
LOG_FILE, STATUS_FILE = HARNESS_LOG_FILE, HARNESS_STATUS_FILE  # in each run directory (train accepts them)
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """One run of the grid: its command and where it writes."""

    variant: str
    seed: int
    run_dir: str
    argv: tuple[str, ...]
    steps: int  # config.steps of this run: finished when metrics.jsonl reaches step steps - 1
    # The whole config the command resolves to (`to_dict`): the command names the config file by path, so an
    # edited file (or a module it reads) gives the same command and another run.
    config: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def label(self) -> str:
        return f"{self.variant} seed {self.seed}"


@dataclasses.dataclass(kw_only=True)
class Spec:
    path: str
    name: str
    config: str
    overrides: dict[str, Any]
    variants: dict[str, dict[str, Any]]
    seeds: list[int]
    out: str
    panels: tuple | None
    collapse: CollapseRule
    baseline: str
    controls: dict[str, str] = dataclasses.field(default_factory=dict)  # variant -> its control variant
    jobs: list[Job] = dataclasses.field(default_factory=list)  # filled by `validate_spec`
    warmstarts: dict[str, str] = dataclasses.field(default_factory=dict)  # model.path -> warmstart args


# -- the spec ---------------------------------------------------------------------------------------
def _error(path: str, field: str, message: str) -> UsageError:
    return UsageError(f"spec {path}: {field}: {message}")


def _flag_text(value: Any) -> str:
    """The command-line text of an override value (`train.config_overrides.load_config` parses it back)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))  # numpy scalars too (their repr is not a number in numpy 2)
    return repr(value)


def _overrides(path: str, field: str, d: Any) -> dict[str, Any]:
    if d is None:
        return {}
    if not isinstance(d, Mapping):
        raise _error(path, field, f"must be a dict of dotted config fields to values, got {d!r}")
    for key in d:
        if not isinstance(key, str) or not key:
            raise _error(path, field, f"keys must be dotted config field names, got {key!r}")
        if key in HARNESS_FIELDS:
            raise _error(path, f"{field}.{key}", "is set by the harness for each run (OUT/VARIANT/seed_N, N)")
    return dict(d)


def split_lr(arg: str, default: float) -> tuple[str, float | None]:
    """A spec argument `GRID[@LR]` -> (GRID, LR), LR None when not given: the experiments' way to rerun a grid at
    another learning rate (`compare experiments/e3_precision.py:ppo@1e-4`). A bad LR is a ValueError naming it."""
    grid, at, lr_text = arg.partition("@")
    if not at:
        return grid, default
    try:
        lr = float(lr_text)
    except ValueError:
        raise ValueError(f"grid {grid}@{lr_text}: the LR after '@' is not a number") from None
    if not lr > 0:
        raise ValueError(f"grid {grid}@{lr_text}: the LR must be > 0")
    return grid, lr


def load_spec(path: str) -> Spec:
    """The spec of the Python file `path` (its `get_spec()`; `FILE:ARG` calls `get_spec(ARG)`), checked field
    by field (not yet against the config: `validate_spec`). UsageError naming the field otherwise."""
    file, _, arg = path.partition(":")
    d = call_file_function(file, "get_spec", f"spec {path}", *([arg] if arg else []))
    if not isinstance(d, Mapping):
        raise UsageError(f"spec {path}: get_spec() returned {type(d).__name__}, not a dict")
    for key in d:
        if key not in SPEC_FIELDS:
            near = difflib.get_close_matches(str(key), SPEC_FIELDS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; valid: {', '.join(SPEC_FIELDS)}"
            raise _error(path, str(key), f"unknown field{hint}")
    name = d.get("name", os.path.splitext(os.path.basename(file))[0] + (f"_{arg}" if arg else ""))
    if not isinstance(name, str) or not name.strip():
        raise _error(path, "name", f"must be a non-empty string, got {name!r}")
    if "out" not in d and (not _NAME.match(name) or name in (".", "..")):  # the default out is runs/compare/NAME
        raise _error(path, "name", f"{name!r} is not a directory name (letters, digits, _ . -); it names the "
                                   "default out, runs/compare/NAME")
    config = d.get("config")
    if not isinstance(config, str) or not config:
        raise _error(path, "config", "missing: the train config file every variant starts from, e.g. "
                                     "'configs/arith_length_cpu.py'")
    variants = d.get("variants")
    if not isinstance(variants, Mapping) or not variants:
        raise _error(path, "variants", f"must be a non-empty dict of name -> overrides, got {variants!r}")
    for v in variants:
        if not isinstance(v, str) or not _NAME.match(v) or v in (".", ".."):
            raise _error(path, "variants", f"name {v!r} is not a directory name (letters, digits, _ . -)")
        if v in (*OUTPUT_FILES, "warmstart.log") or v.startswith("."):  # its runs' folder would take the name
            raise _error(path, "variants", f"name {v!r} is one of the names compare writes in `out` (table.md, "
                                           "table.json, compare.png, warmstart.log, hidden files); rename it")
    seeds = d.get("seeds")
    if (not isinstance(seeds, (list, tuple)) or not seeds or len(set(seeds)) != len(seeds)
            or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < SEED_LIMIT for s in seeds)):
        raise _error(path, "seeds", f"must be a non-empty list of distinct integers in [0, 2^31) (config.seed), "
                                    f"got {seeds!r}")
    baseline = d.get("baseline", next(iter(variants)))
    if not isinstance(baseline, str) or baseline not in variants:
        raise _error(path, "baseline", f"{baseline!r} is not a variant; variants: {', '.join(map(str, variants))}")
    controls = d.get("controls", {})
    if not isinstance(controls, dict):
        raise _error(path, "controls", f"must be a dict variant -> control variant, got {controls!r}")
    for v, c in controls.items():
        if not isinstance(v, str) or not isinstance(c, str):  # a list is unhashable: `in variants` would raise
            raise _error(path, f"controls.{v}", f"{v!r} -> {c!r} must pair two variant names (strings); "
                         f"variants: {', '.join(map(str, variants))}")
        if v not in variants or c not in variants or v == c:
            raise _error(path, f"controls.{v}", f"{v!r} -> {c!r} must pair two different variants; variants: "
                         f"{', '.join(map(str, variants))}")
    out = d.get("out", os.path.join("runs", "compare", name))
    if not isinstance(out, str) or not out:
        raise _error(path, "out", f"must be a directory path, got {out!r}")
    panels = None
    if "metrics" in d:
        from jaxrl_mismatch.report.plot import panels_from_spec

        try:
            panels = panels_from_spec(d["metrics"])
        except UsageError as e:
            raise UsageError(f"spec {path}: {e}") from None
    try:
        collapse = CollapseRule.from_spec(d.get("collapse"))
    except (UsageError, TypeError) as e:
        raise UsageError(f"spec {path}: {e}") from None
    return Spec(path=path, name=name, config=config, overrides=_overrides(path, "overrides", d.get("overrides")),
                variants={v: _overrides(path, f"variants.{v}", o) for v, o in variants.items()},
                seeds=list(seeds), out=out, panels=panels, collapse=collapse, baseline=baseline,
                controls=dict(controls))


def _plain(v: Any) -> Any:
    if hasattr(v, "to_dict"):
        return v.to_dict()
    return list(v) if isinstance(v, tuple) else v


def _variant_config(spec: Spec, variant: str):
    """The variant's config with the harness defaults, the spec's and the variant's overrides applied
    through the same parser `train` uses, validated; UsageError naming the spec field at fault."""
    from jaxrl_mismatch.jobs._inputs import check_warmstart_args
    from jaxrl_mismatch.train.config_checks import check_paths, check_task_files, validate
    from jaxrl_mismatch.train.config_overrides import apply_override, load_config

    try:
        c = load_config(spec.config)
    except UsageError as e:
        raise _error(spec.path, "config", str(e).removeprefix("--config ")) from None
    layers = (("", HARNESS_DEFAULTS), ("overrides", spec.overrides), (f"variants.{variant}", spec.variants[variant]))
    for field, overrides in layers:
        for key, value in overrides.items():
            try:
                apply_override(c, key, _flag_text(value))
            except UsageError as e:
                raise _error(spec.path, field or "(harness default)", str(e)) from None
            node = c
            for part in key.split("."):
                node = node[part]
            if _plain(node) != _plain(value):
                raise _error(spec.path, f"{field}.{key}", f"{value!r} would reach the run as {_plain(node)!r} "
                                                          f"(the flag --config.{key}={_flag_text(value)})")
    try:
        validate(c)
        check_paths(c)
        check_task_files(c)
        check_warmstart_args(c)
    except UsageError as e:
        raise _error(spec.path, f"variants.{variant}", str(e)) from None
    return c


def _as_json(d: dict) -> dict:
    """`d` as `compare.json` gives it back (tuples as lists), so a config read back compares equal to itself."""
    return json.loads(json.dumps(d, default=repr))


def validate_spec(spec: Spec) -> Spec:
    """Check every variant's config (before anything runs) and fill `spec.jobs` and `spec.warmstarts`."""
    spec.jobs = []
    configs = {v: _variant_config(spec, v) for v in spec.variants}
    lengths = {v: int(c.steps) for v, c in configs.items()}
    for variant, steps in lengths.items():  # the paired tables compare final values: runs of one length
        if steps != lengths[spec.baseline]:
            raise _error(spec.path, f"variants.{variant}", f"runs {steps} steps, the baseline {spec.baseline!r} "
                                                           f"{lengths[spec.baseline]}: every variant of a grid runs "
                                                           "the same steps (set `steps` in the spec's overrides)")
    for seed in spec.seeds:  # seed-major: a partial grid covers every variant early
        for variant, c in configs.items():
            run_dir = os.path.join(spec.out, variant, f"seed_{seed}")
            flags = {**HARNESS_DEFAULTS, **spec.overrides, **spec.variants[variant], "run_dir": run_dir, "seed": seed}
            argv = (sys.executable, "-m", "jaxrl_mismatch.cli", "train", "--config", spec.config,
                    *(f"--config.{k}={_flag_text(v)}" for k, v in flags.items()))
            spec.jobs.append(Job(variant=variant, seed=seed, run_dir=run_dir, argv=argv, steps=int(c.steps),
                                 config=_as_json({**c.to_dict(), "run_dir": run_dir, "seed": seed})))
    for variant, c in configs.items():
        if c.model.warmstart_if_missing and not os.path.isfile(os.path.join(c.model.path, "config.json")):
            _check_warmstart_outside(spec, variant, c.model.path)
            spec.warmstarts.setdefault(c.model.path, c.model.warmstart_args)
    return spec


def _check_warmstart_outside(spec: Spec, variant: str, model: str) -> None:
    """A base model the grid warm-starts is written outside `out`: at `out` or in it (a run folder, say) the warm
    start refused the folder compare had just made, or train refused the run folder it had filled (exit 1, a mixed
    folder left); around `out`, the warm start refused a folder holding the grid."""
    m, o = os.path.realpath(model), os.path.realpath(spec.out)
    where = ("is" if m == o else "is inside" if os.path.commonpath([m, o]) == o
             else "holds" if os.path.commonpath([m, o]) == m else None)
    if where is not None:
        raise _error(spec.path, f"variants.{variant}", f"model.path {model} {where} the grid's out {spec.out}, and "
                     "the warm start would write the base model there: give it a path outside `out`")


# -- the state of a run on disk ------------------------------------------------------------------------
def _same_command(recorded: list, argv: list) -> bool:
    """Whether a run's recorded train command is this job's: the interpreter's path may differ, and the
    `--config.*` flags may come in another order (a spec whose override keys were reordered: its finished runs read
    as another command's and ran again); the resolved configs are compared next (`config_changes`)."""
    split = lambda a: (a[1:6], sorted(a[6:]))  # noqa: E731 - (-m jaxrl_mismatch.cli train --config C), the flags
    return len(recorded) == len(argv) and split(recorded) == split(argv)
def read_attempts(run_dir: str) -> list[dict]:
    """The attempts recorded in `run_dir/compare.json` (command, started, returncode, wall_s), oldest first."""
    path = os.path.join(run_dir, STATUS_FILE)
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            return list(json.load(f).get("attempts", []))
    except (OSError, ValueError, AttributeError):
        return []  # a status file torn by a crash: the run is simply not known to be finished


def _log_tail(job: Job) -> str:
    path = os.path.join(job.run_dir, LOG_FILE)
    if not os.path.isfile(path):
        return ""
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f.read()[-4000:].splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    text = (errors or lines or [""])[-1]
    return text if len(text) <= 160 else text[:157] + "..."


def _alive(pid: Any, job: Job) -> bool:
    """Whether `pid` is still this run's trainer (a harness killed outright leaves its trainers running:
    their own sessions keep them from the terminal's signals). Linux /proc; False where it cannot tell."""
    if not isinstance(pid, int):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    return f"--config.run_dir={job.run_dir}".encode() in args


_warned: set[tuple[str, tuple[int, ...]]] = set()  # (metrics file, skipped lines) already warned about


def _read_records(metrics: str) -> list[dict]:
    """The step records of a run's metrics.jsonl, read as `report` reads them (`runlog.read_jsonl_checked`):
    a line that is not a JSON object with an integer step is skipped, with `report`'s one warning line —
    once per file and set of lines, though the table is made from the runs more than once."""
    if not os.path.isfile(metrics):
        return []
    try:
        records, skipped = read_jsonl_checked(metrics)
    except OSError as e:
        raise UsageError(f"{metrics}: cannot read it ({e.strerror})") from None
    if skipped and (metrics, tuple(skipped)) not in _warned:
        _warned.add((metrics, tuple(skipped)))
        warn_skipped(metrics, skipped)
    return records


def run_result(job: Job) -> RunResult:
    """What the table knows about a run: finished (`ok`), failed, interrupted, stale or not run."""
    records = _read_records(os.path.join(job.run_dir, METRICS_FILE))
    done = max((r["step"] for r in records), default=-1) + 1
    trimmed_final = None  # a longer run's last validation within the grid's length, when it is not its last step
    if done > job.steps:  # made longer before `steps` was lowered: its statistics are taken at the grid's length,
        records = [r for r in records if r["step"] < job.steps]  # so "final" is step steps − 1 in every arm
        done = job.steps
        validated = [r["step"] for r in records if "val/accuracy" in r and r["step"] >= 0]
        if validated and max(validated) != job.steps - 1:  # (a run validates at its own last step, not at this)
            trimmed_final = max(validated)
    attempts = read_attempts(job.run_dir)
    walls = [a["wall_s"] for a in attempts if isinstance(a.get("wall_s"), (int, float))]
    last = attempts[-1] if attempts else None
    if last is None:
        status = "not run" if not records else f"not run by compare ({done}/{job.steps} steps)"
    elif not _same_command(list(last.get("command", [])), list(job.argv)):
        status = f"made by another command ({done}/{job.steps} steps); rerun compare"
    elif isinstance(last.get("config"), dict) and (changes := config_changes(last["config"], job.config)):
        # train's own resume rule (fields that change only length, logging or plumbing do not count); attempts
        # recorded before the config was kept have none
        more = f" and {len(changes) - 1} more" if len(changes) > 1 else ""
        status = (f"made from another config ({done}/{job.steps} steps; {changes[0]}{more}): the config file or "
                  "what it reads changed since; train refuses to resume it, a new `out` in the spec starts afresh")
    elif last.get("returncode") is None:
        alive = _alive(last.get("pid"), job)
        status = f"{'running (pid ' + str(last['pid']) + ', ' if alive else 'interrupted ('}{done}/{job.steps} steps)"
    elif last["returncode"] == EXIT_STOPPED:
        status = f"stopped by SIGTERM ({done}/{job.steps} steps); rerun to resume"
    elif last["returncode"] != 0:
        status = f"failed (exit {last['returncode']}, {done}/{job.steps} steps): {_log_tail(job)}"
    elif done < job.steps:
        status = f"exited 0 at {done}/{job.steps} steps (stopped early)"
    elif trimmed_final is not None:
        status = (f"ran past the grid's {job.steps} steps (`steps` was lowered since) and validated last at step "
                  f"{trimmed_final}, not {job.steps - 1}: its final value would not pair with the other arms'; a new "
                  "`out` in the spec reruns it")
    else:
        status = "ok"
    return RunResult(seed=job.seed, run_dir=job.run_dir, status=status, ok=status == "ok", records=records,
                     wall_s=sum(walls) if walls else None)


def write_attempts(run_dir: str, attempts: list[dict]) -> None:
    """Replace `run_dir/compare.json` atomically (a crash leaves the old or the new file, never half)."""
    with staged_file(os.path.join(run_dir, STATUS_FILE)) as tmp, open(tmp, "w") as f:
        json.dump({"attempts": attempts}, f, indent=1)


# -- running -------------------------------------------------------------------------------------------
def default_jobs() -> int:
    """Parallel trainers by default: one per core. A run is a trainer and a rollout server taking turns
    (rollout, then update) plus single-threaded start-up, so alone it keeps about one core busy (measured
    on the 2-core development machine: 91 s CPU in 87 s wall for two runs in a row); two parallel runs
    used the same CPU time and finished 1.4-2.2x sooner than two in a row (docs/experiments.md). On a
    machine with accelerators, pass `--jobs` with how many runs the devices hold."""
    return max(1, len(os.sched_getaffinity(0)))


def _core_shares(n: int) -> list[list[int]]:
    """The cores of this process split into `n` disjoint shares (one per parallel run), or shared by all
    when there are fewer cores than runs."""
    cores = sorted(os.sched_getaffinity(0))
    if n <= 1 or len(cores) < n:
        return [cores] * max(n, 1)
    return [cores[i::n] for i in range(n)]


class _Running:
    def __init__(self, job: Job, share: list[int], parallel: bool) -> None:
        self.job, self.share = job, share
        os.makedirs(job.run_dir, exist_ok=True)
        self.attempts = read_attempts(job.run_dir)
        self.attempts.append({"command": list(job.argv), "config": job.config, "started": time.time(),
                              "returncode": None, "wall_s": None})
        write_attempts(job.run_dir, self.attempts)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        argv = list(job.argv)
        if parallel and shutil.which("taskset"):
            argv = ["taskset", "-c", ",".join(map(str, share)), *argv]
        self.log = open(os.path.join(job.run_dir, LOG_FILE), "a")
        self.log.write(f"\n=== attempt {len(self.attempts)} ({time.strftime('%Y-%m-%d %H:%M:%S')}): "
                       f"{shlex.join(argv)}\n")
        self.log.flush()
        self.t0 = time.monotonic()
        # Own session: Ctrl-C reaches only the harness, which then stops each trainer gracefully (SIGTERM).
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.attempts[-1]["pid"] = self.proc.pid
        write_attempts(job.run_dir, self.attempts)

    def finish(self, returncode: int | None) -> float:
        wall = time.monotonic() - self.t0
        self.attempts[-1].update(returncode=returncode, wall_s=wall)
        write_attempts(self.job.run_dir, self.attempts)
        self.log.close()
        return wall


def _stop(running: Sequence[_Running], grace_s: float = 120.0) -> None:
    """SIGTERM every trainer (each finishes its step, checkpoints, exits), SIGKILL what outlives `grace_s`."""
    for r in running:
        if r.proc.poll() is None:
            os.killpg(r.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for r in running:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait()
        r.finish(r.proc.returncode)  # a stopped run has not reached its last step: the next invocation resumes it


def run_jobs(jobs: Sequence[Job], parallel: int) -> None:
    """Run `jobs`, `parallel` at a time, each pinned to its own share of the cores when parallel > 1."""
    shares = _core_shares(parallel)
    free = list(range(parallel))
    pending, running = list(jobs), {}
    total = len(jobs)
    try:
        while pending or running:
            while pending and free:
                slot = free.pop(0)
                job = pending.pop(0)
                running[slot] = _Running(job, shares[slot], parallel > 1)
                print(f"compare: [{total - len(pending)}/{total}] start {job.label} → {job.run_dir}", flush=True)
            time.sleep(0.5)
            for slot, r in list(running.items()):
                rc = r.proc.poll()
                if rc is None:
                    continue
                wall = r.finish(rc)
                del running[slot]
                free.append(slot)
                result = run_result(r.job)
                print(f"compare: {r.job.label} {'done' if result.ok else result.status} in {wall:.0f} s "
                      f"(log: {os.path.join(r.job.run_dir, LOG_FILE)})", flush=True)
    except KeyboardInterrupt:
        print(f"compare: interrupted; stopping {len(running)} running trainer(s) (they checkpoint first)",
              file=sys.stderr, flush=True)
        _stop(list(running.values()))
        raise


def _warmstart_argv(model: str, args: str) -> list[str]:
    return [sys.executable, "-m", "jaxrl_mismatch.cli", "warmstart", "--out", model, *shlex.split(args)]


def _warm_start(spec: Spec) -> None:
    """Warm-start each missing base model once, before the grid (parallel runs would race to write it)."""
    for model, args in spec.warmstarts.items():
        if os.path.isfile(os.path.join(model, "config.json")):
            continue
        log_path = os.path.join(spec.out, "warmstart.log")
        argv = _warmstart_argv(model, args)
        print(f"compare: warm start of {model} first (log: {log_path})", flush=True)
        with open(log_path, "a") as log:
            log.write(f"\n=== {shlex.join(argv)}\n")
            log.flush()
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc:
            raise UsageError(f"config.model.warmstart_args: the warm start of {model} failed (exit {rc}); see {log_path}")


OUT_MARKER = ".jaxrl-mismatch-compare"
OUTPUT_FILES = ("table.md", "table.json", "compare.png")  # what `write_outputs` writes into OUT


_SEED_DIR = re.compile(r"^seed_(0|[1-9]\d*)$")
_TABLE_MD_HEAD = "| variant | runs ok | collapsed |"  # report.summary.table_markdown's first line and its definitions
_TABLE_MD_TEXT = "Mean ± sample std over the finished seeds of each variant"
_TABLE_JSON_KEYS = {"name", "spec", "config", "variants_overrides", "seeds", "collapse", "variants"}  # write_outputs's
_MAX_READ = 64 << 20  # larger than any table or log compare writes: not read


def _read_text(path: str) -> str | None:
    try:
        if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > _MAX_READ:
            return None
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _is_compare_run(seed_dir: str, variant: str) -> bool:
    """Whether `seed_dir` (OUT/VARIANT/seed_N) is a run compare started: a real folder whose compare.json records
    compare's attempts, each a train command with `--config.run_dir=.../VARIANT/seed_N` (compare writes it before
    the trainer starts, and has since its first version). A training run of the user's (`train.runlock.is_run_dir`
    without compare.json) is not: compare would resume it with its own command."""
    if os.path.islink(seed_dir) or not os.path.isdir(seed_dir):
        return False
    attempts = read_attempts(seed_dir)
    tail = (variant, os.path.basename(seed_dir))

    def ours(a: Any) -> bool:
        command = a.get("command") if isinstance(a, dict) else None
        if not isinstance(command, list) or "train" not in command:
            return False
        dirs = [c.removeprefix("--config.run_dir=") for c in command
                if isinstance(c, str) and c.startswith("--config.run_dir=")]
        return len(dirs) == 1 and tuple(os.path.normpath(dirs[0]).split(os.sep)[-2:]) == tail

    return bool(attempts) and all(ours(a) for a in attempts)


def _not_compares(out: str, entry: str, variants: Sequence[str]) -> str | None:
    """None when `out/entry` is provably compare's own output (a folder written before the marker existed), else
    the path under `out` that is not."""
    from jaxrl_mismatch.report.plot import _is_our_figure

    path = os.path.join(out, entry)
    if entry in variants:
        if os.path.islink(path) or not os.path.isdir(path) or not os.listdir(path):
            return entry
        for seed in sorted(os.listdir(path)):
            if not _SEED_DIR.match(seed) or not _is_compare_run(os.path.join(path, seed), entry):
                return os.path.join(entry, seed)
        return None
    if entry == "table.md":
        text = _read_text(path)
        return None if text is not None and text.startswith(_TABLE_MD_HEAD) and _TABLE_MD_TEXT in text else entry
    if entry == "table.json":
        try:
            content = json.loads(_read_text(path) or "")
        except ValueError:
            return entry
        return None if isinstance(content, dict) and _TABLE_JSON_KEYS <= set(content) else entry
    if entry == "compare.png":  # report.plot.save_figure marks its figures
        return None if not os.path.islink(path) and _is_our_figure(path) else entry
    if entry == "warmstart.log":  # _warm_start's: "\n=== COMMAND\n" before each warm start's output
        first = (_read_text(path) or "").removeprefix("\n").split("\n", 1)[0]
        return None if first.startswith("=== ") and " jaxrl_mismatch.cli warmstart --out " in first else entry
    return entry


def check_out(spec: Spec) -> None:
    """UsageError unless `spec.out` may hold this grid: new, empty, or a compare output — its marker, or (one
    written before the marker) nothing but what is provably compare's: this spec's variant folders holding only
    runs compare started (`_is_compare_run`), and its table.md / table.json / compare.png / warmstart.log (their
    content is compare's). A user's folder is never written into (its table.md would be overwritten), and in a marked
    folder a symbolic link or a folder at one of `OUTPUT_FILES` is refused (the rename into place would replace the
    user's link). Reads only."""
    out = spec.out
    if os.path.islink(out):
        raise _error(spec.path, "out", f"{out} is a symbolic link; give the directory it points to")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise _error(spec.path, "out", f"{out} {path_kind(out)}; give a directory")
    if not os.path.isdir(out):
        return
    entries = sorted(os.listdir(out))
    if OUT_MARKER in entries:  # compare's own folder: still, the files it replaces must be plain files
        for name in OUTPUT_FILES:
            path = os.path.join(out, name)
            if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(path)):
                kind = "a symbolic link" if os.path.islink(path) else "not a file"
                raise _error(spec.path, "out", f"{path} is {kind}; compare replaces it with its own {name}: move it "
                             "out of the way (nothing was changed)")
        return
    if not entries:
        return
    foreign = next((f for e in entries if (f := _not_compares(out, e, list(spec.variants))) is not None), None)
    if foreign is None:
        return
    raise _error(spec.path, "out", f"{out} is a non-empty directory not written by `jaxrl-mismatch compare` "
                 f"(holds {listing(entries)}; {foreign} is not compare's); choose a new or empty directory as "
                 "`out` (nothing was changed)")


_MARKER_HEAD = "written by jaxrl-mismatch compare: its runs (VARIANT/seed_N), tables and figure"


def _recorded(out: str) -> dict[str, str]:
    """{output file: its fingerprint when compare last wrote it}, from the marker (none in an older marker)."""
    text = _read_text(os.path.join(out, OUT_MARKER)) or ""
    rows = (line.split("\t", 1) for line in text.splitlines()[1:])
    return {r[0]: r[1] for r in rows if len(r) == 2 and r[0] in OUTPUT_FILES}


def _keep_edited(out: str) -> None:
    """An output a user changed since compare wrote it (notes added to table.md) is renamed aside,
    `NAME.edited-<ns>`, before compare writes its own again: never overwritten."""
    for name, fingerprint in _recorded(out).items():
        path = os.path.join(out, name)
        if os.path.isfile(path) and file_fingerprint(path) != fingerprint:
            aside = f"{path}.edited-{time.time_ns()}"
            os.rename(path, aside)
            print(f"compare: {path} changed since compare wrote it; kept as {aside}", file=sys.stderr, flush=True)


def _record_outputs(out: str) -> None:
    with staged_file(os.path.join(out, OUT_MARKER)) as tmp, open(tmp, "w") as f:
        f.write("\n".join([_MARKER_HEAD, *(f"{n}\t{fp}" for n in OUTPUT_FILES
                                             if (fp := file_fingerprint(os.path.join(out, n))) is not None)]) + "\n")


def write_outputs(spec: Spec) -> tuple[str, bool]:
    """table.md, table.json and compare.png of the grid as it is on disk; (the Markdown, all runs ok?). Outputs a
    user changed since compare wrote them are kept aside first (`_keep_edited`)."""
    _keep_edited(spec.out)
    results = {v: [run_result(j) for j in spec.jobs if j.variant == v] for v in spec.variants}
    table = summarize(results, spec.collapse)
    md = write_table(table, spec.collapse, os.path.join(spec.out, "table.md"), os.path.join(spec.out, "table.json"),
                     extra={"name": spec.name, "spec": spec.path, "config": spec.config, "overrides": spec.overrides,
                            "variants_overrides": spec.variants, "seeds": spec.seeds},
                     baseline=spec.baseline, controls=spec.controls)
    # Finished runs, and running ones (a grid being watched); a failed, stopped or stale run would pull the mean
    # line down and then let it jump where it ends, as a training effect would (the table lists those runs).
    groups = {v: [r.records for r in runs if r.records and (r.ok or r.status.startswith("running"))]
              for v, runs in results.items()}
    groups = {v: runs for v, runs in groups.items() if runs}
    if groups:
        from jaxrl_mismatch.report.plot import PANELS, plot_overlay

        plot_overlay(groups, os.path.join(spec.out, "compare.png"), panels=spec.panels or PANELS, title=spec.name)
    _record_outputs(spec.out)
    return md, all(r.ok for runs in results.values() for r in runs)


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                       epilog="The spec schema is in the module docstring of jaxrl_mismatch/jobs/compare.py and in "
                              "docs/experiments.md.")
    p.add_argument("spec", help="spec file (Python, defines get_spec()); FILE:ARG calls get_spec(ARG)")
    p.add_argument("--jobs", type=int, default=None,
                   help=f"trainers at a time (default {default_jobs()} on this machine: one per core; with accelerators, "
                        "how many runs the devices hold)")
    p.add_argument("--dry-run", action="store_true", help="print the commands (and what would be skipped), run nothing")
    p.add_argument("--table-only", action="store_true", help="only write the table and figure from the runs on disk")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs: must be >= 1, got {args.jobs}")
    spec = validate_spec(load_spec(args.spec))
    check_out(spec)  # read-only: a dry run refuses the `out` the real run would refuse
    parallel = args.jobs or default_jobs()
    results = {j: run_result(j) for j in spec.jobs}
    busy = [j for j in spec.jobs if results[j].status.startswith("running")]
    todo = [j for j in spec.jobs if not results[j].ok and j not in busy]
    for j in busy:
        print(f"compare: {j.label} is still running in another process ({results[j].status}); not starting it "
              "again", file=sys.stderr, flush=True)
    if args.dry_run:
        for model, wargs in spec.warmstarts.items():
            print(f"# warm start first: {shlex.join(_warmstart_argv(model, wargs))}")
        for j in spec.jobs:
            note = "# finished, skipped: " if results[j].ok else "# running elsewhere, skipped: " if j in busy else ""
            print(note + shlex.join(j.argv))
        print(f"# {len(todo)} of {len(spec.jobs)} runs to do, {parallel} at a time; outputs in {spec.out}")
        return 0
    os.makedirs(spec.out, exist_ok=True)
    if not os.path.exists(os.path.join(spec.out, OUT_MARKER)):
        with open(os.path.join(spec.out, OUT_MARKER), "w") as f:
            f.write(_MARKER_HEAD + "\n")
    if not args.table_only:
        finished = sum(r.ok for r in results.values())
        if finished:
            print(f"compare: {finished} of {len(spec.jobs)} runs already finished; skipping them", flush=True)
        if todo:
            _warm_start(spec)
            run_jobs(todo, min(parallel, len(todo)))
    md, all_ok = write_outputs(spec)
    print(md, end="")
    figure = os.path.join(spec.out, "compare.png")
    print(f"compare: wrote {os.path.join(spec.out, 'table.md')}, {os.path.join(spec.out, 'table.json')}"
          + (f", {figure}" if os.path.isfile(figure) else " (no figure: no run has records yet)"), flush=True)
    if not all_ok and not args.table_only:
        print("compare: some runs did not finish (see the table); rerun the same command to retry them",
              file=sys.stderr, flush=True)
        return 1
    return 0
