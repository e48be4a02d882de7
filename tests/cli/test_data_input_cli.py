"""The data review's findings as a user meets them on the command line: bad task data, an output path that is a
FIFO, a user's figure that merely mentions the report's mark. Each ends as one line `error: ...` naming the file (and
line), exit code 2, no traceback; none starts a rollout server, hangs, or replaces a file it did not write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_mismatch import cli as jcli
from jaxrl_mismatch.data.tokenizer import build_arithmetic_tokenizer, save_tokenizer
from jaxrl_mismatch.rollout.session import RolloutSession
from jaxrl_mismatch.runlog import RunWriter
from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[2]
NO_SERVER = "127.0.0.1:1"  # perfectible --address: the prompts are refused before it is tried


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command line in a new process; a hang (a FIFO opened for reading) fails the test at `timeout`."""
    env = child_env(JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxrl_mismatch.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def one_line_error(rc: int, stderr: str, *needles: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 2, (rc, stderr)
    assert "Traceback" not in stderr and len(lines) == 1 and lines[0].startswith("error: "), stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _jsonl(path: Path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GOOD = {"prompt_text": "1+1=", "answer": "2"}

TRAIN_CONFIG = """
import sys
sys.path.insert(0, {repo!r})
from configs.tiny_cpu import get_config as base

def get_config():
    c = base()
    c.run_dir, c.steps = {run!r}, 1
    c.model.path, c.model.warmstart_if_missing = {model!r}, False
    c.task.name = "arithmetic_prompts"
    c.task.files.train, c.task.files.validation = {train!r}, {val!r}
    c.task.num_val = 2
    c.rollout.group_size, c.rollout.max_tokens = 2, 24
    c.batch.prompts_per_step, c.batch.minibatches, c.batch.microbatches = 2, 1, 1
    c.batch.dynamic_sampling = False
    return c
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["float_answer", "empty_file"])
def test_train_refuses_bad_task_data_before_any_rollout(tiny_base_model, tmp_path, monkeypatch, case):
    """A gold answer the arithmetic reward cannot read failed after the rollout server had started (exit 1 "gold
    answer '4.0' is not an integer"); an empty task file was TFDS's AssertionError (exit 1)."""
    val = _jsonl(tmp_path / "val.jsonl", GOOD, GOOD)
    if case == "float_answer":
        train, needle = _jsonl(tmp_path / "train.jsonl", GOOD, "", {"prompt_text": "2+2=", "answer": 4.0}), ":3: "
        why = "arithmetic reward: gold answer '4.0' is not an integer"
    else:
        train, needle, why = str(tmp_path / "train.jsonl"), ": ", "no records"
        Path(train).write_text("\n  \n")
    config = tmp_path / "cfg.py"
    config.write_text(TRAIN_CONFIG.format(repo=str(REPO), run=str(tmp_path / "run"), model=str(tiny_base_model),
                                          train=train, val=val))
    out = cli("train", "--config", str(config), timeout=240)
    one_line_error(out.returncode, out.stderr, f"config.task.files: {train}{needle}{why}")
    assert not (tmp_path / "run" / "tfds").exists()  # refused before the dataset was built


def test_train_refuses_a_bad_task_line_before_the_warm_start(tmp_path):
    """The task files were read only when the dataset was built: after the warm start of a missing model (50 s for
    configs/tiny_cpu.py), which left its checkpoint behind. Now refused first, nothing created."""
    val = _jsonl(tmp_path / "val.jsonl", GOOD, GOOD)
    train = _jsonl(tmp_path / "train.jsonl", GOOD, "", {"prompt_text": "2+2=", "answer": 4.0})
    model, run = tmp_path / "model", tmp_path / "run"
    config = tmp_path / "cfg.py"
    config.write_text(TRAIN_CONFIG.format(repo=str(REPO), run=str(run), model=str(model), train=train, val=val)
                      .replace("    return c\n", "    c.model.warmstart_if_missing = True\n    return c\n"))
    out = cli("train", "--config", str(config), timeout=240)
    one_line_error(out.returncode, out.stderr,
                   f"config.task.files: {train}:3: arithmetic reward: gold answer '4.0' is not an integer")
    assert "warm start" not in out.stdout, out.stdout
    assert not model.exists() and not run.exists()


@pytest.mark.slow
def test_train_names_a_prompt_outside_the_vocabulary_in_one_line_after_the_build(tiny_base_model, tmp_path):
    """Found only once the dataset is built (it needs the tokenizer): TFDS's progress bars and its "custom data
    configuration" warning came first on stderr, so the error was the last of a dozen lines."""
    train = _jsonl(tmp_path / "train.jsonl", GOOD, GOOD)
    val = _jsonl(tmp_path / "val.jsonl", GOOD, {"prompt_text": "x+1=", "answer": "3"})
    config = tmp_path / "cfg.py"
    config.write_text(TRAIN_CONFIG.format(repo=str(REPO), run=str(tmp_path / "run"), model=str(tiny_base_model),
                                          train=train, val=val))
    out = cli("train", "--config", str(config), timeout=240)
    one_line_error(out.returncode, out.stderr, f"config.task.files: {val}:2: prompt: text 'x+1=' has characters "
                                               "outside the tokenizer's vocabulary")
    # The run directory this start created goes again, dataset build and all: a rerun with the file mended was
    # refused ("a non-empty directory not written by jaxrl-mismatch train (holds tfds)").
    assert not (tmp_path / "run").exists()


@pytest.fixture
def tokenizer_dir(tmp_path) -> str:
    d = tmp_path / "model"
    save_tokenizer(build_arithmetic_tokenizer(), str(d))
    return str(d)


@pytest.fixture
def no_launch(monkeypatch):
    def launch(**kwargs):
        raise AssertionError(f"a rollout server was started ({kwargs})")

    monkeypatch.setattr(RolloutSession, "launch", staticmethod(launch))
    monkeypatch.setattr(RolloutSession, "attach", staticmethod(launch))


@pytest.mark.parametrize("row, needle", [
    ({"prompt_text": "2+2=", "answer": 4.0}, "arithmetic reward: gold answer '4.0' is not an integer"),
    ({"prompt_text": "2+2=", "answer": True}, "field 'answer' should be a string or a number, got bool"),
    ({"prompt_text": "", "answer": "3"}, "field 'prompt_text' is empty"),
    ({"prompt_text": "x+1=", "answer": "1"}, "prompt: text 'x+1=' has characters outside the tokenizer's vocabulary"),
])
def test_perfectible_refuses_bad_records_naming_file_and_line(tokenizer_dir, tmp_path, capsys, no_launch, row, needle):
    """Each was an exit 1 (the reward's ValueError, the tokenizer's) or the rollout server's failure, after it had
    started."""
    data = _jsonl(tmp_path / "p.jsonl", GOOD, "", row)
    out = tmp_path / "kept.jsonl"
    rc = jcli.main(["perfectible", "--model", tokenizer_dir, "--task", "arithmetic_prompts", "--file", data,
                    "--max-tokens", "8", "--address", NO_SERVER, "--ready-timeout", "1", "--out", str(out)])
    one_line_error(rc, capsys.readouterr().err, f"--file {data}:3: {needle}")
    assert not out.exists()


@pytest.mark.parametrize("force", [False, True])
def test_perfectible_out_that_is_a_fifo_is_refused_without_opening_it(tokenizer_dir, tmp_path, force):
    """With --force it was opened to see whether perfectible wrote it: a FIFO blocked there for good."""
    fifo = tmp_path / "kept.jsonl"
    os.mkfifo(fifo)
    data = _jsonl(tmp_path / "p.jsonl", GOOD)
    out = cli("perfectible", "--model", tokenizer_dir, "--task", "arithmetic_prompts", "--file", data,
              "--max-tokens", "8", "--address", NO_SERVER, "--out", str(fifo), *(["--force"] if force else []),
              timeout=60)
    one_line_error(out.returncode, out.stderr, f"--out {fifo}: is a named pipe (FIFO), not a regular file")
    assert fifo.is_fifo()


def _run(run_dir: Path) -> Path:
    w = RunWriter(str(run_dir), tensorboard=False)
    for s in range(3):
        w.write(s, {"reward/mean": 0.1 * s, "lr": 1e-3})
    w.close()
    return run_dir


def test_report_out_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    """`report` read the FIFO to see whether it was its own figure and hung for ever, at --out and at the default
    RUN_DIR/report.png alike."""
    run = _run(tmp_path / "run")
    fifo = tmp_path / "r.png"
    os.mkfifo(fifo)
    out = cli("report", str(run), "--out", str(fifo), timeout=60)
    one_line_error(out.returncode, out.stderr, f"--out {fifo}: is a named pipe (FIFO), not a regular file")
    os.mkfifo(run / "report.png")
    out = cli("report", str(run), timeout=60)
    one_line_error(out.returncode, out.stderr, f"{run / 'report.png'}: is a named pipe (FIFO)")
    assert fifo.is_fifo() and (run / "report.png").is_fifo()


@pytest.mark.parametrize("name, content", [
    ("mine.svg", b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10">'
                 b"<!-- made by hand, not a jaxrl-mismatch figure --><text>jaxrl-mismatch figure</text></svg>\n"),
    ("mine.pdf", b"%PDF-1.4\n1 0 obj\n<< /Title (jaxrl-mismatch figure) >>\nendobj\n"
                 b"trailer\n<< /Root 1 0 R >>\n%%EOF\n"),
    ("mine.png", b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x15IDATjaxrl-mismatch figure\x00\x00\x00\x00"),
])
def test_report_does_not_replace_a_users_figure_that_merely_holds_the_mark_text(tmp_path, name, content):
    """The whole file was searched for "jaxrl-mismatch figure": a user's SVG with the words in a title or comment
    was replaced. Only the metadata `report` writes counts (PNG Software, PDF /Creator, SVG creator)."""
    run = _run(tmp_path / "run")
    mine = tmp_path / name
    mine.write_bytes(content)
    out = cli("report", str(run), "--out", str(mine), timeout=60)
    one_line_error(out.returncode, out.stderr, f"--out {mine}: already exists and is not a .{name[-3:]} figure")
    assert mine.read_bytes() == content  # a figure report wrote is still replaced: tests/test_report_overlay.py
