"""Benchmark results are written the way every output of the package is (`benchmarks/_paths.py` on
`outputs.staged_file`): a temporary sibling renamed into place, so an interrupted write keeps the previous
result and leaves no temporary behind; no benchmark writes its results any other way; and a benchmark's
`--out` that holds anything but that benchmark's own earlier result is refused before anything is measured."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._paths import check_out, is_result, write_json, write_text

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"


def test_write_json_creates_the_folder_and_leaves_only_the_result(tmp_path):
    out = tmp_path / "new" / "result.json"
    write_json(out, {"tokens_per_s": 1.5}, BENCHMARKS / "packing.py")
    result = json.loads(out.read_text())
    recorded = result.pop("recorded")  # when, and the load then: every result says how quiet its machine was
    assert result == {"benchmark": "benchmarks/packing.py", "tokens_per_s": 1.5}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", recorded["utc"])
    assert len(recorded["loadavg_at_write"]) == 3 and all(x >= 0 for x in recorded["loadavg_at_write"])
    assert out.read_text().endswith("\n")
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
    r = subprocess.run([sys.executable, str(BENCHMARKS / "update_step.py"), "--seq", "16"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: --prompt-len must be in 1..--seq − 1, got 32"]


# -- what --out may hold: nothing, or the same benchmark's earlier result ---------------------------------------------


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=60)


def _refused(r: subprocess.CompletedProcess, path: Path) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: --out {path}: already exists and is not ") and "Traceback" not in r.stderr


def test_a_benchmark_refuses_an_out_that_is_not_its_result_before_measuring(tmp_path):
    """async_profile and async_rollouts (the two that import no JAX: seconds) stop at the check, in one line."""
    readme = tmp_path / "README.md"
    readme.write_text("# my notes\n")
    _refused(_run("async_profile.py", "--out", str(readme)), readme)
    notes = tmp_path / "notes.json"  # async_rollouts' --out is a stem: <stem>.json and <stem>.md
    notes.write_text('{"tokens_per_s": 3}\n')  # JSON, but no benchmark's result
    _refused(_run("async_rollouts.py", "--out", str(tmp_path / "notes")), notes)
    table = tmp_path / "table.md"  # no table.json: the table's name is taken by a file that is not ours
    table.write_text("# my notes\n")
    _refused(_run("async_rollouts.py", "--out", str(tmp_path / "table")), table)
    assert readme.read_text() == table.read_text() == "# my notes\n" and notes.read_text() == '{"tokens_per_s": 3}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "notes.json", "table.md"]


def test_a_benchmark_reruns_over_its_own_result(tmp_path):
    """The check passes for the script's own earlier result: the run goes on to its next check (--model)."""
    out = tmp_path / "async_profile.json"
    write_json(out, {"modes": {}}, BENCHMARKS / "async_profile.py")
    r = _run("async_profile.py", "--out", str(out), "--model", str(tmp_path / "none"))
    assert r.returncode == 2 and r.stderr.startswith(f"error: --model {tmp_path / 'none'}: does not exist"), r.stderr
    write_json(tmp_path / "pair.json", {"loop": {}}, BENCHMARKS / "async_rollouts.py")
    write_text(tmp_path / "pair.md", "# Asynchronous rollouts\n")
    for stem in ("pair", "new"):  # its own result and table, and a new stem
        r = _run("async_rollouts.py", "--out", str(tmp_path / stem), "--model", str(tmp_path / "none"))
        assert r.returncode == 2 and r.stderr.startswith(f"error: --model {tmp_path / 'none'}: "), r.stderr


def test_check_out_refuses_another_benchmarks_result_a_folder_and_a_foreign_file(tmp_path, capsys):
    packing = tmp_path / "packing.json"
    write_json(packing, {"speedup": 2.0}, BENCHMARKS / "packing.py")
    (tmp_path / "dir").mkdir()
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    check_out("--out", packing, BENCHMARKS / "packing.py")  # its own: accepted
    check_out("--out", tmp_path / "new" / "r.json", BENCHMARKS / "packing.py")  # new: accepted
    for path in (packing, tmp_path / "dir", tmp_path / "pyproject.toml"):
        with pytest.raises(SystemExit) as e:
            check_out("--out", path, BENCHMARKS / "update_step.py")
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: --out {path}: ") and err.count("\n") == 1
    assert json.loads(packing.read_text())["speedup"] == 2.0


def test_write_json_checks_out_again_before_writing(tmp_path, capsys):
    """--out is checked when the flags are parsed and again right before the result is written: a file or symbolic
    link that appeared there while the benchmark measured is refused, one line, exit 2, and nothing is written (it
    was replaced: the check ran only at the start)."""
    script = BENCHMARKS / "exact_head_barrier.py"
    out = tmp_path / "r.json"
    check_out("--out", out, script)  # at the start: new, accepted
    out.write_text("# my notes\n")  # ... then, while the benchmark runs, a file of the user's appears there
    with pytest.raises(SystemExit) as e:
        write_json(out, {"ratio": 1.0}, script)
    err = capsys.readouterr()
    assert e.value.code == 2 and err.out == "" and err.err.count("\n") == 1
    assert err.err.startswith(f"error: --out {out}: already exists and is not a result of benchmarks/exact_head_barrier.py")
    assert "checked again before writing the result: nothing was written" in err.err
    assert out.read_text() == "# my notes\n"

    target = tmp_path / "elsewhere.txt"
    target.write_text("keep\n")
    link = tmp_path / "link.json"
    check_out("--out", link, script)
    link.symlink_to(target)  # a symbolic link: the rename would replace the link and leave its target as it was
    with pytest.raises(SystemExit) as e:
        write_json(link, {"ratio": 1.0}, script)
    assert e.value.code == 2 and f"error: --out {link}: is a symbolic link" in capsys.readouterr().err
    assert link.is_symlink() and target.read_text() == "keep\n"

    # with a table: a foreign .md that appeared refuses both, before the JSON is written
    pair = tmp_path / "pair.json"
    check_out("--out", pair, script, table=True)
    (tmp_path / "pair.md").write_text("# mine\n")
    with pytest.raises(SystemExit) as e:
        write_json(pair, {"ratio": 1.0}, script, table="| a |\n")
    assert e.value.code == 2 and f"error: --out {tmp_path / 'pair.md'}: already exists" in capsys.readouterr().err
    assert not pair.exists() and (tmp_path / "pair.md").read_text() == "# mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.txt", "link.json", "pair.md", "r.json"]

    # the script's own earlier result (a rerun) is still replaced, and the file named
    write_json(pair.with_name("own.json"), {"ratio": 1.0}, script)
    write_json(pair.with_name("own.json"), {"ratio": 2.0}, script)
    assert json.loads((tmp_path / "own.json").read_text())["ratio"] == 2.0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'own.json'}\n" * 2


def test_every_committed_result_is_accepted_by_the_script_that_wrote_it():
    """A rerun with the default --out replaces the committed result: each names an existing script."""
    results = sorted(REPO.glob("benchmarks/results/*.json")) + [
        p for p in sorted(REPO.glob("docs/results/*.json")) if "benchmark" in json.loads(p.read_text())]
    assert len(results) >= 15
    for p in results:
        script = BENCHMARKS / Path(json.loads(p.read_text())["benchmark"]).name
        assert script.is_file() and is_result(p, script), p
        assert not is_result(p, BENCHMARKS / "other.py")


def test_every_benchmark_checks_its_out_before_writing():
    """Each script that writes a result also calls `check_out` (the _paths tests above cover what it does)."""
    writers = [p for p in sorted(BENCHMARKS.glob("*.py")) if p.name != "_paths.py" and "write_json(" in p.read_text()]
    assert len(writers) >= 11
    assert [p.name for p in writers if 'check_out("--out", ' not in p.read_text()] == []


# -- every other flag: one line, exit 2, before anything is built -----------------------------------------------------


def test_every_benchmark_parses_with_the_one_line_parser_and_typed_counts():
    """No script builds a plain argparse parser (its errors print the usage block) or takes a bare int/float (a count
    of 0 measured nothing, then failed on an empty median or wrote NaN rates as a result)."""
    scripts = [p for p in sorted(BENCHMARKS.glob("*.py")) if "add_argument(" in p.read_text()]
    assert len(scripts) >= 13
    for p in scripts:
        text = p.read_text()
        assert "argparse.ArgumentParser(" not in text and " ArgumentParser(" in text, p.name
        assert re.search(r"type=(int|float)\b", text) is None, p.name


@pytest.mark.parametrize("script, args, needle", [
    ("async_rollouts.py", ["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    ("async_profile.py", ["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got -1"),
    ("rollout.py", ["--engines", "foo"], "argument --engines: foo: not an engine here"),
    ("update_step_gpu.py", ["--device", "cpu", "--batch-seq", "4y256"], "argument --batch-seq: expected BxS"),
    ("update_step_gpu.py", ["--device", "cpu", "--parts", "foo"], "argument --parts: foo: not a part"),
])
def test_a_bad_flag_is_one_line_before_anything_runs(script, args, needle, tmp_path):
    r = _run(script, *args, "--out", str(tmp_path / "r.json"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert list(tmp_path.iterdir()) == []
