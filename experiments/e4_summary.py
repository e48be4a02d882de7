"""E4's summary in the shape of AReaL's table: staleness down, objectives across, from the grid's results.

    python experiments/e4_summary.py [--results docs/results] [--source int8] [--figure PATH.png]

`compare experiments/e4_staleness.py[:SOURCE]` writes one long table (docs/results/e4_staleness_SOURCE.md).
This prints (1) final validation accuracy per staleness × objective, mean ± sample std over the seeds with the
collapses k/n, and (2) the spec's paired controls at each staleness — decoupled − naive PPO, M2PO − decoupled,
truncated weight − decoupled — as mean of the per-seed differences [95 % t interval], wins k/n. Every number
is read from the JSON `compare` wrote; a variant that has not been run shows as "–".

`--figure` draws the same grid as one panel: final validation accuracy against staleness, a line per
objective (mean over seeds, 95 % t interval of the mean as a bar, each seed as a dot) — the one picture of
E4 that compare's per-step overlay of 15 variants cannot be.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxrl_mismatch.report.paired import paired_cell

OBJECTIVES = ("naive_ppo", "decoupled", "decoupled_m2po", "decoupled_tis")
STALENESS = (0, 1, 2, 4)


def _minus(text: str) -> str:
    return text.replace("-", "−")  # the docs' minus sign


def summary(d: dict) -> str:
    variants = d["variants"]
    head = "| staleness s | " + " | ".join(f"`{o}`" for o in OBJECTIVES) + " |"
    lines = [head, "|" + " --- |" * (len(OBJECTIVES) + 1)]
    for s in STALENESS:
        cells = []
        for obj in OBJECTIVES:
            v = variants.get(f"{obj}_s{s}")
            if v is None:
                cells.append("–")
                continue
            final = v["summary"]["val_final"]
            spread = "" if final["std"] is None else f" ± {final['std']:.3f}"  # one finished seed: no spread
            mean = "–" if final["mean"] is None else f"{final['mean']:.3f}"
            seeds = "" if v["ok"] == v["total"] else f", n={v['ok']}/{v['total']}"
            cells.append(f"{mean}{spread} ({v['collapsed']}/{v['ok']} collapsed{seeds})")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    pairs = d.get("paired_controls", {})
    if pairs:
        lines += ["", "| staleness s | " + " | ".join(
            ["decoupled − naive PPO", "M2PO − decoupled", "truncated weight − decoupled"]) + " |",
            "| --- | --- | --- | --- |"]
        for s in STALENESS:
            cells = []
            for variant, control in ((f"decoupled_s{s}", f"naive_ppo_s{s}"), (f"decoupled_m2po_s{s}", f"decoupled_s{s}"),
                                     (f"decoupled_tis_s{s}", f"decoupled_s{s}")):
                p = pairs.get(f"{variant} vs {control}")
                if p is None:
                    cells.append("–")
                    continue
                cells.append(_minus(paired_cell(p["val_final"], ".3f")))
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(d: dict, path: Path, title: str) -> None:
    """Final validation accuracy vs staleness per objective (see the module docstring), written atomically."""
    from jaxrl_mismatch.report.plot import save_figure  # sets the Agg backend before pyplot loads

    import matplotlib.pyplot as plt
    from jaxrl_mismatch.report.paired import t_interval

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k, obj in enumerate(OBJECTIVES):
        xs, means, errs = [], [], [[], []]
        for s in STALENESS:
            v = d["variants"].get(f"{obj}_s{s}")
            finals = [r["stats"]["val_final"] for r in (v or {}).get("runs", []) if r.get("ok")]
            if not finals:
                continue
            x = s + (k - (len(OBJECTIVES) - 1) / 2) * 0.08  # objectives side by side at each staleness
            mean = sum(finals) / len(finals)
            ci = t_interval(finals) if len(finals) > 1 else None
            xs.append(x)
            means.append(mean)
            errs[0].append(mean - ci[0] if ci else 0.0)
            errs[1].append(ci[1] - mean if ci else 0.0)
            ax.scatter([x] * len(finals), finals, s=9, alpha=0.35, color=f"C{k}")
        if xs:
            ax.errorbar(xs, means, yerr=errs, marker="o", capsize=3, color=f"C{k}", label=obj)
    ax.set_xticks(STALENESS)
    ax.set_xlabel("staleness s (weight versions behind)")
    ax.set_ylabel("final validation accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, "line: mean over seeds; bar: 95 % t interval of the mean; dots: seeds", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save_figure(fig, str(path), dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(Path(__file__).resolve().parents[1] / "docs" / "results"))
    ap.add_argument("--source", default="int8", help="the grid's mismatch source (experiments/e4_staleness.py)")
    ap.add_argument("--figure", default=None, help="also draw final validation vs staleness to this PNG")
    a = ap.parse_args()
    path = Path(a.results) / f"e4_staleness_{a.source}.json"
    if not path.is_file():
        print(f"error: --results/--source: no {path} (run `compare experiments/e4_staleness.py:{a.source}`)",
              file=sys.stderr)
        sys.exit(2)
    if a.figure:  # a new path or an existing figure, never another file (`report.plot.check_figure_out`)
        from jaxrl_mismatch.report.plot import check_figure_out
        from jaxrl_mismatch.usage import exit_on_usage_error

        exit_on_usage_error(check_figure_out, "--figure", a.figure)
    d = json.loads(path.read_text())
    print(summary(d))
    if a.figure:
        figure(d, Path(a.figure), f"E4: {d.get('name', path.stem)}")
        print(f"wrote {a.figure}")


if __name__ == "__main__":
    main()
