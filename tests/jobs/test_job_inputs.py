"""What the job subcommands read from a user's model folder and flags, refused before any work in one line naming
the flag and the file (exit 2): a damaged task.json, config.json or safetensors file, a seed outside [0, 2^31), a
stop id outside the vocabulary, task flags given with --prompt-ids (ignored, yet recorded as used), and
`perfectible --address` with an --engine / --dtype the server does not run. Each was an exit 1 from deep inside a
job, a traceback-like line after a rollout server had started, or silently ignored (the jobs review's
reproductions)."""

from __future__ import annotations

import os
import shutil

import pytest

from jaxrl_mismatch import cli


def _run(capsys, *argv: str) -> tuple[int, list[str]]:
    rc = cli.main(list(argv))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return rc, err


def _refused(capsys, needles, *argv: str) -> None:
    rc, err = _run(capsys, *argv)
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    for n in needles:
        assert n in err[0], (n, err[0])


@pytest.fixture
def model(tiny_base_model, tmp_path):
    """A private copy of the session's warm start (config, weights, tokenizer, task.json) to damage."""
    return shutil.copytree(tiny_base_model, tmp_path / "model")


def _nothing_written(tmp_path) -> None:
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no --out, no server folder beside it


@pytest.mark.parametrize("content, needle", [
    ("{broken", "task.json is not readable JSON"),
    ("[1, 2]", "task.json: expected a JSON object with a 'spec' object"),
    ('{"spec": {"bogus": 1}}', "task.json: unknown spec field(s) ['bogus']"),
    ('{"spec": {"max_value": 0}}', "task.json: ArithmeticSpec.max_value must be >= 1"),
])
def test_a_damaged_task_json_is_one_line_naming_it(model, tmp_path, capsys, content, needle):
    (model / "task.json").write_text(content)
    out = str(tmp_path / "out")
    _refused(capsys, [f"--model {model}", needle], "analyze", "rollouts", "--model", str(model), "--out", out)
    _refused(capsys, [f"--model {model}", needle], "analyze", "attribute", "--model", str(model), "--task",
             "arithmetic", "--out", out)
    _refused(capsys, [f"--model {model}", needle], "perfectible", "--model", str(model), "--max-tokens", "8",
             "--out", str(tmp_path / "p.jsonl"))
    _nothing_written(tmp_path)


def test_a_damaged_config_or_weights_file_is_one_line_before_any_server(model, tmp_path, capsys):
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a truncated copy
    for argv in (("analyze", "rollouts", "--model", str(model), "--out", str(tmp_path / "o")),
                 ("analyze", "attribute", "--model", str(model), "--task", "arithmetic", "--out", str(tmp_path / "o")),
                 ("perfectible", "--model", str(model), "--max-tokens", "8", "--out", str(tmp_path / "p.jsonl"))):
        _refused(capsys, [f"--model {model}", "model.safetensors is not a readable safetensors file"], *argv)
    weights.write_bytes(data)
    (model / "config.json").write_text("{not json")
    _refused(capsys, [f"--model {model}: cannot read config.json"], "analyze", "rollouts", "--model", str(model),
             "--out", str(tmp_path / "o"))
    _nothing_written(tmp_path)


def test_weights_written_for_another_config_are_one_line_before_any_server(model, tmp_path, capsys):
    """config.json changed after the weights were written (another width, one layer more, or a tensor the model
    does not have): each was an exit 1 from load_hf after a rollout server had started (the analyze review's
    finding 3). The check reads the safetensors headers only."""
    import json

    from safetensors.numpy import load_file, save_file

    config = json.loads((model / "config.json").read_text())
    argv = ("analyze", "rollouts", "--model", str(model), "--out", str(tmp_path / "o"))
    for field, value, needle in (
            ("intermediate_size", config["intermediate_size"] * 2, "has shape"),
            ("num_hidden_layers", config["num_hidden_layers"] + 1,
             f"checkpoint is missing tensor 'model.layers.{config['num_hidden_layers']}."),
    ):
        (model / "config.json").write_text(json.dumps({**config, field: value}))
        _refused(capsys, [f"--model {model}", needle, "for its config.json's" if needle == "has shape" else
                          "that its config.json's"], *argv)
        _refused(capsys, [f"--model {model}", needle], "perfectible", "--model", str(model), "--max-tokens", "8",
                 "--out", str(tmp_path / "p.jsonl"))
    (model / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(model / "model.safetensors"))
    save_file({**tensors, "model.extra.weight": tensors["model.norm.weight"]}, str(model / "model.safetensors"))
    _refused(capsys, [f"--model {model}", "checkpoint has tensor 'model.extra.weight'", "does not use"], *argv)
    save_file(tensors, str(model / "model.safetensors"))  # the untouched folder passes the check (the job starts)
    from jaxrl_mismatch.models.config import ModelConfig
    from jaxrl_mismatch.models.hf_io import check_model_files

    check_model_files(model, ModelConfig.from_hf(str(model)))
    _nothing_written(tmp_path)


def test_seeds_stop_ids_and_prompt_flags_are_checked_up_front(model, tmp_path, capsys):
    ids = tmp_path / "ids.jsonl"
    ids.write_text("[3, 4, 5]\n")
    out = str(tmp_path / "o")
    for seed in ("99999999999999999999", "-1"):
        _refused(capsys, [f"--seed must be in [0, 2^31), got {seed}"], "analyze", "rollouts", "--model", str(model),
                 "--seed", seed, "--out", out)
        _refused(capsys, ["--seed must be in [0, 2^31)"], "perfectible", "--model", str(model), "--max-tokens", "8",
                 "--seed", seed, "--out", str(tmp_path / "p.jsonl"))
        _refused(capsys, ["--seed must be in [0, 2^31)"], "warmstart", "--out", str(tmp_path / "w"), "--seed", seed)
    _refused(capsys, ["--stop-ids: token id 999 is outside the model's vocabulary"], "analyze", "rollouts",
             "--model", str(model), "--prompt-ids", str(ids), "--stop-ids", "3,999", "--out", out)
    for flag, value in (("--task", "no_such_task"), ("--split", "no_such_split"), ("--template", "{x}")):
        _refused(capsys, [f"{flag} goes with a task's prompts; --prompt-ids gives the prompts itself"], "analyze",
                 "rollouts", "--model", str(model), "--prompt-ids", str(ids), flag, value, "--out", out)
    _refused(capsys, ["--split goes with a task's prompts"], "analyze", "attribute", "--model", str(model),
             "--prompt-ids", str(ids), "--split", "no_such_split", "--out", out)
    ids.unlink()
    _nothing_written(tmp_path)


@pytest.mark.slow
def test_perfectible_refuses_an_engine_or_dtype_the_server_at_address_does_not_run(model, tmp_path, capsys):
    from jaxrl_mismatch.rollout.jax_engine import JaxEngine
    from jaxrl_mismatch.rollout.server import RolloutServer

    server = RolloutServer(port=0, token="t")
    server.attach(JaxEngine(str(model), dtype="float32"))
    try:
        for flag, value, served in (("--engine", "vllm", "jax"), ("--dtype", "bfloat16", "float32")):
            _refused(capsys, [f"{flag} {value}: the server at 127.0.0.1:{server.port} runs {served}"],
                     "perfectible", "--model", str(model), "--max-tokens", "8", "--address",
                     f"127.0.0.1:{server.port}", flag, value, "--out", str(tmp_path / "p.jsonl"))
    finally:
        server.stop(0)
    _nothing_written(tmp_path)
    assert not any(name.startswith(".perfectible-server-") for name in os.listdir(tmp_path))
