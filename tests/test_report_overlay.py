"""`jaxrl-mismatch report RUN_DIR RUN_DIR ...`: several runs overlaid in the report's panels, one line per run;
and the figure `compare` draws from the same function (mean line and min–max band over seeds)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest

from jaxrl_mismatch.report import plot
from jaxrl_mismatch.runlog import RunWriter
from jaxrl_mismatch.usage import UsageError


def _run(run_dir: Path, reward: float, steps: int = 40) -> Path:
    w = RunWriter(str(run_dir), tensorboard=False)
    w.write(-1, {"val/accuracy": 0.2, "lr": 1e-3})
    for s in range(steps):
        w.write(s, {"reward/mean": reward + 0.01 * (s % 3), "mismatch/log_ppl_abs_diff": 1e-3 * (1 + s),
                    "mismatch/rho_std": 0.1, "length/mean": 10.0 + s, "lr": 1e-3 * 0.99 ** s, "grad/norm": 0.5,
                    **({"val/accuracy": reward, "val/greedy_accuracy": reward + 0.1} if s % 10 == 9 else {})})
    w.close()
    return run_dir


def _has_color(png: Path, rgb: tuple[float, float, float], tol: float = 0.02) -> int:
    """How many pixels of the PNG have (about) this colour."""
    img = matplotlib.image.imread(str(png))[..., :3]
    return int((np.abs(img - np.asarray(rgb)).max(axis=-1) < tol).sum())


def test_overlay_of_two_run_dirs_draws_a_line_per_run(tmp_path, capsys):
    a, b = _run(tmp_path / "runs" / "const", 0.3), _run(tmp_path / "runs" / "decay", 0.6)
    out = tmp_path / "overlay.png"
    assert plot.main([str(a), str(b), "--labels", "constant,decay", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    tab10 = plt.get_cmap("tab10").colors
    # Both runs' lines are in the figure, in the first two colours of the cycle; no third line.
    assert _has_color(out, tab10[0]) > 200 and _has_color(out, tab10[1]) > 200
    assert _has_color(out, tab10[2]) == 0
    # Default output: overlay.png in the runs' common parent, labels from their directory names.
    assert plot.main([str(a), str(b)]) == 0
    assert (tmp_path / "runs" / "overlay.png").stat().st_size > 10_000


def test_overlay_groups_draw_a_band_over_seeds(tmp_path):
    """A group of two seeds gets a shaded min–max band (alpha-blended colour) under its mean line; a group
    of one run gets none."""
    from jaxrl_mismatch.report.summary import series

    seeds = [[{"step": s, "reward/mean": 0.2 + 0.4 * k} for s in range(10)] for k in range(2)]
    single = [[{"step": s, "reward/mean": 0.9} for s in range(10)]]
    out = tmp_path / "bands.png"
    plot.plot_overlay({"two seeds": seeds, "one run": single}, str(out), panels=(("reward", ("reward/mean",), "linear"),))
    tab10 = plt.get_cmap("tab10").colors
    band = tuple(1 - 0.18 * (1 - c) for c in tab10[0])  # fill_between alpha 0.18 over white
    band_single = tuple(1 - 0.18 * (1 - c) for c in tab10[1])
    assert _has_color(out, band, tol=0.01) > 1000 and _has_color(out, band_single, tol=0.01) == 0
    # The mean line of the seeds lies at the mean (0.4), between the band's edges 0.2 and 0.6.
    steps, mean, lo, hi = plot._across([series(r, "reward/mean") for r in seeds])
    assert steps == list(range(10)) and mean == pytest.approx([0.4] * 10) and lo == pytest.approx([0.2] * 10) and hi == pytest.approx([0.6] * 10)


def test_across_uses_the_runs_that_reached_each_step():
    steps, mean, lo, hi = plot._across([([0, 1, 2], [1.0, 2.0, 3.0]), ([0, 1], [3.0, 4.0])])
    assert steps == [0, 1, 2] and mean == [2.0, 3.0, 3.0] and lo == [1.0, 2.0, 3.0] and hi == [3.0, 4.0, 3.0]


def test_overlay_bad_arguments_are_one_line(tmp_path):
    a, b = _run(tmp_path / "a", 0.3, steps=3), _run(tmp_path / "b", 0.4, steps=3)
    with pytest.raises(UsageError, match="--labels: 1 labels for 2 run directories"):
        plot.main([str(a), str(b), "--labels", "x"])
    with pytest.raises(UsageError, match="--labels: labels must be distinct"):
        plot.main([str(a), str(b), "--labels", "x,x"])
    with pytest.raises(UsageError, match="only for an overlay"):
        plot.main([str(a), "--labels", "x"])
    with pytest.raises(UsageError, match="not a run directory"):
        plot.main([str(a), str(tmp_path)])
    with pytest.raises(UsageError, match="--out .*: its directory does not exist"):
        plot.main([str(a), str(b), "--out", str(tmp_path / "no" / "x.png")])


def test_single_run_report_is_unchanged(tmp_path):
    a = _run(tmp_path / "a", 0.3)
    assert plot.main([str(a)]) == 0
    assert (a / "report.png").stat().st_size > 10_000


def test_short_labels_tell_runs_apart():
    assert plot._short_labels(["/x/const/seed_0", "/x/cosine/seed_0"]) == ["const/seed_0", "cosine/seed_0"]
    assert plot._short_labels(["/x/a", "/y/b"]) == ["a", "b"]


@pytest.mark.parametrize("entries, expected", [
    (["val/accuracy"], [plot.PANELS[1]]),
    (["grad/norm"], [plot.PANELS[4]]),  # a fallback name of a known panel picks that panel
    (["policy/entropy"], [("policy/entropy", ("policy/entropy",), "linear")]),
    ([{"metric": ["a", "b"], "title": "t", "scale": "log"}], [("t", ("a", "b"), "log")]),
])
def test_panels_from_spec(entries, expected):
    assert list(plot.panels_from_spec(entries)) == expected


@pytest.mark.parametrize("ext", ["png", "pdf", "svg"])
def test_out_replaces_only_a_figure_this_tool_wrote(tmp_path, ext):
    """A figure of the user's (another tool's plot, a photo) at `--out` or at the default path is refused in one
    line and left as it was; a figure `report` wrote carries a mark in its metadata and is replaced."""
    a, b = _run(tmp_path / "runs" / "a", 0.3, steps=3), _run(tmp_path / "runs" / "b", 0.4, steps=3)
    fig = plt.figure()
    plt.plot([1, 2])
    theirs = tmp_path / f"theirs.{ext}"
    fig.savefig(theirs, format=ext)
    plt.close(fig)
    before = theirs.read_bytes()
    with pytest.raises(UsageError, match=rf"--out .*theirs.{ext}: already exists and is not a .{ext} figure written by"):
        plot.main([str(a), "--out", str(theirs)])
    assert theirs.read_bytes() == before
    ours = tmp_path / f"ours.{ext}"
    assert plot.main([str(a), "--out", str(ours)]) == 0
    first = ours.read_bytes()
    assert plot.main([str(a), str(b), "--out", str(ours)]) == 0 and ours.read_bytes() != first
    # The defaults, RUN_DIR/report.png and the parent's overlay.png, are checked the same way.
    for default, argv in ((a / "report.png", [str(a)]), (tmp_path / "runs" / "overlay.png", [str(a), str(b)])):
        default.write_bytes(theirs.read_bytes() if ext == "png" else b"\x89PNG\r\n\x1a\n a user's picture")
        kept = default.read_bytes()
        with pytest.raises(UsageError, match=r"--out \(default\) .*: already exists"):
            plot.main(argv)
        assert default.read_bytes() == kept
        default.unlink()
        assert plot.main(argv) == 0 and plot.main(argv) == 0  # its own figure: replaced


def test_the_surge_marker_finds_a_combined_controllers_surge_and_a_run_given_twice_is_named(tmp_path):
    """`combine(...)` logs `controller/<i>_<name>/surge_step`: the marker looked for `controller/surge_step` only."""
    combined = [{"step": 0, "controller/0_length_triggered_decay/surge_step": -1.0},
                {"step": 30, "controller/0_length_triggered_decay/surge_step": 20.0,
                 "controller/0_length_triggered_decay/trigger_step": 27.0}]
    assert plot._surge(combined) == (20.0, 27.0)
    assert plot._surge([{"step": 9, "controller/surge_step": 5.0, "controller/trigger_step": -1.0}]) == (5.0, None)
    assert plot._surge([{"step": 0, "controller/surge_step": -1.0}, {"step": 1, "lr": 1.0}]) == (None, None)
    # The newest by step, not by line; a surge step that is no number a figure can mark (runlog's "inf", an
    # integer past a float: an OverflowError drawing it) is no surge.
    newest = [{"step": 30, "controller/surge_step": 20.0}, {"step": 10, "controller/surge_step": 5.0}]
    assert plot._surge(newest) == (20.0, None)
    unmarkable = [{"step": 1, "controller/surge_step": "inf"}, {"step": 2, "controller/surge_step": 10**400}]
    assert plot._surge(unmarkable) == (None, None)
    a = _run(tmp_path / "a", 0.3, steps=3)
    with pytest.raises(UsageError, match=f"RUN_DIR {a}: given twice"):
        plot.main([str(a), str(a)])


def test_out_that_is_a_symlink_is_refused_and_kept(tmp_path):
    """A symbolic link at `--out` or at the default RUN_DIR/report.png — even one to a figure report wrote — is
    refused in one line; it was replaced by a regular file (README: a symbolic link is refused)."""
    a = _run(tmp_path / "a", 0.3, steps=3)
    ours = tmp_path / "ours.png"
    assert plot.main([str(a), "--out", str(ours)]) == 0
    before = ours.read_bytes()
    for link, argv, flag in ((tmp_path / "link.png", [str(a), "--out", str(tmp_path / "link.png")], "--out"),
                             (a / "report.png", [str(a)], r"--out \(default\)")):
        link.symlink_to(ours)
        with pytest.raises(UsageError, match=rf"^{flag} .*{link.name}: is a symbolic link; give the file it points to"):
            plot.main(argv)
        assert link.is_symlink() and ours.read_bytes() == before


def test_a_groups_runs_are_all_smoothed_or_all_raw():
    """A 25-point and a 15-point seed of alternating 0/1 rewards: the group's line is the mean of both seeds'
    10-step means (0.5 from the 10th step on), not of one smoothed seed and one raw (0.25 / 0.75 zigzag), and
    a short group in a panel whose title says "(10-step mean)" is smoothed too."""
    long = [{"step": s, "reward/mean": float(s % 2)} for s in range(25)]
    short = [{"step": s, "reward/mean": float(s % 2)} for s in range(15)]
    fig, ax = plt.subplots()
    line, _, smoothed, _ = plot._draw_group(ax, "reward/mean", [long, short], "C0")
    assert smoothed and np.allclose(line.get_ydata()[9:15], 0.5)
    figs = []
    import unittest.mock
    with unittest.mock.patch.object(plot, "save_figure", lambda f, out, **kw: figs.append(f)), \
            unittest.mock.patch.object(plot.plt, "close"):
        plot.plot_overlay({"long": [long], "short": [short]}, "x.png", panels=(("reward", ("reward/mean",), "linear"),))
    ax = figs[0].axes[0]
    assert ax.get_title() == "reward (10-step mean)"
    short_line = ax.get_lines()[1]
    assert np.allclose(short_line.get_ydata()[9:], 0.5)  # smoothed like the long group's line
    plt.close("all")


def test_report_text_and_bad_steps(tmp_path, capsys):
    """The report's summary says the last step's values (not the last line's), a NaN last value as nan, and a
    400-digit step or value is a skipped line / an inf value, not `error: report: OverflowError` (exit 1)."""
    import unittest.mock

    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "reward/mean": 0.5, "val/accuracy": 0.2} for s in range(5)]
    lines[4]["val/accuracy"] = "nan"
    text = "\n".join(__import__("json").dumps(r) for r in lines)
    text += '\n{"step": 2, "reward/mean": 0.1}\n{"step": ' + "9" * 400 + ', "reward/mean": 1}\n'
    text += '{"step": 5, "reward/mean": ' + "9" * 400 + '}\n{"step": 6, "lr": ' + "9" * 5000 + '}\n'
    (run / "metrics.jsonl").write_text(text)
    figs = []
    with unittest.mock.patch.object(plot, "save_figure", lambda f, out, **kw: figs.append(f)), \
            unittest.mock.patch.object(plot.plt, "close"):
        assert plot.main([str(run)]) == 0
    err = capsys.readouterr().err
    assert "skipped 2 line(s) that are not step records (lines 7, 9)" in err
    summary = figs[0].axes[-1].texts[0].get_text()
    assert "steps: 6" in summary and "val/accuracy: first 0.2 → last nan" in summary
    assert "reward/mean: first 0.5 → last inf" in summary and "reward/mean: 1 step" in summary
    plt.close("all")


def test_moving_average_sums_each_window_on_its_own():
    """A running sum read the 0.01s after a 3e17 spike as 0 and kept an overflow (inf) to the end of the run."""
    from jaxrl_mismatch.report.summary import moving_average

    ys = moving_average([0.01] * 30 + [3e17] + [0.01] * 30, 10)
    assert ys[45:50] == pytest.approx([0.01] * 5) and ys[35] == pytest.approx(3e16)
    assert moving_average([1.0] * 5 + [1e308] * 2 + [1.0] * 20, 2)[-3:] == [1.0, 1.0, 1.0]
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]


def test_a_metric_logged_only_as_nan_is_not_called_unlogged_and_greedy_accuracy_is_still_drawn(tmp_path):
    import unittest.mock

    run = tmp_path / "nanall"
    w = RunWriter(str(run), tensorboard=False)
    for s in range(2):
        w.write(s, {"reward/mean": float("nan"), "val/accuracy": float("nan"), "val/greedy_accuracy": 0.5 + 0.1 * s})
    w.close()
    figs = []
    with unittest.mock.patch.object(plot, "save_figure", lambda f, out, **kw: figs.append(f)), \
            unittest.mock.patch.object(plot.plt, "close"):
        assert plot.main([str(run)]) == 0
    panels = {ax.get_title(): ax for ax in figs[0].axes[:-1]}
    reward = next(ax for t, ax in panels.items() if "reward" in t.lower() and "val" not in t.lower())
    assert [t.get_text() for t in reward.texts] == [plot.NO_FINITE]
    val = next(ax for t, ax in panels.items() if "valid" in t.lower())
    assert [list(ln.get_ydata()) for ln in val.get_lines()] == [pytest.approx([0.5, 0.6])]
    assert not val.texts
    summary = figs[0].axes[-1].texts[0].get_text()
    assert "reward/mean: 2 steps" in summary and "val/accuracy: 2 steps" in summary
    plt.close("all")


def test_an_overlay_names_a_run_it_could_not_draw_and_gives_every_run_its_own_colour(tmp_path):
    import unittest.mock

    good = [{"step": s, "reward/mean": 0.5, "val/greedy_accuracy": 0.3} for s in range(5)]
    diverged = [{"step": s, "reward/mean": float("nan")} for s in range(5)]
    legends = []
    real = plt.Axes.legend

    def spy(ax, *args, **kw):
        legends.append(list(args[1]) if len(args) > 1 else None)
        return real(ax, *args, **kw)

    with unittest.mock.patch.object(plt.Axes, "legend", spy):
        plot.plot_overlay({"good": [good], "diverged": [diverged]}, str(tmp_path / "o.png"),
                          panels=(("reward", ("reward/mean",), "linear"), ("val", ("val/accuracy",), "linear")))
    assert legends == [["good", "diverged (no finite value in any panel)"]]
    many = {f"run{i}": [[{"step": s, "reward/mean": float(i)} for s in range(3)]] for i in range(22)}
    colours = []
    real_draw = plot._draw_group
    with unittest.mock.patch.object(plot, "_draw_group", lambda ax, n, runs, c, sm=None: (
            colours.append(tuple(np.round(c, 6))), real_draw(ax, n, runs, c, sm))[1]):
        plot.plot_overlay(many, str(tmp_path / "many.png"), panels=(("reward", ("reward/mean",), "linear"),))
    assert len(colours) == 22 and len(set(colours)) == 22
    plt.close("all")
