"""Every figure of `analyze` (report/analysis.py: rollouts, bf16-softmax; jobs/attribute.py) is written through
`report.plot.save_figure`: a temporary sibling renamed into place, so a failure while writing keeps the
previous figure and leaves no temporary behind."""

from __future__ import annotations

import collections

import matplotlib.figure
import numpy as np
import pytest

from jaxrl_mismatch.jobs import attribute
from jaxrl_mismatch.models.model import CAPTURED
from jaxrl_mismatch.report import analysis


def _pairs(out: str) -> None:
    summary = collections.defaultdict(lambda: 0.25)  # every key the panels read
    dump = {"logp_train": np.log([0.5, 0.2, 0.9]), "logp_rollout": np.log([0.4, 0.25, 0.9])}
    analysis.plot_pairs([("fp32:bfloat16", dump, summary, np.array([3, 5]), np.array([0.1, -0.2]))], ["pi_low"], out)


def _softmax(out: str) -> None:
    rng = np.random.default_rng(0)
    p = rng.uniform(0.01, 1.0, size=50)
    setting = {"dtype": "bfloat16", "vocab": 8, "scale": 1.0, "tokens": 50, "logits": "per-token"}
    analysis.plot_softmax_simulation([(p, p * rng.uniform(0.99, 1.01, size=50))], [0], setting, out)


def _attribution(out: str) -> None:
    res = {"trainer": "fp32", "engine": "bfloat16", "divergence": {"layer 0": {c: 1e-3 for c in CAPTURED}},
           "ablations": {attribute.BASELINE: {"mismatch/log_ppl_abs_diff": 1e-3},
                         "lm_head": {"mismatch/log_ppl_abs_diff": 5e-4}}}
    attribute.plot([res], out)


@pytest.mark.parametrize("draw", [_pairs, _softmax, _attribution])
def test_a_failed_figure_write_keeps_the_previous_figure(draw, tmp_path, monkeypatch):
    out = tmp_path / "figure.png"
    draw(str(out))
    previous = out.read_bytes()
    assert previous.startswith(b"\x89PNG")

    def fail_midway(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"half a figure")
        raise OSError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        draw(str(out))
    assert out.read_bytes() == previous and [p.name for p in tmp_path.iterdir()] == ["figure.png"]


def test_log_axes_draw_when_every_log_prob_is_zero(tmp_path):
    """Greedy sampling of a confident model: every log-prob 0 gave the log-axes hexbin an empty extent and
    `--axes log` ended in "Invalid vmin or vmax" after the table was printed (a review's case)."""
    summary = collections.defaultdict(lambda: 0.25)
    dump = {"logp_train": np.zeros(8), "logp_rollout": np.zeros(8)}
    out = tmp_path / "pairs.png"
    analysis.plot_pairs([("fp32:float32", dump, summary, np.array([4, 4]), np.zeros(2))], ["pi_low"], str(out),
                        axes="log")
    assert out.stat().st_size > 0
