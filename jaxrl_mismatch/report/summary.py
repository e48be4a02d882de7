"""Numbers of a run and of a grid of runs: per-run statistics, collapse detection, mean ± std over seeds,
paired differences against a baseline variant (`report.paired`), and the Markdown / JSON table of
`jaxrl-mismatch compare`.

Why a module of its own: `compare --table-only` and any notebook summarise finished run directories
without running or plotting anything, and the definitions (what "collapse" and "final accuracy" mean)
must be the same everywhere they are quoted. Per-run statistics are taken over all of that run's steps —
one record per step, the last written for it, in step order (`by_step`) — and keep non-finite values (a
NaN final validation is a NaN final, an inf step makes the max inf); the statistics of a variant are taken
over its seeds (one number per seed, then mean and sample std).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping, Sequence

import numpy as np

from jaxrl_mismatch.outputs import json_safe, staged_file
from jaxrl_mismatch.usage import UsageError

# How many steps "start" and "end" of a run average over (response length), fewer in a shorter run.
EDGE_STEPS = 10


_NONFINITE = ("nan", "inf", "-inf")  # how runlog writes non-finite values (JSON has none)


def value(v: Any) -> float | None:
    """A logged metric value as a float (None: not a number). Non-finite values count: runlog's "nan" / "inf"
    / "-inf" strings, JSON's NaN / Infinity, and an integer too large for a float (±inf) — a statistic must
    not pass over them as if the step had not logged the metric."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        try:
            return float(v)
        except OverflowError:
            return math.inf if v > 0 else -math.inf
    if isinstance(v, float):
        return v
    return float(v) if isinstance(v, str) and v in _NONFINITE else None


def by_step(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One record per integer step, the last written for it, in step order: "final" means the last step, not
    the last line, and a step written twice (a log appended to by hand or a copied run) counts once."""
    at: dict[int, Mapping[str, Any]] = {}
    for r in records:
        step = r.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            at[step] = r
    return [at[s] for s in sorted(at)]


def series(records: Sequence[Mapping[str, Any]], name: str, *, finite: bool = True) -> tuple[list[int], list[float]]:
    """(steps, values) of metric `name`, one per step in step order (`by_step`), skipping steps without it;
    with `finite` (what figures and the collapse rule use: a NaN cannot be drawn or smoothed) also the steps
    whose value is NaN or ±inf, which the table's statistics keep (`finite=False`)."""
    xs, ys = [], []
    for r in by_step(records):
        v = value(r.get(name))
        if v is not None and (not finite or math.isfinite(v)):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def trailing_median(ys: Sequence[float], window: int) -> list[float]:
    """Median of the last `window` values (of all values so far for the first window - 1): unlike a mean,
    one outlying evaluation neither makes nor hides a collapse."""
    return [float(np.median(ys[max(0, i + 1 - window): i + 1])) for i in range(len(ys))]


def moving_average(ys: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (over all values so far for the first window - 1).

    Each window is summed on its own: a running sum (add the new value, subtract the one leaving) loses the small
    values after a spike to rounding (0.01s after a 3e17 read as 0) and keeps an overflow (inf) for good. Each value
    is divided before the sum, so a window of values near float's maximum does not overflow either."""
    ys = np.asarray(ys, np.float64)
    return [float(np.sum(ys[max(0, i + 1 - window): i + 1] / min(i + 1, window))) for i in range(len(ys))]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollapseRule:
    """When a run has collapsed: the smoothed `metric` — its trailing median over `window` logged points —
    falls below `frac` × its running peak (the highest smoothed value so far) and stays below until the end
    of the run, for at least `patience` logged points. The collapse step is the step of the first of those.

    Only training steps count (step >= 0): the pre-training validation (step -1) is the initial policy, not
    something the run learned and lost. A run whose peak is <= 0 never collapses (a fraction of a
    non-positive peak means nothing). Defaults: the train reward (logged every step), 10-point median, half
    its peak, 10 points — a run that merely ends on a bad step has not collapsed; one that lost half of what
    it had learned and never came back has. For validation accuracy (logged every `eval.every` steps) use
    e.g. `window=3, patience=3`: one noisy evaluation neither fires nor hides it.
    """

    metric: str = "reward/mean"
    frac: float = 0.5
    window: int = 10
    patience: int = 10

    @classmethod
    def from_spec(cls, d: Any, field: str = "collapse") -> "CollapseRule":
        """The rule of a spec's `collapse` dict; UsageError naming `collapse.<key>` for a bad one."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise UsageError(f"{field}: must be a dict such as {{'metric': 'reward/mean', 'frac': 0.5}}, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                raise UsageError(f"{field}.{key}: unknown field; valid: {sorted(known)}")
        rule = cls(**d)
        if not isinstance(rule.metric, str) or not rule.metric:
            raise UsageError(f"{field}.metric: must be a metric name such as 'reward/mean', got {rule.metric!r}")
        if isinstance(rule.frac, bool) or not isinstance(rule.frac, (int, float)) or not 0 < rule.frac < 1:
            raise UsageError(f"{field}.frac: must be a number in (0, 1), got {rule.frac!r}")
        for key in ("window", "patience"):
            v = getattr(rule, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"{field}.{key}: must be an integer >= 1, got {v!r}")
        return rule

    def step(self, records: Sequence[Mapping[str, Any]]) -> int | None:
        """The collapse step of a run's records, or None when it did not collapse (see the class)."""
        steps, values = series(records, self.metric)
        kept = [i for i, step in enumerate(steps) if step >= 0]
        steps, values = [steps[i] for i in kept], [values[i] for i in kept]
        if not steps:
            return None
        avg = np.asarray(trailing_median(values, self.window))
        peak = np.maximum.accumulate(avg)
        below = (avg < self.frac * peak) & (peak > 0)
        if not below[-1]:
            return None
        # The first point of the trailing run of "below" points.
        first = len(below) - int(np.argmin(below[::-1])) if not below.all() else 0
        if len(below) - first < self.patience:
            return None
        return steps[first]


def run_stats(records: Sequence[Mapping[str, Any]], rule: CollapseRule) -> dict[str, float | None]:
    """Statistics of one run over all of its steps, one record per step (`by_step`); None where the run did
    not log the metric. Non-finite values are kept, as arithmetic has them (a NaN anywhere in a metric makes
    its mean / max / peak NaN, an inf step its max inf; a NaN last validation is a NaN final, never an earlier
    value), so the table shows them rather than a number that passed over them.

    - `val_initial`: the pre-training `val/accuracy` (step -1); `val_final` / `val_peak`: the last and the
      highest `val/accuracy` of the training steps (the initial validation is not a peak the run reached);
      `val_final_over_peak`: their ratio (None for a peak of 0); `greedy_*` the same for `val/greedy_accuracy`;
    - `collapse_step`: `rule.step(records)`; `collapsed`: 1.0 / 0.0;
    - `log_ppl_abs_diff_mean` / `_max`, `rho_std_mean`: over the run's training steps;
    - `length_start` / `length_end`: mean `length/mean` over the first / last `EDGE_STEPS` steps;
    - `lr_decays`: how many steps lowered the controller's LR multiplier (`controller/scale`), counting from
      the 1.0 every controller starts at — so a cut on step 0 counts;
    - `step_time_s`: the sum of `time/step_s` (training steps only: no start-up, no validation);
    - `steps_done`: the last training step logged + 1.
    """
    def values(name: str) -> list[float]:  # the training steps' (a step -1 record is the initial validation's)
        steps, v = series(records, name, finite=False)
        return [y for x, y in zip(steps, v) if x >= 0]

    def mean(v: Sequence[float]) -> float | None:
        with np.errstate(all="ignore"):  # inf - inf is NaN, a sum past 1.8e308 inf: what the cell should say
            return float(np.mean(v)) if len(v) else None

    out: dict[str, float | None] = {}
    for key, name in (("val", "val/accuracy"), ("greedy", "val/greedy_accuracy")):
        steps, v = series(records, name, finite=False)
        initial = [y for x, y in zip(steps, v) if x < 0]
        trained = [y for x, y in zip(steps, v) if x >= 0]
        out[f"{key}_initial"] = initial[-1] if initial else None
        out[f"{key}_final"] = trained[-1] if trained else None
        out[f"{key}_peak"] = float(np.max(trained)) if trained else None  # NaN if any is (Python's max is not)
        final, peak = out[f"{key}_final"], out[f"{key}_peak"]
        with np.errstate(all="ignore"):
            out[f"{key}_final_over_peak"] = float(np.float64(final) / peak) if peak else None
    collapse = rule.step(records)
    out["collapse_step"] = None if collapse is None else float(collapse)
    out["collapsed"] = float(collapse is not None) if series(records, rule.metric)[0] else None
    diff, rho = values("mismatch/log_ppl_abs_diff"), values("mismatch/rho_std")
    out["log_ppl_abs_diff_mean"] = mean(diff)
    out["log_ppl_abs_diff_max"] = float(np.max(diff)) if diff else None
    out["rho_std_mean"] = mean(rho)
    length = values("length/mean")
    out["length_start"] = mean(length[:EDGE_STEPS])
    out["length_end"] = mean(length[-EDGE_STEPS:])
    scale = values("controller/scale")
    scale = [1.0, *scale] if scale else []  # every controller starts at 1.0 (schedules.controllers.Controller)
    out["lr_decays"] = float(sum(b < a for a, b in zip(scale, scale[1:]))) if scale else None
    times = values("time/step_s")
    out["step_time_s"] = float(sum(times)) if times else None
    steps = [r["step"] for r in by_step(records) if r["step"] >= 0]
    out["steps_done"] = float(max(steps) + 1) if steps else 0.0
    return out


def over_seeds(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """mean, sample std (ddof=1; None for one value) and count of the values that exist."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return {"mean": None, "std": None, "n": 0}
    with np.errstate(all="ignore"):  # a non-finite seed makes the mean non-finite: the cell shows it
        return {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1)) if len(v) > 1 else None, "n": len(v)}


@dataclasses.dataclass(kw_only=True)
class RunResult:
    """One run of a grid as the table sees it. `ok`: finished (reached its last step, exited 0) — only
    those enter the statistics; `status` says what happened otherwise ("failed (exit 1)", …)."""

    seed: int
    run_dir: str
    status: str
    ok: bool
    records: list[dict]
    wall_s: float | None = None  # process wall time of the run (all attempts), when the harness ran it


# Table columns: (key in the variant summary, header, format). Statistics come from `run_stats`.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("val_initial", "val acc initial", ".3f"),
    ("val_final", "val acc final", ".3f"),
    ("val_peak", "val acc peak", ".3f"),
    ("val_final_over_peak", "final / peak", ".2f"),
    ("greedy_final", "greedy final", ".3f"),
    ("greedy_peak", "greedy peak", ".3f"),
    ("collapse_step", "steps to collapse", ".0f"),
    ("log_ppl_abs_diff_mean", "log_ppl_abs_diff mean", ".3g"),
    ("log_ppl_abs_diff_max", "log_ppl_abs_diff max", ".3g"),
    ("rho_std_mean", "ρ std mean", ".3g"),
    ("length_start", "length start", ".1f"),
    ("length_end", "length end", ".1f"),
    ("lr_decays", "LR decays", ".1f"),
    ("step_time_s", "Σ step time (s)", ".0f"),
    ("wall_s", "wall (s)", ".0f"),
)


def summarize(variants: Mapping[str, Sequence[RunResult]], rule: CollapseRule) -> dict[str, Any]:
    """{variant: {"runs": [...per-seed stats and status...], "summary": {stat: mean/std/n over ok seeds},
    "ok": n, "collapsed": k}} — the content of table.json."""
    out: dict[str, Any] = {}
    for name, runs in variants.items():
        rows, ok = [], []
        for r in runs:
            stats = {**run_stats(r.records, rule), "wall_s": r.wall_s} if r.records else {"wall_s": r.wall_s}
            rows.append({"seed": r.seed, "run_dir": r.run_dir, "status": r.status, "ok": r.ok, "stats": stats})
            if r.ok:
                ok.append(stats)
        summary = {key: over_seeds([s.get(key) for s in ok]) for key, _, _ in COLUMNS}
        out[name] = {"runs": rows, "summary": summary, "ok": len(ok), "total": len(runs),
                     "collapsed": int(sum(s.get("collapsed") or 0 for s in ok))}
    return out


def _cell(stat: Mapping[str, Any], fmt: str) -> str:
    if stat["mean"] is None:
        return "–"
    text = format(stat["mean"], fmt)
    return text if stat["std"] is None else f"{text} ± {format(stat['std'], fmt)}"


def table_markdown(table: Mapping[str, Any], rule: CollapseRule, baseline: str | None = None,
                   controls: Mapping[str, str] | None = None) -> str:
    """The Markdown table of `summarize`'s output, with the definitions it uses underneath, and with a
    `baseline` variant the paired table (`report.paired`) after it, then the `controls` pairs' table."""
    header = ["variant", "runs ok", "collapsed", *(h for _, h, _ in COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, v in table.items():
        cells = [name, f"{v['ok']}/{v['total']}", f"{v['collapsed']}/{v['ok']}"]
        cells += [_cell(v["summary"][key], fmt) for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Mean ± sample std over the finished seeds of each variant; per-run numbers over all of the "
              f"run's steps, one record per step (the last written for it); a NaN or inf a run logged is kept, so "
              f"its statistic is NaN or inf (the runs are listed below), while the collapse rule and the figure use "
              f"the finite values. Val acc initial: before training (step −1); final / peak: the last / highest "
              f"validation of the training steps (the initial one excluded); final / peak is the mean of the "
              f"per-seed ratios. Collapse: the {rule.window}-point trailing median of `{rule.metric}` (training "
              f"steps) falls below {rule.frac:g} × its running peak and stays below to the end (≥ {rule.patience} "
              f"points); steps to collapse average the seeds that collapsed, – when none did. Length start/end: "
              f"mean of `length/mean` over the first/last {EDGE_STEPS} steps. LR decays: steps that lowered "
              "`controller/scale`, from the 1.0 it starts at (a cut decided at step 0 counts; it applies from step 1). Σ step time: the sum of "
              "`time/step_s`; wall: the train process's wall time."]
    if baseline is not None:
        from jaxrl_mismatch.report.paired import paired_against, paired_markdown

        lines += ["", paired_markdown(paired_against(table, baseline), baseline).rstrip("\n")]
    if controls:
        from jaxrl_mismatch.report.paired import paired_controls, paired_markdown

        lines += ["", paired_markdown(paired_controls(table, controls), None).rstrip("\n")]
    problems = [f"- {name} seed {r['seed']}: {r['status']} ({r['run_dir']})"
                for name, v in table.items() for r in v["runs"] if not r["ok"]]
    if problems:
        lines += ["", "Runs not in the statistics:", *problems]
    nonfinite = [(name, r, _nonfinite(r["stats"])) for name, v in table.items() for r in v["runs"] if r["ok"]]
    if any(keys for _, _, keys in nonfinite):
        lines += ["", "Runs that logged NaN or inf (kept: their statistics, and the variant's mean, are non-finite):",
                  *(f"- {name} seed {r['seed']}: {', '.join(keys)} ({r['run_dir']})" for name, r, keys in nonfinite
                    if keys)]
    return "\n".join(lines) + "\n"


def _nonfinite(stats: Mapping[str, Any]) -> list[str]:
    return [f"{k} = {v}" for k, v in stats.items() if isinstance(v, float) and not math.isfinite(v)]


def write_atomic(path: str, text: str) -> None:
    """Write `path` through a temporary sibling renamed into place (`outputs.staged_file`): a reader or a crash
    sees the old file or the new one, never half of one, and a failed write leaves no temporary behind."""
    with staged_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def write_table(table: Mapping[str, Any], rule: CollapseRule, md_path: str, json_path: str,
                extra: Mapping[str, Any] | None = None, baseline: str | None = None,
                controls: Mapping[str, str] | None = None) -> str:
    """Write table.md and table.json (`extra` goes into the JSON's top level; with a `baseline` variant the
    JSON has `baseline` and `paired`: per variant and statistic, the per-seed differences, mean, interval
    and wins; with `controls`, `paired_controls` likewise); returns the Markdown."""
    md = table_markdown(table, rule, baseline, controls)
    content: dict[str, Any] = {**(extra or {}), "collapse": dataclasses.asdict(rule), "variants": table}
    if baseline is not None:
        from jaxrl_mismatch.report.paired import paired_against

        content.update(baseline=baseline, paired=paired_against(table, baseline))
    if controls:
        from jaxrl_mismatch.report.paired import paired_controls

        content.update(controls=dict(controls), paired_controls=paired_controls(table, controls))
    write_atomic(json_path, json.dumps(json_safe(content), indent=1, allow_nan=False))
    write_atomic(md_path, md)
    return md
