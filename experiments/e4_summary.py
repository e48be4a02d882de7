"""E4's summary in the shape of AReaL's table: staleness down, objectives across, from the grid's results.

    python experiments/e4_summary.py [--results docs/results] [--source int8]

`compare experiments/e4_staleness.py[:SOURCE]` writes one long table (docs/results/e4_staleness_SOURCE.md).
This prints (1) final validation accuracy per staleness × objective, mean ± sample std over the seeds with the
collapses k/n, and (2) the spec's paired controls at each staleness — decoupled − naive PPO, M2PO − decoupled,
truncated weight − decoupled — as mean of the per-seed differences [95 % t interval], wins k/n. Every number
is read from the JSON `compare` wrote; a variant that has not been run shows as "–".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
            cells.append(f"{final['mean']:.3f} ± {final['std']:.3f} ({v['collapsed']}/{v['ok']} collapsed)")
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
                c = p["val_final"]
                cells.append(_minus(f"{c['mean']:+.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}], {c['wins']}/{c['n']}"))
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=str(Path(__file__).resolve().parents[1] / "docs" / "results"))
    ap.add_argument("--source", default="int8", help="the grid's mismatch source (experiments/e4_staleness.py)")
    a = ap.parse_args()
    path = Path(a.results) / f"e4_staleness_{a.source}.json"
    if not path.is_file():
        print(f"error: --results/--source: no {path} (run `compare experiments/e4_staleness.py:{a.source}`)",
              file=sys.stderr)
        sys.exit(2)
    print(summary(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
