"""Benchmark results are written the way every output of the package is (`benchmarks/_paths.py` on
`outputs.staged_file`): a temporary sibling renamed into place, so an interrupted write keeps the previous
result and leaves no temporary behind; and no benchmark writes its results any other way."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks._paths import write_json, write_text

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_write_json_creates_the_folder_and_leaves_only_the_result(tmp_path):
    out = tmp_path / "new" / "result.json"
    write_json(out, {"tokens_per_s": 1.5})
    assert json.loads(out.read_text()) == {"tokens_per_s": 1.5} and out.read_text().endswith("\n")
    write_text(out.with_suffix(".md"), "| a |\n")
    assert sorted(p.name for p in out.parent.iterdir()) == ["result.json", "result.md"]


def test_a_failed_write_keeps_the_previous_result(tmp_path):
    out = tmp_path / "result.md"
    write_text(out, "previous\n")
    with pytest.raises(TypeError):
        write_text(out, b"not text")  # fails inside the temporary file, after it was created
    assert out.read_text() == "previous\n" and [p.name for p in tmp_path.iterdir()] == ["result.md"]


def test_no_benchmark_writes_a_result_by_hand():
    """Every result file goes through `write_json`/`write_text`: no direct write_text/json.dump/rename."""
    by_hand = re.compile(r"\.write_text\(|json\.dump\(|os\.replace\(|\.replace\(path\)|open\([^)]*[\"']w")
    inputs = ("token_file.write_text(token)",)  # the token of a benchmark's own temporary server: not a result
    offenders = [f"{p.name}:{i}: {line.strip()}" for p in sorted(BENCHMARKS.glob("*.py")) if p.name != "_paths.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if by_hand.search(line) and not any(s in line for s in inputs)]
    assert offenders == []


def test_update_step_refuses_a_bad_flag_in_one_line():
    """A flag that would end in a ZeroDivision/StatisticsError deep in the run is refused up front, exit 2."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(BENCHMARKS / "update_step.py"), "--seq", "16"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: --prompt-len must be in 1..--seq − 1, got 32"]
