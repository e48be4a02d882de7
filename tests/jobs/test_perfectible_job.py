"""`jaxrl-mismatch perfectible`'s inputs, refused before any server starts in one line naming the flag, field or
file (exit 2), and what a run leaves behind (the jobs review's findings 4, 5, 8 and 9): --max-tokens past the
model's context and a --k no request can carry failed only after the rollout server had started (exit 1, a
`.perfectible-server-*` folder left next to --out); an unknown --template and a partial --config were a ValueError
and an AttributeError (exit 1); --force replaced any empty file; an empty --file started a server and wrote
"kept 0 of 0"; --split next to --file was silently ignored."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from jaxrl_mismatch import cli
from jaxrl_mismatch.jobs import perfectible
from jaxrl_mismatch.rollout.launcher import ServerStartError
from jaxrl_mismatch.rollout.session import RolloutSession
from jaxrl_mismatch.usage import UsageError

NO_SERVER = "127.0.0.1:1"  # --address: the folder passed as --model is not read as a checkpoint (no server needed)


def _refused(capsys, needles, *argv: str) -> str:
    rc = cli.main(list(argv))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (rc, err)
    for n in needles:
        assert n in err[0], (n, err[0])
    return err[0]


@pytest.fixture
def no_launch(monkeypatch):
    """Any server start fails the test: each refusal here must come before one."""
    def launch(**kwargs):
        raise AssertionError(f"a rollout server was started ({kwargs})")

    monkeypatch.setattr(RolloutSession, "launch", staticmethod(launch))


def _listing(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_max_tokens_and_k_are_checked_against_the_model_and_the_server_limits_before_it_starts(
        tiny_base_model, tmp_path, capsys, no_launch):
    out = str(tmp_path / "sub" / "kept.jsonl")
    common = ("perfectible", "--model", str(tiny_base_model), "--num", "4", "--out", out)
    # the model's max_position_embeddings is 128; an arithmetic prompt takes at most ~12 tokens
    _refused(capsys, ["--max-tokens 500: the longest prompt (", "exceeds the context of 128 positions",
                      f"--model {tiny_base_model}: max_position_embeddings"], *common, "--max-tokens", "500")
    # int32 on the wire; then the server's per-request completion tokens (4M) and its 64 MiB message
    _refused(capsys, ["--k must be <= 2^31 - 1 (2147483647), got 99999999999"], *common, "--max-tokens", "8",
             "--k", "99999999999")
    _refused(capsys, ["--k 999999: --k x --max-tokens = 7999992 completion tokens", "limit of 4194304"], *common,
             "--max-tokens", "8", "--k", "999999")
    _refused(capsys, ["--k 999999: one prompt's --k samples (--max-tokens 1 each) could take",
                      "67108864-byte message"], *common, "--max-tokens", "1", "--k", "999999")
    _refused(capsys, ["--max-tokens must be <= 2^31 - 1"], *common, "--max-tokens", "3000000000")
    assert _listing(tmp_path) == []  # no output, no parent made for it, no server folder


def test_template_and_config_fields_are_named_in_one_line(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    out = str(tmp_path / "kept.jsonl")
    _refused(capsys, ["--template nope: unknown prompt template; valid: arithmetic, dapo,", "r1_distill, raw"],
             "perfectible", "--model", str(model), "--max-tokens", "8", "--template", "nope", "--address", NO_SERVER,
             "--out", out)
    partial = tmp_path / "partial.py"
    partial.write_text("import ml_collections\ndef get_config(): return ml_collections.ConfigDict({'model': {}})\n")
    _refused(capsys, [f"--config {partial}: missing field model.path"], "perfectible", "--config", str(partial),
             "--max-tokens", "8", "--out", out)
    cfg = tmp_path / "cfg.py"
    body = ("from jaxrl_mismatch.train.config import base_config\n"
            "def get_config():\n    c = base_config()\n    c.model.path = {model!r}\n{extra}    return c\n")
    for extra, needle in (("    c.rollout.max_tokens = None\n", "rollout.max_tokens must be int, got None"),
                          ("    c.task.template = 'nope'\n", "task.template nope: unknown prompt template"),
                          ("    del c.rollout['engine']\n", "missing field rollout.engine"),
                          ("    c.rollout.dtype = 'float64'\n", "rollout.dtype 'float64' is not one of"),
                          # named the --temperature flag, which was not given
                          ("    c.rollout.temperature = float('nan')\n", "rollout.temperature must be a number >= 0")):
        cfg.write_text(body.format(model=str(model), extra=extra))
        _refused(capsys, [f"--config {cfg}: {needle}"], "perfectible", "--config", str(cfg), "--address", NO_SERVER,
                 "--out", out)
    assert _listing(tmp_path) == ["cfg.py", "model", "partial.py"]


def test_an_empty_file_and_a_split_next_to_file_are_refused(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    out = str(tmp_path / "kept.jsonl")
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n")):
        (tmp_path / name).write_text(text)
        _refused(capsys, [f"--file {tmp_path / name}: holds no records; nothing to filter"], "perfectible",
                 "--model", str(model), "--max-tokens", "8", "--task", "arithmetic_prompts", "--file",
                 str(tmp_path / name), "--address", NO_SERVER, "--out", out)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt_text": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(UsageError, match=f"^--split nonsense: --file {data} gives the prompts itself"):
        perfectible.parse_args(["--model", str(model), "--max-tokens", "8", "--task", "arithmetic_prompts",
                                "--file", str(data), "--split", "nonsense", "--address", NO_SERVER, "--out", out])
    assert not os.path.exists(out)


def test_force_does_not_replace_an_empty_file(tmp_path):
    """An empty file says nothing of whose it is: --force replaced a user's empty file as perfectible's output."""
    model = tmp_path / "model"
    model.mkdir()
    base = ["--model", str(model), "--max-tokens", "8", "--address", NO_SERVER, "--force"]
    for name, text in (("user_empty.txt", ""), ("blank.txt", "\n\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(UsageError, match=f"^--out {tmp_path / name}: is an empty file, and nothing in it shows"):
            perfectible.parse_args([*base, "--out", str(tmp_path / name)])
        assert (tmp_path / name).read_text() == text
    earlier = tmp_path / "kept.jsonl"
    earlier.write_text(json.dumps({"prompt_text": "1+1=", "answer": "2", "initial_accuracy": 0.5, "num_samples": 8})
                       + "\n")
    assert perfectible.parse_args([*base, "--out", str(earlier)]).force  # a file it wrote is still replaced


@pytest.mark.parametrize("failure, kept", [(ServerStartError("rollout server exited with code 1"), True),
                                           (RuntimeError("something else"), False),
                                           (KeyboardInterrupt(), False)])
def test_a_failed_run_leaves_only_a_failed_servers_log(tiny_base_model, tmp_path, capsys, monkeypatch, failure,
                                                       kept):
    """Its server folder was kept on every failure. Now only a server that failed keeps it, for its log, named in
    the error; any other failure removes it, and the folders above --out are made only when it is written."""
    def launch(*, work_dir, **kwargs):
        with open(os.path.join(work_dir, "rollout_server.log"), "w") as f:
            f.write("the server's last words\n")
        raise failure

    monkeypatch.setattr(RolloutSession, "launch", staticmethod(launch))
    rc = cli.main(["perfectible", "--model", str(tiny_base_model), "--max-tokens", "8", "--num", "2", "--out",
                   str(tmp_path / "sub" / "kept.jsonl")])
    err = capsys.readouterr().err
    left = _listing(tmp_path)
    if kept:
        assert rc == 1 and "server log kept: " in err
        assert len(left) == 2 and left[0].startswith(".perfectible-server-") and left[1].endswith("rollout_server.log")
        assert os.path.join(tmp_path, left[1]) in err
    else:
        assert rc in (1, 130) and left == []


def test_address_checks_max_tokens_and_k_against_the_servers_getinfo(tiny_base_model, tmp_path, capsys):
    """With --address the server's context and request limits come from GetInfo, before any Generate."""
    from jaxrl_mismatch.rollout.jax_engine import JaxEngine
    from jaxrl_mismatch.rollout.protocol import Limits
    from jaxrl_mismatch.rollout.server import RolloutServer

    model = shutil.copytree(tiny_base_model, tmp_path / "model")
    server = RolloutServer(port=0, token="t", limits=Limits(max_request_completion_tokens=1000))
    server.attach(JaxEngine(str(model), dtype="float32", max_model_len=64))
    address = f"127.0.0.1:{server.port}"
    try:
        common = ("perfectible", "--model", str(model), "--num", "4", "--address", address, "--out",
                  str(tmp_path / "kept.jsonl"))
        _refused(capsys, ["--max-tokens 100: the longest prompt (", f"the context of 64 positions (the server at "
                          f"{address})"], *common, "--max-tokens", "100")
        _refused(capsys, ["--k 200: --k x --max-tokens = 1600 completion tokens", "limit of 1000 per request"],
                 *common, "--max-tokens", "8", "--k", "200")
        # a server of another model (here: another vocabulary) was sampled from, and every prompt kept at accuracy 0
        other = shutil.copytree(model, tmp_path / "other")
        cfg = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 64}))
        _refused(capsys, [f"--address {address}: serves another model than --model {other}", "vocab_size: engine "],
                 "perfectible", "--model", str(other), "--num", "4", "--address", address, "--max-tokens", "8",
                 "--out", str(tmp_path / "kept.jsonl"))
    finally:
        server.stop(0)
    assert _listing(tmp_path) == sorted(["model", "other"] + [f"{d}/{p}" for d in ("model", "other")
                                                              for p in os.listdir(model)])


def test_more_arithmetic_problems_than_the_split_holds_is_a_usage_error(tiny_base_model, tmp_path, capsys):
    """It was exit 1, "ValueError: asked for 100000000 unique 'train' problems ..." naming no flag."""
    _refused(capsys, ["--num 100000000: asked for 100000000 unique 'train' problems"], "perfectible", "--model",
             str(tiny_base_model), "--max-tokens", "8", "--num", "100000000", "--address", NO_SERVER, "--out",
             str(tmp_path / "kept.jsonl"))
    assert _listing(tmp_path) == []


def test_an_out_file_that_appears_while_sampling_is_never_replaced(tmp_path):
    """--out was checked only at start-up: a file created there during a long sampling run was replaced by the
    write. The write re-checks; the user's file stays and the kept prompts go to a new sibling named in the
    error, not lost. With nothing there the write lands at --out."""
    import argparse

    records = [{"prompt": "1+1=", "answer": "2", "initial_accuracy": 0.5, "num_samples": 4}]
    lines = [json.dumps(r) for r in records]
    out = tmp_path / "kept.jsonl"
    a = argparse.Namespace(out=str(out), file=None, force=False)
    perfectible._write_out(a, lines)
    assert [json.loads(line) for line in out.read_text().splitlines()] == records
    mine = tmp_path / "mine.jsonl"
    mine.write_text("my notes\n")
    a = argparse.Namespace(out=str(mine), file=None, force=False)
    with pytest.raises(UsageError, match=r"^--out .*mine.jsonl: .*\(it changed while sampling\); the 1 kept prompts "
                                         r"are in .*mine.jsonl.new-\d+$") as e:
        perfectible._write_out(a, lines)
    assert mine.read_text() == "my notes\n"
    aside = str(e.value).rsplit(" ", 1)[-1]
    assert [json.loads(line) for line in open(aside).read().splitlines()] == records


def test_a_dangling_link_or_an_unparsable_force_target_is_refused_and_the_results_kept(tmp_path):
    """--out a dangling symbolic link, next to --file: `samefile` followed it (FileNotFoundError, exit 1, "not a
    usage error"); --force over a file holding a number past Python's 4,300 digits: a ValueError from the JSON
    reader. At start-up both are now the one-line refusal; met at the final write they cost the whole run's kept
    prompts (only UsageError sent them to a sibling)."""
    import argparse

    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt_text": "1+1=", "answer": "2"}) + "\n")
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "missing")
    big = tmp_path / "big.jsonl"
    big.write_text('{"a": 1' + "0" * 5000 + "}\n")
    records = [{"prompt": "1+1=", "answer": "2", "initial_accuracy": 0.5, "num_samples": 4}]
    for out, force, needle in ((dangling, False, "symbolic link"), (big, True, "this file is not one")):
        a = argparse.Namespace(out=str(out), file=str(data), force=force)
        with pytest.raises(UsageError, match=rf"^--out {out}: .*{needle}"):
            perfectible.check_out(a)
        with pytest.raises(UsageError, match=r"\(it changed while sampling\); the 1 kept prompts are in "):
            perfectible._write_out(a, [json.dumps(r) for r in records])
    assert dangling.is_symlink() and not dangling.exists() and big.read_text().startswith('{"a": 10000')
    kept = sorted(tmp_path.glob("*.new-*"))
    assert len(kept) == 2 and all(json.loads(p.read_text()) == records[0] for p in kept)


def _config(tmp_path, model, **fields) -> str:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt_text": "1+1=", "answer": "2"}\n{"prompt_text": "2+3*4=", "answer": "14"}\n')
    cfg = tmp_path / "cfg.py"
    cfg.write_text("from jaxrl_mismatch.train.config import base_config\n\n\ndef get_config():\n"
                   "    c = base_config()\n"
                   f"    c.model.path = {str(model)!r}\n"
                   "    c.task.name = 'arithmetic_prompts'\n"
                   f"    c.task.files = {{'train': {str(data)!r}}}\n"
                   "    c.rollout.max_tokens = 8\n"
                   + "".join(f"    c.{k} = {v!r}\n" for k, v in fields.items()) + "    return c\n")
    return str(cfg)


def test_the_configs_truncation_and_prompt_bound_reach_the_filter(tiny_base_model, tmp_path, capsys, monkeypatch):
    """`--config` is to make the filter sample as the run will, but its rollout.top_p / top_k were dropped (the
    full distribution sampled) and task.max_prompt_len not enforced (a prompt train refuses was kept)."""
    from jaxrl_mismatch.rollout.engine import Completion
    from jaxrl_mismatch.rollout.protocol import Limits

    specs = []

    class Session:
        limits = Limits()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def generate(self, ids, spec):  # one right answer and one wrong per prompt: accuracy 0.5, kept
            specs.append(spec)
            answers = {len(p): a for p, a in zip(ids, ("2", "14"))}  # the two prompts differ in length
            def said(text):
                return Completion(token_ids=tok.encode(text, add_special_tokens=False), logprobs=[-1.0],
                                  finish_reason="stop", weight_version=0)

            return [[said(f"{answers[len(p)]}#{answers[len(p)]}"), said("0#0")] for p in ids]

    from jaxrl_mismatch.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_base_model))
    monkeypatch.setattr(RolloutSession, "launch", staticmethod(lambda **kwargs: Session()))
    cfg = _config(tmp_path, tiny_base_model, **{"rollout.top_p": 0.5, "rollout.top_k": 3})
    assert cli.main(["perfectible", "--config", cfg, "--k", "2", "--out", str(tmp_path / "o.jsonl")]) == 0
    assert specs and all((s.top_p, s.top_k) == (0.5, 3) for s in specs)
    # the input's own lines, the two fields appended
    given = (tmp_path / "p.jsonl").read_text().splitlines()
    assert (tmp_path / "o.jsonl").read_text().splitlines() == [
        line[:-1] + ', "initial_accuracy": 0.5, "num_samples": 2}' for line in given]
    capsys.readouterr()
    bounded = _config(tmp_path, tiny_base_model, **{"task.max_prompt_len": 5})  # "2+3*4=" is longer
    _refused(capsys, ["p.jsonl:2", "max_prompt_len"], "perfectible", "--config", bounded, "--k", "2", "--out",
             str(tmp_path / "o2.jsonl"))


def test_kept_lines_are_the_inputs_own_with_the_two_fields_appended():
    """Kept records were re-encoded: spacing and escapes changed, and 12345678901234567890123.0 lost digits."""
    from jaxrl_mismatch.data.jsonl import with_fields

    fields = {"initial_accuracy": 0.5, "num_samples": 4}
    line = '{"answer":"1","prompt_text":"\\u0031+0=","big":12345678901234567890123.0,"n":1e2}  '
    got = with_fields(line, fields)
    assert got == line.rstrip()[:-1] + ', "initial_accuracy": 0.5, "num_samples": 4}'
    assert json.loads(got)["prompt_text"] == "1+0=" and with_fields("{}", fields) == json.dumps(fields)
    assert with_fields(got, fields) is None  # already has them: the caller writes the record anew
