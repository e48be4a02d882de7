"""`jaxrl-mismatch report RUN_DIR`: one PNG with panels like the papers' figures.

Panels (LR paper Figs. 1–3, 12; objective-hacking paper Fig. 15): train reward, validation accuracy,
the mismatch indicator log_ppl_abs_diff, ρ std ("mismatch" in the objective-hacking paper), the
length-normalised grad norm, mean response length with the detected surge marked, and the LR.
"""

from __future__ import annotations

import os
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from jaxrl_mismatch.runlog import read_run  # noqa: E402
from jaxrl_mismatch.usage import ArgumentParser, UsageError  # noqa: E402

# (title, metric names tried in order, y scale)
PANELS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("train reward", ("reward/mean",), "linear"),
    ("validation accuracy (avg@k, greedy)", ("val/accuracy",), "linear"),
    ("log_ppl_abs_diff (mismatch indicator)", ("mismatch/log_ppl_abs_diff",), "log"),
    ("ρ std (token ratio π/μ)", ("mismatch/rho_std",), "log"),
    ("grad norm / response length", ("grad/norm_clipped_per_token", "grad/norm"), "log"),
    ("mean response length", ("length/mean",), "linear"),
    ("learning rate", ("lr",), "log"),
)


_SMOOTHED = ("reward/mean", "grad/norm_clipped_per_token", "grad/norm", "mismatch/log_ppl_abs_diff", "mismatch/rho_std")


def _moving_average(ys: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _series(records: list[dict], name: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(name)
        if isinstance(v, (int, float)):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def make_report(run_dir: str, out: str | None = None) -> str:
    """Render `<run_dir>/metrics.jsonl` to a PNG; returns its path."""
    records = read_run(run_dir)
    out = out or os.path.join(run_dir, "report.png")
    surge = [r.get("controller/surge_step", -1) for r in records]
    surge_step = next((s for s in reversed(surge) if isinstance(s, (int, float)) and s >= 0), None)

    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for ax, (title, names, scale) in zip(axes.flat, PANELS):
        name = next((n for n in names if _series(records, n)[0]), None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if name is None:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        xs, ys = _series(records, name)
        marker = "o" if len(xs) < 30 else None
        if name in _SMOOTHED and len(ys) >= 20:
            # Per-step values are noisy (one rollout batch each): show them faintly under a moving average.
            ax.plot(xs, ys, lw=0.8, alpha=0.35)
            ax.plot(xs, _moving_average(ys, 10), lw=2.0, label="10-step mean")
            ax.legend(fontsize=8)
        else:
            ax.plot(xs, ys, marker=marker, lw=1.5, label=name)
        if name == "val/accuracy" and _series(records, "val/greedy_accuracy")[0]:
            gx, gy = _series(records, "val/greedy_accuracy")
            ax.plot(gx, gy, marker=marker, lw=1.5, ls="--", label="val/greedy_accuracy")
            ax.legend(fontsize=8)
        if scale == "log" and min(ys) > 0 and max(ys) > min(ys):
            ax.set_yscale("log")
        if name == "length/mean" and surge_step is not None:
            ax.axvline(surge_step, color="red", ls="--", label=f"surge detected (step {int(surge_step)})")
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    # Last panel: a text summary of the run.
    ax = axes.flat[-1]
    ax.axis("off")
    last = records[-1]
    lines = [f"run: {os.path.basename(os.path.abspath(run_dir))}", f"steps: {last['step'] + 1}"]
    for key in ("reward/mean", "val/accuracy", "mismatch/log_ppl_abs_diff", "lr"):
        xs, ys = _series(records, key)
        if ys:
            lines.append(f"{key}: first {ys[0]:.4g} → last {ys[-1]:.4g}")
    ax.text(0.0, 1.0, "\n".join(lines), va="top", family="monospace", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog="jaxrl-mismatch report", description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/report.png)")
    args = p.parse_args(argv)
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise UsageError(f"--out {args.out}: its directory does not exist")
    print(make_report(args.run_dir, args.out))
    return 0
