"""E3's one-table summary across algorithms, from the grids' results (docs/results/e3_short_*.json).

    python experiments/e3_summary.py [--results docs/results] [--task short|discover] [--figure PATH.png]

Each E3 grid (experiments/e3_precision.py:ALGO) is one algorithm in three precisions, paired against bf16;
`compare` writes one table per grid. This prints the row per algorithm that docs/experiments.md shows —
final validation per precision, collapses, and the three paired differences (fp16 − bf16, fp32 − bf16, and
the control fp16 − fp32) as mean [95 % t interval], wins k/n — then the exact grids' bf16_exact − bf16 (PPO's
`exact`, and `exact_ALGO` for another algorithm) and
how many intervals exclude 0 out of how many were computed (so "one in twenty at 95 %" can be checked).
Every number is read from the JSON `compare` wrote; a grid that has not been run is listed as missing.
`--task discover` reads the `:long_discover` grids (e3_discover_*.json, `e3_precision.py:discover_ALGO`).
`--figure` draws the paired differences as a forest plot: one row per algorithm and comparison, the mean
difference with its 95 % t interval, against the zero line — "does any interval leave 0?" at a glance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxrl_mismatch.report.paired import paired_cell as cell

ORDER = ("ppo", "token_tis", "seq_mis", "seq_tis", "pg_seq_is", "pg_seq_tis", "pg_seq_mis", "gspo")
PRECISIONS = ("bf16", "fp16", "fp32")


def paired_cell(d: dict) -> str:
    """The grid table's cell (`report.paired.paired_cell`: ties and NaNs named; no interval under 2 seeds)."""
    return cell(d, ".3f").replace("-", "−")  # the docs' minus


def excludes_zero(d: dict) -> bool:
    if d.get("ci95") is None:  # fewer than 2 paired seeds: no interval
        return False
    lo, hi = d["ci95"]
    return lo > 0 or hi < 0


def final_mean(v: dict) -> str:
    """A variant's mean final validation, with its seed count when not every run finished (a 4-seed mean beside
    5-seed ones says so)."""
    mean = v["summary"]["val_final"]["mean"]
    text = "–" if mean is None else f"{mean:.3f}"
    return text if v["ok"] == v["total"] else f"{text} (n={v['ok']}/{v['total']})"


def collapsed(v: dict) -> str:
    return str(v["collapsed"]) if v["ok"] == v["total"] else f"{v['collapsed']}/{v['ok']}"


TASKS = ("short", "discover")  # the grids' directory prefixes: e3_short_* (default task), e3_discover_*


def summary(results: Path, task: str = "short") -> tuple[str, dict]:
    rows, missing, intervals, excluding = [], [], 0, []
    for algo in ORDER:
        path = results / f"e3_{task}_{algo}.json"
        if not path.exists():
            missing.append(algo)
            continue
        d = json.loads(path.read_text())
        v = d["variants"]
        finals = " / ".join(final_mean(v[p]) for p in PRECISIONS)
        collapses = " / ".join(collapsed(v[p]) for p in PRECISIONS)
        cells = {"fp16 − bf16": d["paired"]["fp16"]["val_final"], "fp32 − bf16": d["paired"]["fp32"]["val_final"],
                 "fp16 − fp32": d["paired_controls"]["fp16 vs fp32"]["val_final"]}
        for name, c in cells.items():
            intervals += c.get("ci95") is not None
            if excludes_zero(c):
                excluding.append(f"{algo} {name}")
        rows.append(f"| `{algo}` | {finals} | {collapses} | "
                    + " | ".join(paired_cell(c) for c in cells.values()) + " |")
    lines = ["| algorithm | val final bf16 / fp16 / fp32 | collapsed | fp16 − bf16 | fp32 − bf16 | fp16 − fp32 (control) |",
             "| --- | --- | --- | --- | --- | --- |", *rows]
    exact_rows = []  # the exact grids: PPO's (`exact`) and any other algorithm's (`exact_ALGO`)
    for grid in ("exact", *(f"exact_{a}" for a in ORDER)):
        exact_path = results / f"e3_{task}_{grid}.json"
        if not exact_path.exists():
            if grid == "exact":
                missing.append("exact")
            continue
        d = json.loads(exact_path.read_text())
        v = d["variants"]
        c = d["paired"]["bf16_exact"]["val_final"]
        intervals += c.get("ci95") is not None
        if excludes_zero(c):
            excluding.append(f"{grid} bf16_exact − bf16")
        exact_rows.append(f"| `{grid}` | {final_mean(v['bf16'])} / {final_mean(v['bf16_exact'])} | "
                          f"{collapsed(v['bf16'])} / {collapsed(v['bf16_exact'])} | {paired_cell(c)} |")
    if exact_rows:
        lines += ["", "| exact grid (`exact`: PPO) | val final bf16 / bf16 + exact | collapsed | bf16_exact − bf16 |",
                  "| --- | --- | --- | --- |", *exact_rows]
    lines += ["", f"{len(excluding)} of {intervals} intervals exclude 0" + (f": {', '.join(excluding)}" if excluding else "")
              + (f". Not run: {', '.join(missing)}." if missing else ".")]
    return "\n".join(lines), {"intervals": intervals, "excluding_zero": excluding, "missing": missing}


COMPARISONS = (("fp16 − bf16", "paired", "fp16"), ("fp32 − bf16", "paired", "fp32"),
               ("fp16 − fp32", "paired_controls", "fp16 vs fp32"))


def figure(results: Path, task: str, path: Path) -> None:
    """Forest plot of every paired difference of the task's grids (module docstring), written atomically."""
    from jaxrl_mismatch.report.plot import save_figure  # sets the Agg backend before pyplot loads

    import matplotlib.pyplot as plt

    rows = []  # (label, comparison index, mean, lo, hi)
    seeds = set()
    for algo in (*ORDER, "exact", *(f"exact_{a}" for a in ORDER)):
        p = results / f"e3_{task}_{algo}.json"
        if not p.exists():
            continue
        d = json.loads(p.read_text())
        exact = algo.startswith("exact")
        comparisons = ((("bf16_exact − bf16", "paired", "bf16_exact"),) if exact else COMPARISONS)
        for k, (name, section, key) in enumerate(comparisons):
            c = d.get(section, {}).get(key, {}).get("val_final")
            if c and c.get("ci95"):
                rows.append((f"{algo}: {name}", 3 if exact else k, c["mean"], *c["ci95"]))
                seeds.add(c["n"])
    fig, ax = plt.subplots(figsize=(6.4, 0.28 * max(len(rows), 4) + 1.2))
    for y, (label, k, mean, lo, hi) in enumerate(reversed(rows)):
        ax.errorbar([mean], [y], xerr=[[mean - lo], [hi - mean]], fmt="o", color=f"C{k}", capsize=3, ms=4)
    ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)], fontsize=7)
    ax.axvline(0.0, color="k", lw=0.8)
    n = "–".join(str(k) for k in sorted(seeds)[:: max(1, len(seeds) - 1)]) or "no"
    ax.set_xlabel(f"final validation accuracy, paired difference ({n} seeds): mean and 95 % t interval", fontsize=8)
    ax.set_title(f"E3 ({task} task): precision and the outcome", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, str(path), dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(Path(__file__).resolve().parents[1] / "docs" / "results"),
                    help="folder with compare's e3_short_*.json")
    ap.add_argument("--task", default="short", help="which grids: short (default task) or discover (:long_discover)")
    ap.add_argument("--figure", default=None, help="also draw the paired differences (forest plot) to this PNG")
    args = ap.parse_args()
    if args.task not in TASKS:
        print(f"error: --task must be one of {', '.join(TASKS)}, got {args.task!r}", file=sys.stderr)
        sys.exit(2)
    results = Path(args.results)
    if not results.is_dir():
        print(f"error: --results {results}: not a folder", file=sys.stderr)
        sys.exit(2)
    if args.figure:  # a new path or an existing figure, never another file (`report.plot.check_figure_out`)
        from jaxrl_mismatch.report.plot import check_figure_out
        from jaxrl_mismatch.usage import exit_on_usage_error

        exit_on_usage_error(check_figure_out, "--figure", args.figure)
    print(summary(results, args.task)[0])
    if args.figure:
        figure(results, args.task, Path(args.figure))
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
