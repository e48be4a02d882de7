"""`jaxrl-mismatch report RUN_DIR [RUN_DIR ...]`: PNG figures with panels like the papers' figures.

Panels (LR paper Figs. 1–3, 12; objective-hacking paper Fig. 15): train reward, validation accuracy,
the mismatch indicator log_ppl_abs_diff, ρ std ("mismatch" in the objective-hacking paper), the
length-normalised grad norm, mean response length with the detected surge marked, and the LR.

One run directory gives that run's report (`make_report`). Several give an overlay (`plot_overlay`): the
same panels, one line per run — and `jaxrl-mismatch compare` draws its grid with the same function, one
line per variant (mean over seeds) with a band over the seeds, as in the LR paper's Figs. 1/3 and the FP16
paper's Fig. 1. Noisy per-step series are drawn as a moving average in both.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from jaxrl_mismatch.report.summary import by_step, moving_average, series, value  # noqa: E402
from jaxrl_mismatch.runlog import read_run  # noqa: E402
from jaxrl_mismatch.outputs import check_out_file, staged_file  # noqa: E402
from jaxrl_mismatch.usage import ArgumentParser, UsageError  # noqa: E402

# File signatures of the figure formats a report is written in, and the mark every figure written here carries in
# its metadata (PNG "Software", PDF/SVG "Creator"): an existing file is replaced only when it is a figure with the
# mark, so `--out` never overwrites a user's own figure (a photo, another tool's plot) that happens to be a PNG.
_SIGNATURES = {"png": (b"\x89PNG\r\n\x1a\n",), "pdf": (b"%PDF",), "svg": (b"<?xml", b"<svg")}
FIGURE_MARK = "jaxrl-mismatch figure"
_MAX_FIGURE_BYTES = 64 << 20  # larger than any figure written here: not read


def _is_our_figure(path: str) -> bool:
    """Whether `path` holds a figure of the format its name says whose metadata carries the mark `save_figure`
    writes: the PNG `Software` text chunk, the SVG `<metadata>` creator, the PDF document-information `/Creator`.
    Only that metadata is read: a user's figure that merely shows the words (a title, a comment) is not ours."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    try:
        if os.path.getsize(path) > _MAX_FIGURE_BYTES:
            return False
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return False
    if not any(data.startswith(sig) for sig in _SIGNATURES.get(ext, ())):
        return False
    reader = {"png": _png_software, "svg": _svg_creator, "pdf": _pdf_creator}[ext]
    try:
        return reader(data) == FIGURE_MARK
    except Exception:  # noqa: BLE001 - damaged or foreign content is simply not our figure
        return False


def _png_software(data: bytes) -> str | None:
    """The `Software` text of a PNG (matplotlib writes `metadata` as tEXt chunks), read by Pillow, matplotlib's own
    image library; None when it has none."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return getattr(im, "text", {}).get("Software")


_SVG, _DC = "{http://www.w3.org/2000/svg}", "{http://purl.org/dc/elements/1.1/}"


def _svg_creator(data: bytes) -> str | None:
    """The creator matplotlib writes in an SVG's top-level `<metadata>` (RDF `dc:creator/cc:Agent/dc:title`)."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(data)
    if root.tag != f"{_SVG}svg":
        return None
    for meta in root.findall(f"{_SVG}metadata"):
        for title in meta.iterfind(f".//{_DC}creator//{_DC}title"):
            return (title.text or "").strip()
    return None


_PDF_INFO = re.compile(rb"/Info\s+(\d+)\s+(\d+)\s+R")


def _pdf_creator(data: bytes) -> str | None:
    """The `/Creator` string of the document-information dictionary the PDF's last trailer names (`/Info N G R`):
    the object is found through the cross-reference table matplotlib writes, so text anywhere else does not count."""
    trailer = data.rfind(b"trailer")
    info = _PDF_INFO.search(data, trailer) if trailer >= 0 else None
    start = data.rfind(b"startxref")
    if info is None or start < 0:
        return None
    xref = int(data[start + len(b"startxref"):].split()[0])
    if not data.startswith(b"xref", xref):
        return None
    num, gen = int(info.group(1)), int(info.group(2))
    lines = data[xref:trailer].split(b"\n")
    first, count = (int(v) for v in lines[1].split()[:2])  # one subsection, "0 N", as matplotlib writes
    if not first <= num < first + count:
        return None
    offset = int(lines[2 + num - first].split()[0])
    head = re.match(rb"\s*%d\s+%d\s+obj\s*<<(.*?)>>" % (num, gen), data[offset:offset + 4096], re.S)
    creator = re.search(rb"/Creator\s*\(((?:[^()\\]|\\.)*)\)", head.group(1), re.S) if head else None
    return creator.group(1).decode("latin-1") if creator else None


def check_figure_out(flag: str, out: str) -> None:
    """UsageError unless `out` names a figure file (.png, .pdf, .svg) that may be written (see outputs)."""
    ext = os.path.splitext(out)[1].lower().lstrip(".")
    if ext not in _SIGNATURES:
        raise UsageError(f"{flag} {out}: unsupported figure format {('.' + ext) if ext else '(no extension)'}; "
                         "use .png, .pdf or .svg")
    check_out_file(flag, out, ours=_is_our_figure, what=f"a .{ext} figure written by jaxrl-mismatch")


def save_figure(fig, out: str, **kwargs) -> None:
    """`fig.savefig` into a temporary sibling renamed to `out` (never a half-written figure), with the mark that
    lets a later `--out` replace it."""
    fmt = os.path.splitext(out)[1].lower().lstrip(".") or "png"
    metadata = {"Software": FIGURE_MARK} if fmt == "png" else {"Creator": FIGURE_MARK}
    with staged_file(out) as tmp:
        fig.savefig(tmp, format=fmt, metadata=metadata, **kwargs)

# (title, metric names tried in order, y scale)
Panel = tuple[str, tuple[str, ...], str]
PANELS: tuple[Panel, ...] = (
    ("train reward", ("reward/mean",), "linear"),
    ("validation accuracy (avg@k, greedy)", ("val/accuracy",), "linear"),
    ("log_ppl_abs_diff (mismatch indicator)", ("mismatch/log_ppl_abs_diff",), "log"),
    ("ρ std (token ratio π/μ)", ("mismatch/rho_std",), "log"),
    ("grad norm / response length", ("grad/norm_clipped_per_token", "grad/norm"), "log"),
    ("mean response length", ("length/mean",), "linear"),
    ("learning rate", ("lr",), "log"),
)


_SMOOTHED = ("reward/mean", "grad/norm_clipped_per_token", "grad/norm", "mismatch/log_ppl_abs_diff", "mismatch/rho_std")
SMOOTH_WINDOW, SMOOTH_MIN_POINTS = 10, 20  # per-step values are noisy (one rollout batch each)


def _logged_name(runs: Sequence[Sequence[Mapping[str, Any]]], names: Sequence[str]) -> str | None:
    """The first of a panel's metric names that any of `runs` logged with a finite value, else the first logged
    only as NaN/inf (the panel says so: a diverged metric is not "not logged"), else None."""
    return next((n for n in names if any(series(r, n)[0] for r in runs)),
                next((n for n in names if any(series(r, n, finite=False)[0] for r in runs)), None))


NO_FINITE = "logged, but NaN/inf only"


# Overlays show only the smoothed line (no faint raw series under it), so the response length, which the
# single-run report draws raw for the controller's sake, is smoothed there too.
_SMOOTHED_IN_OVERLAYS = (*_SMOOTHED, "length/mean")


def _smoothed(name: str, ys: list[float], which: Sequence[str] = _SMOOTHED) -> bool:
    return name in which and len(ys) >= SMOOTH_MIN_POINTS


def _finish_axis(ax, scale: str, ys: Sequence[float]) -> None:
    # A log axis only where it shows something: positive values that vary (a flat series stays linear).
    if scale == "log" and ys and min(ys) > 0 and max(ys) > min(ys):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def _surge(records: Sequence[Mapping[str, Any]]) -> tuple[float | None, float | None]:
    """(onset, detection step) of the newest length surge a controller logged: `controller/surge_step` and
    `controller/trigger_step`, or a combined controller's `controller/<i>_<name>/surge_step` and its sibling."""
    def step(v: Any) -> float | None:  # a step to mark: a finite number >= 0 (-1: none)
        v = value(v)
        return v if v is not None and math.isfinite(v) and v >= 0 else None

    for r in reversed(by_step(records)):
        for key, v in r.items():
            if key.startswith("controller/") and key.endswith("surge_step") and step(v) is not None:
                return step(v), step(r.get(key[: -len("surge_step")] + "trigger_step"))
    return None, None


def make_report(run_dir: str, out: str | None = None) -> str:
    """Render `<run_dir>/metrics.jsonl` to a PNG; returns its path."""
    records = read_run(run_dir)
    out = out or os.path.join(run_dir, "report.png")
    surge_step, detected = _surge(records)

    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for ax, (title, names, scale) in zip(axes.flat, PANELS):
        name = _logged_name([records], names)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if name is None:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        xs, ys = series(records, name)
        gx, gy = series(records, "val/greedy_accuracy") if name == "val/accuracy" else ([], [])
        if not xs and not gx:
            ax.text(0.5, 0.5, NO_FINITE, ha="center", va="center", transform=ax.transAxes)
            continue
        marker = "o" if len(xs) < 30 else None
        if _smoothed(name, ys):
            # Per-step values are noisy (one rollout batch each): show them faintly under a moving average.
            ax.plot(xs, ys, lw=0.8, alpha=0.35)
            ax.plot(xs, moving_average(ys, SMOOTH_WINDOW), lw=2.0, label=f"{SMOOTH_WINDOW}-step mean")
            ax.legend(fontsize=8)
        elif xs:
            ax.plot(xs, ys, marker=marker, lw=1.5, label=name)
        if gx:  # drawn even where sampled accuracy is NaN at every evaluation
            ax.plot(gx, gy, marker="o" if len(gx) < 30 else None, lw=1.5, ls="--", label="val/greedy_accuracy")
            ax.legend(fontsize=8)
        if name == "length/mean" and surge_step is not None:
            ax.axvline(surge_step, color="red", ls="--", label=f"surge onset (step {int(surge_step)}"
                       + (f", detected at {int(detected)})" if detected is not None else ")"))
            ax.legend(fontsize=8)
        _finish_axis(ax, scale, ys + gy)
    # Last panel: a text summary of the run.
    ax = axes.flat[-1]
    ax.axis("off")
    last = by_step(records)[-1]  # the last step, not the last line
    lines = [f"run: {os.path.basename(os.path.abspath(run_dir))}", f"steps: {last['step'] + 1}"]
    for key in ("reward/mean", "val/accuracy", "mismatch/log_ppl_abs_diff", "lr"):
        xs, ys = series(records, key, finite=False)  # as the table has them: a NaN last value is shown as nan
        if ys:
            lines.append(f"{key}: first {ys[0]:.4g} → last {ys[-1]:.4g}")
    skipped = {key: len(series(records, key, finite=False)[0]) - len(series(records, key)[0])
               for key in dict.fromkeys([*(key for _, names, _ in PANELS for key in names), "val/greedy_accuracy"])}
    if any(skipped.values()):  # the panels cannot draw them: say so rather than let a gap pass unnoticed
        lines += ["not drawn (NaN/inf):",
                  *(f"  {key}: {n} step{'s' if n > 1 else ''}" for key, n in skipped.items() if n)]
    ax.text(0.0, 1.0, "\n".join(lines), va="top", family="monospace", fontsize=9)
    fig.tight_layout()
    save_figure(fig, out, dpi=90)
    plt.close(fig)
    return out


# -- overlays: several runs (or groups of seeds) in the same panels ------------------------------------
def panels_from_spec(entries: Any, field: str = "metrics") -> tuple[Panel, ...]:
    """Panels from a list of entries, each a metric name (its panel in `PANELS` if it has one, else a
    linear panel of that metric) or a dict {"metric": name or [names tried in order], "title": str,
    "scale": "linear" | "log"}. UsageError naming `field[i]` for a bad entry."""
    if not isinstance(entries, (list, tuple)) or not entries:
        raise UsageError(f"{field}: must be a non-empty list of metric names or panel dicts, got {entries!r}")
    panels = []
    for i, e in enumerate(entries):
        where = f"{field}[{i}]"
        if isinstance(e, str) and e:
            panels.append(next((p for p in PANELS if e in p[1]), (e, (e,), "linear")))
            continue
        if not isinstance(e, Mapping):
            raise UsageError(f"{where}: must be a metric name or a dict with 'metric', got {e!r}")
        unknown = sorted(set(e) - {"metric", "title", "scale"})
        if unknown:
            raise UsageError(f"{where}: unknown key {unknown[0]!r}; valid: metric, title, scale")
        names = e.get("metric")
        names = (names,) if isinstance(names, str) else tuple(names) if isinstance(names, (list, tuple)) else ()
        if not names or not all(isinstance(n, str) and n for n in names):
            raise UsageError(f"{where}.metric: must be a metric name or a non-empty list of them, got {e.get('metric')!r}")
        scale = e.get("scale", "linear")
        if scale not in ("linear", "log"):
            raise UsageError(f"{where}.scale: must be 'linear' or 'log', got {scale!r}")
        panels.append((str(e.get("title", names[0])), names, scale))
    return tuple(panels)


def _curve(records: Sequence[Mapping[str, Any]], name: str, smooth: bool) -> tuple[list[int], list[float], bool]:
    """(steps, values drawn, smoothed?) of one run's metric; `smooth` is decided for the whole panel
    (`_smooth_panel`), so the runs averaged into one line are all smoothed or all raw."""
    xs, ys = series(records, name)
    if smooth:
        return xs, moving_average(ys, SMOOTH_WINDOW), True
    return xs, ys, False


def _smooth_panel(name: str, runs: Sequence[Sequence[Mapping[str, Any]]]) -> bool:
    """Whether a panel's runs are drawn as moving averages: a noisy metric that some run logged at
    `SMOOTH_MIN_POINTS` steps or more. Every run of the panel then is, shorter ones too (a mean of smoothed and
    raw seeds is neither, and the title says "10-step mean")."""
    return any(_smoothed(name, series(r, name)[1], _SMOOTHED_IN_OVERLAYS) for r in runs)


def _across(curves: Sequence[tuple[list[int], list[float]]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, min, max) over the curves at each step any of them has (a run that stopped early
    leaves the statistics of the later steps to the others)."""
    at: dict[int, list[float]] = {}
    for xs, ys in curves:
        for x, y in zip(xs, ys):
            at.setdefault(x, []).append(y)
    steps = sorted(at)
    return (steps, [sum(at[s]) / len(at[s]) for s in steps], [min(at[s]) for s in steps], [max(at[s]) for s in steps])


def _draw_group(ax, name: str, runs: Sequence[Sequence[Mapping[str, Any]]], color,
                smooth: bool | None = None) -> tuple[Any, list[float], bool, bool]:
    """One group's mean line (and min–max band over its runs) of metric `name`, its runs all smoothed or all
    raw (`smooth`; None: as `_smooth_panel` decides for these runs); (line or None, the values drawn,
    smoothed?, greedy drawn?). In the validation panel, greedy accuracy is a dashed mean line, as in the
    single-run report."""
    smooth = _smooth_panel(name, runs) if smooth is None else smooth
    curves = [c for c in (_curve(r, name, smooth) for r in runs) if c[0]]
    greedy = [c for c in (series(r, "val/greedy_accuracy") for r in runs) if c[0]] if name == "val/accuracy" else []
    line, values = None, []
    if curves:
        steps, mean, lo, hi = _across([(c[0], c[1]) for c in curves])
        (line,) = ax.plot(steps, mean, color=color, lw=1.6, marker="o" if len(steps) < 30 else None, ms=3)
        if len(curves) > 1:
            ax.fill_between(steps, lo, hi, color=color, alpha=0.18, lw=0)
        values = lo + hi
    if greedy:  # drawn even where sampled accuracy is NaN at every evaluation
        gx, gy, _, _ = _across(greedy)
        (dashed,) = ax.plot(gx, gy, color=color, lw=1.2, ls="--", marker="o" if len(gx) < 30 else None, ms=2)
        line, values = line or dashed, values + gy
    return line, values, any(c[2] for c in curves), bool(greedy)


def plot_overlay(groups: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], out: str, *,
                 panels: Sequence[Panel] = PANELS, title: str | None = None) -> str:
    """One panel per metric, one line per group: the mean over the group's runs (seeds) with a shaded
    min–max band where a group has several runs. `groups`: label -> the step records of each run.
    Returns `out`."""
    # tab20 repeats from the 21st line on: more groups get as many evenly spaced colours of a continuous map
    colors = (plt.get_cmap("tab10" if len(groups) <= 10 else "tab20").colors if len(groups) <= 20
              else plt.get_cmap("turbo")(np.linspace(0.0, 1.0, len(groups))))
    ncols = 4
    nrows = math.ceil((len(panels) + 1) / ncols)  # +1: the legend's cell
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.9 * nrows), squeeze=False)
    all_runs = [r for runs in groups.values() for r in runs]
    handles, dashed = {}, False
    for ax, (panel_title, names, scale) in zip(axes.flat, panels):
        ax.set_xlabel("step")
        name = _logged_name(all_runs, names)
        if name is None:
            ax.set_title(panel_title, fontsize=10)
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        drawn, smoothed = [], False
        if not any(series(r, name)[0] or (name == "val/accuracy" and series(r, "val/greedy_accuracy")[0])
                   for r in all_runs):
            ax.set_title(panel_title, fontsize=10)
            ax.text(0.5, 0.5, NO_FINITE, ha="center", va="center", transform=ax.transAxes)
            continue
        smooth_all = _smooth_panel(name, all_runs)  # one choice for every line of the panel: the title says it
        for i, (label, runs) in enumerate(groups.items()):
            line, values, smooth, greedy = _draw_group(ax, name, runs, colors[i % len(colors)], smooth_all)
            if line is not None:
                handles.setdefault(label, (line, len(runs)))
            drawn, smoothed, dashed = drawn + values, smoothed or smooth, dashed or greedy
        ax.set_title(panel_title + (f" ({SMOOTH_WINDOW}-step mean)" if smoothed else ""), fontsize=10)
        _finish_axis(ax, scale, drawn)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for i, (label, runs) in enumerate(groups.items()):  # a run drawn in no panel (all NaN) is still named
        if label not in handles:
            handles[f"{label} (no finite value in any panel)"] = (
                Line2D([], [], color=colors[i % len(colors)], lw=1.6, ls=":"), len(runs))
    notes = ["line: mean over seeds; band: min–max over seeds"] if any(len(r) > 1 for r in groups.values()) else []
    notes += ["dashed: greedy validation accuracy"] if dashed else []
    axes.flat[len(panels)].legend(
        [h for h, _ in handles.values()],
        [f"{label} ({n} runs)" if n > 1 else label for label, (_, n) in handles.items()],
        loc="upper left", fontsize=9, frameon=False, title="\n".join(notes) or None, title_fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, out, dpi=90)
    plt.close(fig)
    return out


def _short_labels(run_dirs: Sequence[str]) -> list[str]:
    """The shortest path suffixes that tell the run directories apart (`cosine/seed_0`, not `seed_0`)."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in run_dirs]
    for k in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return list(run_dirs)


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgumentParser(prog="jaxrl-mismatch report", description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--labels", default=None,
                   help="comma-separated legend labels, one per RUN_DIR (several run directories; default: the "
                        "shortest path suffixes that tell them apart)")
    p.add_argument("--out", default=None,
                   help="PNG path (default RUN_DIR/report.png; for several runs overlay.png in their common parent)")
    args = p.parse_args(argv)
    if args.out is not None and not args.out.strip():  # it fell back to the default path, unlike every other --out
        raise UsageError("--out: empty; give a .png/.pdf/.svg path or leave the flag out for the default")
    real = [os.path.realpath(d) for d in args.run_dirs]
    if twice := next((d for d, r in zip(args.run_dirs, real) if real.count(r) > 1), None):
        raise UsageError(f"RUN_DIR {twice}: given twice; an overlay takes each run directory once")
    parent = os.path.commonpath([os.path.abspath(d) for d in args.run_dirs])
    default = os.path.join(args.run_dirs[0], "report.png") if len(args.run_dirs) == 1 else os.path.join(parent, "overlay.png")
    out, flag = (args.out, "--out") if args.out else (default, "--out (default)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        if args.out:  # (a default's directory is a RUN_DIR, which reading the run checks and names below)
            raise UsageError(f"{flag} {out}: its directory does not exist")
    else:
        check_figure_out(flag, out)  # the default path too: a figure of the user's there is never replaced
    if len(args.run_dirs) == 1:
        if args.labels is not None:
            raise UsageError("--labels: only for an overlay of several run directories")
        print(make_report(args.run_dirs[0], out))
        return 0
    labels = _short_labels(args.run_dirs) if args.labels is None else [s.strip() for s in args.labels.split(",")]
    if len(labels) != len(args.run_dirs):
        raise UsageError(f"--labels: {len(labels)} labels for {len(args.run_dirs)} run directories")
    if len(set(labels)) != len(labels) or not all(labels):
        raise UsageError(f"--labels: labels must be distinct and non-empty, got {args.labels!r}")
    groups = {label: [read_run(d)] for label, d in zip(labels, args.run_dirs)}
    print(plot_overlay(groups, out))
    return 0
