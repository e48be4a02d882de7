"""Paired statistics of a grid: each variant against a named baseline variant, seed by seed.

Why paired: the runs of a grid that share a seed share their data order, initial rollouts and (with
`task.data_seed`) their held-out prompts, so the seed-to-seed spread — large at CPU scale — cancels in the
per-seed difference `d_s = x_variant(s) − x_baseline(s)`. A reviewer then asks three things, reported for
each statistic here: in how many of the n seeds the variant is better (wins k/n), the mean difference,
and a 95 % confidence interval for it — Student's t on the n differences,

    mean(d) ± t_{0.975, n−1} · sd(d) / √n      (sd with ddof = 1),

the standard paired-t interval (it assumes roughly normal differences; with 5 seeds a bootstrap interval
would be no better founded). Only seeds where both runs finished and logged the statistic are paired.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import scipy.stats

# Statistics of `summary.run_stats` compared against the baseline; all are "higher is better".
PAIRED: tuple[tuple[str, str, str], ...] = (
    ("val_final", "Δ val acc final", ".3f"),
    ("val_final_over_peak", "Δ final / peak", ".2f"),
    ("val_peak", "Δ val acc peak", ".3f"),
)
CONFIDENCE = 0.95


def t_interval(d: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The Student-t confidence interval for the mean of the paired differences `d`; None for fewer than 2."""
    n = len(d)
    if n < 2:
        return None
    mean, sd = float(np.mean(d)), float(np.std(d, ddof=1))
    half = float(scipy.stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return mean - half, mean + half


def paired_difference(variant: Mapping[int, float | None], baseline: Mapping[int, float | None]) -> dict[str, Any]:
    """Per-seed differences variant − baseline over the seeds both have (values None are left out):
    {"n", "per_seed": {seed: d}, "mean", "ci95": [lo, hi] | None, "wins", "losses", "ties"}."""
    seeds = sorted(s for s in variant if s in baseline and variant[s] is not None and baseline[s] is not None)
    per_seed = {s: float(variant[s]) - float(baseline[s]) for s in seeds}
    d = list(per_seed.values())
    ci = t_interval(d)
    return {"n": len(d), "per_seed": per_seed, "mean": float(np.mean(d)) if d else None,
            "ci95": None if ci is None else [ci[0], ci[1]],
            "wins": sum(x > 0 for x in d), "losses": sum(x < 0 for x in d), "ties": sum(x == 0 for x in d)}


def paired_against(table: Mapping[str, Any], baseline: str,
                   keys: Sequence[str] = tuple(k for k, _, _ in PAIRED)) -> dict[str, dict[str, Any]]:
    """{variant: {stat: paired_difference}} for every variant of `summary.summarize`'s table but the
    baseline, over the finished runs of both."""
    def by_seed(name: str, key: str) -> dict[int, float | None]:
        return {r["seed"]: r["stats"].get(key) for r in table[name]["runs"] if r["ok"]}

    return {name: {key: paired_difference(by_seed(name, key), by_seed(baseline, key)) for key in keys}
            for name in table if name != baseline}


def paired_controls(table: Mapping[str, Any], controls: Mapping[str, str],
                    keys: Sequence[str] = tuple(k for k, _, _ in PAIRED)) -> dict[str, dict[str, Any]]:
    """{"variant vs control": {stat: paired_difference}} for each (variant, control) pair of a spec's
    `controls`: the comparison that could explain a variant's gain over the baseline (same mean LR, the same
    schedule without mismatch), paired seed by seed like the baseline's."""
    def by_seed(name: str, key: str) -> dict[int, float | None]:
        return {r["seed"]: r["stats"].get(key) for r in table[name]["runs"] if r["ok"]}

    return {f"{v} vs {c}": {key: paired_difference(by_seed(v, key), by_seed(c, key)) for key in keys}
            for v, c in controls.items()}


def paired_cell(p: Mapping[str, Any], fmt: str) -> str:
    """`mean [interval], wins/n (ties, NaNs)` of one `paired_difference`, numbers in `fmt`; – without seeds."""
    if not p["n"]:
        return "–"
    text = format(p["mean"], "+" + fmt)
    if p["ci95"] is not None:
        text += f" [{format(p['ci95'][0], '+' + fmt)}, {format(p['ci95'][1], '+' + fmt)}]"
    # Named so that "0/5" is not read as "lower in 5/5": ties (equal values) and NaN differences (a run logged
    # NaN) are neither wins nor losses.
    nan = p["n"] - p["wins"] - p["losses"] - p["ties"]
    notes = [f"{k} {what}" for k, what in ((p["ties"], "tied"), (nan, "NaN")) if k]
    return f"{text}, {p['wins']}/{p['n']}" + (f" ({', '.join(notes)})" if notes else "")


def paired_markdown(paired: Mapping[str, Mapping[str, Any]], baseline: str | None) -> str:
    """The Markdown table of `paired_against`'s output (or, with `baseline` None, of `paired_controls`'),
    with what its cells mean underneath."""
    header = ["variant vs " + (baseline or "its control"), "paired seeds", *(h for _, h, _ in PAIRED)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, stats in paired.items():
        n = max((p["n"] for p in stats.values()), default=0)
        lines.append("| " + " | ".join([name, str(n), *(paired_cell(stats[k], fmt) for k, _, fmt in PAIRED)]) + " |")
    if baseline is None:
        return "\n".join(lines + ["", "Controls: each row pairs a variant with the control named after \"vs\", "
                                   "seed by seed, as above (table.json: `paired_controls`)."]) + "\n"
    lines += ["", f"Paired against `{baseline}` seed by seed (same seed: same data order, same held-out prompts): "
              f"mean of the per-seed differences variant − {baseline} [{CONFIDENCE:.0%} Student-t interval over the "
              f"paired seeds], then wins k/n = seeds where the variant is higher, and how many tied (equal values: "
              f"common with discrete accuracies) or were NaN; the other seeds are lower. Per-seed differences: "
              "table.json (`paired`)."]
    return "\n".join(lines) + "\n"
