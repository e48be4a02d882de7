"""`jaxrl-mismatch analyze`: the dispatcher (jobs/analyze.py) reaches every subcommand module, and bad input
is one line on stderr with exit code 2. The subcommands' own tests: test_analyze_rollouts.py,
test_analyze_softmax.py, test_attribute.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_mismatch.jobs import analyze, analyze_rollouts, analyze_softmax, attribute
from jaxrl_mismatch.usage import UsageError

REPO = Path(__file__).resolve().parents[2]


def test_every_subcommand_parses_into_its_module():
    p = analyze.build_parser()
    assert analyze.SUBCOMMANDS == {"rollouts": analyze_rollouts, "bf16-softmax": analyze_softmax,
                                   "attribute": attribute}
    assert p.parse_args(["bf16-softmax", "--out", "o"]).what == "bf16-softmax"
    assert p.parse_args(["rollouts", "--model", "m", "--out", "o"]).what == "rollouts"
    assert p.parse_args(["attribute", "--model", "m", "--out", "o"]).what == "attribute"
    with pytest.raises(UsageError, match="jaxrl-mismatch analyze attribute"):  # the subcommand's own prog name
        p.parse_args(["attribute", "--out", "o"])


@pytest.mark.slow
def test_cli_prints_one_line_and_exits_2(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")  # an --out folder the command did not write
    softmax = ["analyze", "bf16-softmax", "--out", str(tmp_path)]
    for argv, names in ((["analyze"], ""), ([*softmax, "--vocab", "0"], "--vocab"), (softmax, f"--out {tmp_path}:")):
        p = subprocess.run([sys.executable, "-m", "jaxrl_mismatch.cli", *argv], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], p.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "mine"
