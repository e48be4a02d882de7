"""The command line as a stranger meets it: every subcommand's --help works, and every bad input ends as
one line `error: ...` naming the flag, field or file, exit code 2, and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.child_env import child_env

pytestmark = pytest.mark.slow  # every test here runs the command line in a new process

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny_cpu.py")


def cli(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    e = child_env(JAX_PLATFORMS="cpu", **(env or {}))
    return subprocess.run([sys.executable, "-m", "jaxrl_mismatch.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=e)


def assert_one_line_error(out: subprocess.CompletedProcess, *needles: str, code: int = 2) -> None:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_python_dash_m_runs_the_same_command_line():
    """`python -m jaxrl_mismatch` (what cli.py's usage mentions) had no __main__ module."""
    e = child_env()
    ok = subprocess.run([sys.executable, "-m", "jaxrl_mismatch", "--help"], capture_output=True, text=True, cwd=REPO,
                        env=e, timeout=60)
    assert ok.returncode == 0 and "usage: jaxrl-mismatch" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "jaxrl_mismatch", "nosuch"], capture_output=True, text=True, cwd=REPO,
                         env=e, timeout=60)
    assert_one_line_error(bad, "unknown command 'nosuch'")


@pytest.mark.parametrize("command", ["train", "serve", "report", "export", "compare", "analyze", "warmstart",
                                     "perfectible"])
def test_every_subcommand_has_a_working_help(command):
    out = cli(command, "--help")
    assert out.returncode == 0 and "Traceback" not in out.stderr
    assert f"jaxrl-mismatch {command}" in out.stdout and "--" in out.stdout


def test_top_level_help_lists_commands_and_unknown_command_is_one_line():
    out = cli("--help")
    assert out.returncode == 0 and all(c in out.stdout for c in ("train", "serve", "export"))
    assert_one_line_error(cli("trian"), "unknown command 'trian'")
    bare = cli()  # no command: exit 0 before, as if something had run
    assert bare.returncode == 2 and not bare.stdout and "commands:" in bare.stderr


@pytest.mark.parametrize("args, needles", [
    (["train"], ["--config"]),
    (["train", "--config", "configs/nope.py"], ["--config configs/nope.py", "does not exist"]),
    (["train", "--config", CONFIG, "--config.optim.lrr=1"], ["config.optim.lrr", "did you mean config.optim.lr"]),
    (["train", "--config", CONFIG, "--config.optim.lr=abc"], ["config.optim.lr", "'abc'"]),
    (["train", "--config", CONFIG, "--config.batch.dynamic_sampling=maybe"], ["config.batch.dynamic_sampling"]),
    (["train", "--config", CONFIG, "--config.task.name=gsm8k"], ["config.task.files.train"]),
    (["train", "--config", CONFIG, "--config.controller.kwargs.surge_ratio=abc"], ["config.controller.kwargs"]),
    (["train", "--config", CONFIG, "--config.controller.kwargs.no_such_knob=1"], ["config.controller.kwargs", "no_such_knob"]),
    (["train", "--config", CONFIG, "--config.objective.overrides.eps_hi=0.3"], ["config.objective", "eps_hi"]),
    (["train", "--config", CONFIG, "--config.optim.schedule=cosine", "--config.optim.schedule_kwargs.decay_stepz=5"],
     ["config.optim.schedule_kwargs", "decay_stepz"]),
    (["train", "--config", CONFIG, "--config.model.path=/nonexistent", "--config.model.warmstart_if_missing=false"],
     ["config.model.path", "/nonexistent"]),
    (["train", "--config", CONFIG, "--bogus"], ["--bogus"]),
    (["train", "--config", CONFIG, "--config.steps"], ["--config.steps needs a value"]),
    (["report", "/tmp"], ["/tmp", "not a run directory"]),
    (["report"], ["RUN_DIR"]),
    (["compare", "experiments/nope.py"], ["experiments/nope.py"]),
    (["analyze", "bf16-softmax", "--vocab", "0", "--out", "/tmp/bf16sim"], ["--vocab"]),
    (["export", "/tmp", "--out", "/tmp/export_out"], ["RUN_DIR /tmp"]),
    (["serve", "--model", "/tmp", "--token-file", "/nonexistent/token"], ["--token-file /nonexistent/token"]),
    (["serve", "--model", "/tmp", "--port", "99999"], ["--port", "99999"]),
    (["serve", "--model", "/nonexistent"], ["--model /nonexistent"]),
    (["serve", "--model", "/tmp", "--engine", "sglang"], ["--engine", "sglang"]),
    (["perfectible", "--out", "x.jsonl"], ["--model"]),
    (["warmstart", "--out", "/tmp/ws", "--steps", "0"], ["--steps"]),
    (["warmstart", "--out", "/tmp/ws", "--seed", "-1"], ["--seed must be in [0, 2^31), got -1"]),
    (["train", "--config", CONFIG, "--config.seed=-1"], ["config.seed"]),
    (["warmstart", "--out", "/tmp/ws", "--lr", "-1"], ["--lr must be a number > 0"]),
    (["warmstart", "--out", "/tmp/ws", "--weight-decay", "nan"], ["--weight-decay"]),
    (["warmstart", "--out", "/tmp/ws", "--hidden", "30", "--heads", "4"], ["--hidden 30", "--heads 4"]),
    (["warmstart", "--out", "/etc/passwd/ws"], ["--out /etc/passwd/ws", "is a file"]),
    (["perfectible", "--model", "/tmp", "--max-tokens", "8", "--file", "/nonexistent", "--out", "/tmp/p.jsonl"],
     ["--file /nonexistent", "arithmetic"]),
    (["perfectible", "--model", "/tmp", "--max-tokens", "8", "--task", "gsm8k", "--file", "/nonexistent",
      "--out", "/tmp/p.jsonl"], ["--file /nonexistent", "does not exist"]),
    (["perfectible", "--model", "/tmp", "--max-tokens", "8", "--address", "localhost", "--out", "/tmp/p.jsonl"],
     ["--address 'localhost'", "host:port"]),
    (["perfectible", "--model", "/tmp", "--max-tokens", "8", "--temperature", "-1", "--out", "/tmp/p.jsonl"],
     ["--temperature"]),
    (["perfectible", "--model", "/tmp", "--max-tokens", "8", "--ready-timeout", "0", "--out", "/tmp/p.jsonl"],
     ["--ready-timeout must be a number > 0"]),
    (["perfectible", "--model", "/tmp", "--max-tokens", "8", "--split", "nosuch", "--out", "/tmp/p.jsonl"],
     ["--split nosuch", "train, validation, test"]),
    (["serve", "--model", "/tmp", "--host", "256.1.1.1"], ["--host 256.1.1.1", "not an IP address"]),
    # checked before the model loads (the ready file was written after READY was printed: rc 1, a traceback)
    (["serve", "--model", "/tmp", "--grace-s", "nan"], ["--grace-s", "got nan"]),
    (["serve", "--model", "/tmp", "--engine", "vllm", "--gpu-memory-utilization", "1.5"],
     ["--gpu-memory-utilization", "(0, 1]", "got 1.5"]),
    (["serve", "--model", "/tmp", "--engine", "vllm", "--gpu-memory-utilization", "0"],
     ["--gpu-memory-utilization", "got 0.0"]),
    (["serve", "--model", "/tmp", "--gpu-memory-utilization", "0.5"], ["--gpu-memory-utilization", "vllm only"]),
    (["serve", "--model", "/tmp", "--ready-file", "/nonexistent/dir/x"], ["--ready-file /nonexistent/dir/x",
                                                                        "does not exist"]),
    (["serve", "--model", "/tmp", "--ready-file", "/tmp"], ["--ready-file /tmp", "is a directory"]),
    (["train", "--config", CONFIG, "--config.rollout.address=10.0.0.5"], ["config.rollout.address", "host:port"]),
    (["report", "/etc/passwd"], ["/etc/passwd", "is a file"]),
    (["train", "--config", CONFIG, "--config.run_dir=/etc/passwd"], ["config.run_dir", "/etc/passwd is a file"]),
    (["train", "--config", CONFIG, "--config.run_dir=/etc/passwd/run"], ["config.run_dir", "not a directory"]),
])
def test_bad_input_is_one_line_exit_2(args, needles, tmp_path):
    # Keep any run directory a failing command might create inside tmp_path.
    if args[:1] == ["train"] and "--config" in args and len(args) > 2:
        extra = [f"--config.run_dir={tmp_path / 'run'}"]
        if not any(a.startswith("--config.model.path") for a in args):
            extra.append(f"--config.model.path={tmp_path / 'base'}")
        args = [*args[:3], *extra, *args[3:]]
    out = cli(*args)
    assert_one_line_error(out, *needles)
    assert not (tmp_path / "base").exists() and not (tmp_path / "run").exists()  # nothing started or written


def test_responses_longer_than_the_model_context_are_refused_before_any_rollout(tiny_base_model_h64, tmp_path):
    """The rollout server failed at step 0 (exit 3, a step-0 checkpoint that a corrected rerun then refused as
    a config change); now one line naming the field and the model's context."""
    import json

    context = json.loads((tiny_base_model_h64 / "config.json").read_text())["max_position_embeddings"]
    out = cli("train", "--config", CONFIG, f"--config.run_dir={tmp_path / 'run'}",
              f"--config.model.path={tiny_base_model_h64}", f"--config.rollout.max_tokens={context}")
    assert_one_line_error(out, "config.rollout.max_tokens", f"max_position_embeddings {context}")
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    # A response that fits alone but not after the task's longest prompt: exit 3 at the first rollout, after the
    # run directory, its lock and checkpoints folder were made. Refused once the prompts are tokenised.
    out = cli("train", "--config", CONFIG, f"--config.run_dir={tmp_path / 'run'}",
              f"--config.model.path={tiny_base_model_h64}", f"--config.rollout.max_tokens={context - 2}")
    assert_one_line_error(out, "config.rollout.max_tokens: the task's longest prompt (",
                          f"+ max_tokens ({context - 2}) exceeds {tiny_base_model_h64}'s max_position_embeddings")
    assert not (tmp_path / "run").exists()


def test_an_external_rollout_server_nobody_serves_is_exit_3_with_one_line(tiny_base_model_h64, tmp_path):
    """It was exit 1 ("not a usage error", a traceback) after rollout.startup_timeout_s."""
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    out = cli("train", "--config", CONFIG, f"--config.run_dir={tmp_path / 'run'}",
              f"--config.model.path={tiny_base_model_h64}", "--config.rollout.address=127.0.0.1:1",
              f"--config.rollout.token_file={token}", "--config.rollout.startup_timeout_s=3")
    assert_one_line_error(out, "rollout server unavailable at the start (step 0)", "127.0.0.1:1", code=3)
    assert not (tmp_path / "run").exists()  # "nothing was trained or written": its lock and checkpoints/ were left
    token.write_text("  \n")  # an empty token file: refused (exit 2), and the run directory goes too
    out = cli("train", "--config", CONFIG, f"--config.run_dir={tmp_path / 'run'}",
              f"--config.model.path={tiny_base_model_h64}", "--config.rollout.address=127.0.0.1:1",
              f"--config.rollout.token_file={token}", "--config.rollout.startup_timeout_s=3")
    assert_one_line_error(out, "token", code=2)
    assert not (tmp_path / "run").exists()


def test_a_damaged_model_config_is_one_line_naming_the_file(tmp_path):
    """A config.json that is not JSON was a traceback (exit 1) from inside the trainer's start."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], ')
    out = cli("train", "--config", CONFIG, f"--config.run_dir={tmp_path / 'run'}", f"--config.model.path={model}",
              "--config.model.warmstart_if_missing=false")
    assert_one_line_error(out, "config.model.path", f"{model / 'config.json'} is not valid JSON")
    assert not (tmp_path / "run").exists()  # refused before the trainer made (and locked) the run directory


def test_perfectible_with_no_server_at_address_says_so_after_its_ready_timeout(tiny_base_model_h64, tmp_path):
    """It waited 600 s without a word, then failed with a traceback."""
    out = cli("perfectible", "--model", str(tiny_base_model_h64), "--max-tokens", "8", "--num", "4",
              "--address", "127.0.0.1:1", "--ready-timeout", "2", "--out", str(tmp_path / "p.jsonl"))
    assert_one_line_error(out, "--address 127.0.0.1:1: no rollout server ready there within 2 s")
    assert "waiting up to 2 s" in out.stdout and not list(tmp_path.iterdir())


def test_perfectible_with_a_damaged_tokenizer_is_one_line(tiny_base_model, tmp_path):
    import shutil

    model = shutil.copytree(tiny_base_model, tmp_path / "model")  # config and weights fine, the tokenizer damaged
    (model / "tokenizer.json").write_text('{"version": ')
    out = cli("perfectible", "--model", str(model), "--max-tokens", "8", "--num", "4", "--out", str(tmp_path / "p.jsonl"))
    assert_one_line_error(out, f"--model {model}", "is not a readable tokenizer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_train_refuses_a_run_dir_it_did_not_write_and_an_empty_one(tmp_path):
    """A folder of the user's (here their own metrics.jsonl, which a fresh run used to delete) is refused
    before anything is written; compare's per-run status and log are a harness's and accepted."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text('{"step": 0, "mine": 1}\n')
    out = cli("train", "--config", CONFIG, f"--config.run_dir={mine}", f"--config.model.path={tmp_path / 'base'}")
    assert_one_line_error(out, "config.run_dir", "non-empty directory not written by `jaxrl-mismatch train`",
                          "metrics.jsonl")
    assert sorted(p.name for p in mine.iterdir()) == ["metrics.jsonl"]
    assert (mine / "metrics.jsonl").read_text() == '{"step": 0, "mine": 1}\n'
    assert not (tmp_path / "base").exists()
    assert_one_line_error(cli("train", "--config", CONFIG, "--config.run_dir="), "config.run_dir: empty")


@pytest.mark.parametrize("flag, devices, needles", [
    ("--config.trainer.mesh.data=3", 1, ["config.trainer.mesh", "3 devices"]),
    # 3 prompts x 8 samples / 4 minibatches = 6 rows over the batch's 8 devices: XLA refused the first update
    # only after the warm start, the model load and a rollout
    ("--config.batch.prompts_per_step=3", 8, ["config.batch", "minibatch of 6 rows", "8 devices", "data=8"]),
])
def test_mesh_or_batch_that_does_not_fit_the_devices_fails_before_the_warm_start(flag, devices, needles, tmp_path):
    out = cli("train", "--config", CONFIG, flag, f"--config.run_dir={tmp_path / 'run'}",
              f"--config.model.path={tmp_path / 'base'}",
              env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
    assert_one_line_error(out, *needles)
    assert not (tmp_path / "base").exists()  # the warm start never ran


def test_broken_config_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config(:\n")
    assert_one_line_error(cli("train", "--config", str(bad)), f"--config {bad}", "line 1")
    none = tmp_path / "none.py"
    none.write_text("x = 1\n")
    assert_one_line_error(cli("train", "--config", str(none)), "get_config")
    exits = tmp_path / "exits.py"  # exited 3 with no word of why
    exits.write_text("import sys\n\ndef get_config():\n    sys.exit(3)\n")
    assert_one_line_error(cli("train", "--config", str(exits)), f"--config {exits}: cannot load it: it called sys.exit(3)")
    text = tmp_path / "config.txt"  # a file not ending in .py: an AttributeError traceback (no loader found)
    text.write_text("def get_config(:\n")
    assert_one_line_error(cli("train", "--config", str(text)), f"--config {text}", "line 1")


def test_report_names_skipped_lines_and_refuses_garbage_and_bad_outputs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(b"garbage\n[1, 2]\n\xff\xfe\n{\"loss\": 1}\n")
    assert_one_line_error(cli("report", str(run)), "metrics.jsonl", "no step records", "4 line(s)", "lines 1, 2, 3, 4")
    (run / "metrics.jsonl").write_bytes(b'{"step": 0, "reward/mean": 0.1}\nnot json\n{"step": 1, "reward/mean": 0.2}\n{"st')
    (tmp_path / "notes.png").write_text("my notes, not a figure")
    for out, needle in (("x.txt", "unsupported figure format .txt"), ("notes.png", "already exists")):
        assert_one_line_error(cli("report", str(run), "--out", str(tmp_path / out)), f"--out {tmp_path / out}", needle)
    assert (tmp_path / "notes.png").read_text() == "my notes, not a figure"
    assert_one_line_error(cli("report", str(run), "--out", ""), "--out: empty")  # it wrote the default path
    assert not (run / "report.png").exists()
    ok = cli("report", str(run), "--out", str(tmp_path / "r.png"))
    assert ok.returncode == 0, ok.stderr
    assert [line for line in ok.stderr.splitlines() if line.strip()] == [
        f"warning: {run / 'metrics.jsonl'}: skipped 2 line(s) that are not step records (lines 2, 4)"]
    assert (tmp_path / "r.png").read_bytes().startswith(b"\x89PNG")
    assert cli("report", str(run), "--out", str(tmp_path / "r.png")).returncode == 0  # its own figure: replaced
    assert sorted(os.listdir(tmp_path)) == ["notes.png", "r.png", "run"]  # no temporary left


def test_serve_checks_max_model_len_and_an_unbindable_host_before_loading(tmp_path):
    """--max-model-len beyond the model's context named --model after the load began; --host 8.8.8.8 --port 0
    printed gRPC's own C-level error line before ours."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 128}')
    env = {"JAXRL_ROLLOUT_TOKEN": "t"}
    assert_one_line_error(cli("serve", "--model", str(model), "--max-model-len", "100000", env=env),
                          "--max-model-len: 100000 exceeds the model's context", "max_position_embeddings 128")
    assert_one_line_error(cli("serve", "--model", str(model), "--host", "8.8.8.8", "--port", "0", env=env),
                          "--host 8.8.8.8: cannot bind")
    (model / "config.json").write_text("[]")  # with --max-model-len: AttributeError 'list' has no 'get' (exit 1)
    assert_one_line_error(cli("serve", "--model", str(model), "--max-model-len", "100", env=env),
                          f"--model {model}: ", "holds a JSON list, not an object")


@pytest.mark.parametrize("engine", ["jax", "vllm"])
def test_serve_refuses_a_model_folder_without_usable_weights_before_any_engine_starts(tiny_base_model, tmp_path,
                                                                                        engine):
    """A checkpoint folder without its weights, or with a garbled file: the vLLM engine failed after 10 s of
    start-up (its warnings first, then a three-line pydantic error; a stranger's review), the jax engine after
    binding and announcing its port. Now refused before either starts, one line naming the folder or file."""
    import shutil

    env = {"JAXRL_ROLLOUT_TOKEN": "t"}
    bare, garbled = tmp_path / "bare", tmp_path / "garbled"
    for d in (bare, garbled):
        shutil.copytree(tiny_base_model, d)
    for f in bare.glob("*.safetensors"):
        f.unlink()
    next(garbled.glob("*.safetensors")).write_bytes(b"not a safetensors file")
    out = cli("serve", "--engine", engine, "--model", str(bare), "--port", "0", env=env)
    assert_one_line_error(out, f"--model {bare}: no *.safetensors files in {bare}")
    assert "JAXRL_ROLLOUT_LISTENING" not in out.stdout
    assert_one_line_error(cli("serve", "--engine", engine, "--model", str(garbled), "--port", "0", env=env),
                          f"--model {garbled}", "is not a readable safetensors file")


def test_serve_port_in_use_is_one_line(tmp_path):
    import socket

    token = tmp_path / "token"
    token.write_text("t\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        out = cli("serve", "--model", "/tmp", "--token-file", str(token), "--port", str(port))
    assert_one_line_error(out, f"--port {port}", "cannot bind")


def test_serve_never_replaces_a_file_it_did_not_write_at_its_ready_file(tmp_path):
    """--ready-file replaced whatever was at the path (a user's notes too); now only an earlier server's ready file."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 128}')
    env = {"JAXRL_ROLLOUT_TOKEN": "t"}
    mine = tmp_path / "notes.json"
    mine.write_text('{"port": 1, "my": "notes"}')
    assert_one_line_error(cli("serve", "--model", str(model), "--ready-file", str(mine), env=env),
                          f"--ready-file {mine}: already exists and is not a ready file of an earlier serve")
    assert mine.read_text() == '{"port": 1, "my": "notes"}'
    earlier = tmp_path / "ready.json"  # an earlier server's: passes, and the next check speaks
    earlier.write_text('{"port": 1, "written_by": "jaxrl-mismatch serve"}')
    assert_one_line_error(cli("serve", "--model", str(model), "--ready-file", str(earlier), "--max-model-len",
                              "100000", env=env), "--max-model-len: 100000 exceeds the model's context")
    from jaxrl_mismatch.rollout.server import READY_PREFIX, _announce, _check_ready_file

    _announce(READY_PREFIX, {"port": 5}, str(mine.with_name("written.json")))  # what serve writes, it may replace
    _check_ready_file(str(mine.with_name("written.json")))
    # no temporary file left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "notes.json", "ready.json", "written.json"]


def test_a_file_the_command_may_not_read_is_one_line_exit_2_naming_it(tmp_path, monkeypatch, capsys):
    """An unreadable input (chmod 000 for a non-root user) was exit 1 with two lines ("not a usage error"). Root
    reads any file, so the refusal is raised here as the opening of a task file raises it."""
    from jaxrl_mismatch import cli
    from jaxrl_mismatch.data import math_datasets

    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt_text": "1+1=", "answer": "2"}\n')

    def denied(p, *a, **k):
        raise PermissionError(13, "Permission denied", str(p))

    monkeypatch.setattr(math_datasets, "open", denied, raising=False)
    with pytest.raises(math_datasets.DataFormatError, match=f"{path}: cannot read it \\(Permission denied\\)"):
        list(math_datasets.read_jsonl(str(path), "prompts"))
    # any other read or write the command's code does not check itself: one line naming the file, exit 2
    monkeypatch.setattr("jaxrl_mismatch.jobs.export.main", lambda argv: denied(tmp_path / "ckpt"))
    assert cli.main(["export", "x"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'ckpt'}: Permission denied\n"


@pytest.mark.parametrize("text", ["1,,2", "1,", ",", ""])
def test_an_integer_list_with_an_empty_entry_is_refused(text):
    """`analyze bf16-softmax --seeds 1,,2` ran seeds 1 and 2 (exit 0): the empty entries were dropped."""
    from jaxrl_mismatch.usage import UsageError, int_list

    with pytest.raises(UsageError, match="--seeds: expected"):
        int_list("--seeds", text)
    assert int_list("--seeds", "1, 2") == [1, 2]


def test_a_fifo_or_a_directory_given_for_a_file_is_named_as_what_it_is(tmp_path):
    """A FIFO given as --config was reported as "no such file" (and as "is a file" where a directory was expected):
    the one line now says what the path is."""
    import os

    from jaxrl_mismatch.usage import UsageError, existing_dir, existing_file, path_kind

    fifo = tmp_path / "config.py"
    os.mkfifo(fifo)
    assert (path_kind(str(fifo)), path_kind(str(tmp_path)), path_kind(str(tmp_path / "x"))) == (
        "is a FIFO", "is a directory", "does not exist")
    assert path_kind(str(fifo / "x")) == "does not exist (a folder on its path is a file)"
    with pytest.raises(UsageError, match="is a FIFO; expected a directory"):
        existing_dir("--model", str(fifo))
    with pytest.raises(UsageError, match="is a directory; expected a file"):
        existing_file("--prompt-ids", str(tmp_path))
    from jaxrl_mismatch.outputs import check_out_dir
    from jaxrl_mismatch.runlog import read_run

    with pytest.raises(UsageError, match="is a FIFO, not a directory"):
        check_out_dir("--out", str(fifo), "export", force=False)
    with pytest.raises(UsageError, match="is a FIFO, not a run directory"):
        read_run(str(fifo))
    assert_one_line_error(cli("train", "--config", str(fifo)), f"--config {fifo}: is a FIFO; expected a Python file")


@pytest.mark.parametrize("args, said", [
    (["export", "runs/r1", "--out", "e7", "--out", "e8"], "export: --out given twice; give --out once"),
    (["export", "runs/r1", "--step", "1", "--out", "e", "--step=2"], "export: --step given twice"),
    (["report", "runs/r1", "--out", "a.png", "--ou", "b.png"], "report: --out and --ou both given; give --out once"),
    (["train", "--config", CONFIG, "--config", CONFIG], "train: --config given twice"),
    (["serve", "--port", "1", "--port", "2"], "serve: --port given twice"),
    (["compare", "spec.py", "--jobs", "1", "--jobs", "2"], "compare: --jobs given twice"),
    (["warmstart", "--steps", "1", "--steps", "2"], "warmstart: --steps given twice"),
    (["analyze", "rollouts", "--model", "m", "--model", "n"], "analyze rollouts: --model given twice"),
])
def test_an_option_given_twice_is_refused_not_the_last_taken(args, said, capsys):
    """argparse let the last one win: `export --out e7 --out e8` exported to e8 without a word."""
    from jaxrl_mismatch import cli

    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: jaxrl-mismatch {said}") and err.count("\n") == 1, err


def test_options_meant_to_repeat_and_a_subcommands_own_options_are_not_repeats():
    from jaxrl_mismatch.usage import ArgumentParser

    p = ArgumentParser(prog="p")
    p.add_argument("--tag", action="append")
    p.add_argument("-v", action="count", default=0)
    p.add_argument("--out")
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("go").add_argument("--out")
    args = p.parse_args(["--tag", "a", "--tag", "b", "-v", "-v", "--out", "x", "go", "--out", "y"])
    assert (args.tag, args.v, args.out) == (["a", "b"], 2, "y")  # the subcommand's --out is its own
