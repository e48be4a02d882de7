"""Bad task data and tokenizer folders are refused where they are loaded, in one line naming the file and line (the
data review's findings 2-6, 8, 9): each reached a rollout server (exit 3), a reward at the first step that sampled
it, TFDS's "No examples were yielded" or a bare ValueError/TypeError (exit 1)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("tensorflow_datasets")

from jaxrl_mismatch.data import math_datasets as M  # noqa: E402
from jaxrl_mismatch.data import tokenizer as T  # noqa: E402
from jaxrl_mismatch.data.batching import PromptError, PromptTooLongError, tokenize_prompts  # noqa: E402
from jaxrl_mismatch.data.jsonl import read_task_file  # noqa: E402
from jaxrl_mismatch.data.rewards import math_reward  # noqa: E402
from jaxrl_mismatch.train.config import ConfigError, base_config  # noqa: E402
from jaxrl_mismatch.train.task_data import TaskData  # noqa: E402
from jaxrl_mismatch.usage import UsageError  # noqa: E402


def _jsonl(path: Path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tok")
    T.save_tokenizer(T.build_arithmetic_tokenizer(), str(d))
    return str(d)


@pytest.fixture(scope="module")
def no_bos_dir(model_dir, tmp_path_factory) -> str:
    """The arithmetic tokenizer without its BOS post-processor: an empty prompt encodes to no ids at all."""
    d = tmp_path_factory.mktemp("nobos")
    shutil.copytree(model_dir, d, dirs_exist_ok=True)
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(spec))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = json.loads((d / name).read_text())
        cfg.pop("bos_token", None)
        (d / name).write_text(json.dumps(cfg))
    return str(d)


def _task_data(model_dir: str, tmp_path: Path, train: str, val: str | None = None, **task) -> TaskData:
    c = base_config()
    c.model.path, c.run_dir = model_dir, str(tmp_path / "run")
    c.task.name, c.task.data_dir = "arithmetic_prompts", str(tmp_path / "tfds")
    c.task.files = {"train": train, "validation": val or train}
    c.task.num_val = 4
    c.batch.prompts_per_step = 1
    for k, v in task.items():
        c.task[k] = v
    return TaskData(c, model_vocab_size=10_000)


GOOD = {"prompt_text": "1+1=", "answer": "2"}


# -- finding 2: a gold answer the task's reward cannot read ------------------------------------------------------------
@pytest.mark.parametrize("answer, needle", [(4.0, "gold answer '4.0' is not an integer"),
                                            ("abc", "gold answer 'abc' is not an integer")])
def test_a_gold_answer_the_arithmetic_reward_cannot_read_is_refused_before_the_build(model_dir, tmp_path, answer,
                                                                                      needle):
    """It raised in the reward at the first step that sampled it, after the rollout server had started (exit 1)."""
    bad = _jsonl(tmp_path / "train.jsonl", GOOD, {"prompt_text": "2+2=", "answer": answer})
    with pytest.raises(ConfigError, match=rf"^config\.task\.files: {re.escape(bad)}:2: arithmetic reward: "
                                          rf"{re.escape(needle)}$"):
        _task_data(model_dir, tmp_path, bad)
    assert not (tmp_path / "tfds").exists()  # refused before TFDS built anything
    with pytest.raises(UsageError, match=rf"^--file {re.escape(bad)}:2: arithmetic reward: {re.escape(needle)}$"):
        read_task_file("arithmetic_prompts", bad, 0)  # perfectible's and analyze's reader
    # the math reward reads any non-empty answer: the same file is a valid `prompts` task
    assert [r["answer"] for r in read_task_file("prompts", bad, 0)[0]] == ["2", str(answer)]


@pytest.mark.parametrize("answer, needle", [(True, "field 'answer' should be a string or a number, got bool"),
                                            (float("nan"), "field 'answer' is nan, not an answer"),
                                            ([1, 2], "field 'answer' should be a string or a number, got list")])
def test_an_answer_that_is_no_scalar_is_refused_by_field(tmp_path, answer, needle):
    """`true` became the answer "True" and NaN "nan" (exit 1 in the arithmetic reward, a literal compare in math)."""
    bad = _jsonl(tmp_path / "b.jsonl", GOOD, json.dumps({"prompt_text": "p", "answer": answer}))
    with pytest.raises(M.DataFormatError, match=rf"b\.jsonl:2: {re.escape(needle)}"):
        M.build("prompts", {"train": bad}, str(tmp_path / "tfds"))
    dapo = _jsonl(tmp_path / "d.jsonl", json.dumps({"prompt": "q", "reward_model": {"ground_truth": answer}}))
    with pytest.raises(M.DataFormatError, match=r"d\.jsonl:1: field 'reward_model.ground_truth'"):
        M.build("dapo", {"train": dapo}, str(tmp_path / "tfds"))


# -- finding 3: an empty prompt ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, row, field", [
    ("prompts", {"prompt_text": "", "answer": "3"}, "prompt_text"),
    ("prompts", {"prompt_text": " \n", "answer": "3"}, "prompt_text"),
    ("dapo", {"prompt": [{"role": "user", "content": ""}], "reward_model": {"ground_truth": "3"}}, "prompt"),
    ("dapo", {"prompt": "", "reward_model": {"ground_truth": "3"}}, "prompt"),
    ("math", {"problem": "", "answer": "3"}, "problem"),
    ("gsm8k", {"question": "", "answer": "#### 3"}, "question"),
])
def test_an_empty_prompt_is_refused_naming_file_line_and_field(tmp_path, fmt, row, field):
    """It reached the rollout server with no tokens (a tokenizer without BOS): exit 3 "rollout failed"."""
    bad = _jsonl(tmp_path / "b.jsonl", row)
    with pytest.raises(M.DataFormatError, match=rf"b\.jsonl:1: field '{field}' is empty"):
        M.build(fmt, {"train": bad}, str(tmp_path / "tfds"))


def test_a_prompt_with_no_tokens_is_refused_naming_it(no_bos_dir, tmp_path):
    tok = T.load_tokenizer(no_bos_dir)
    assert tok.bos_id is None and tok.encode("") == []
    with pytest.raises(PromptError, match=r"^f\.jsonl:7: prompt '' has no tokens"):
        tokenize_prompts(tok, ["1+1=", ""], where=["f.jsonl:6", "f.jsonl:7"])
    with pytest.raises(PromptError, match=r"^prompt 1 '' has no tokens"):
        tokenize_prompts(tok, ["1+1=", ""])


# -- finding 4: characters outside the vocabulary --------------------------------------------------------------------
def test_a_prompt_outside_the_vocabulary_names_file_and_line(model_dir, tmp_path):
    """A bare ValueError: exit 1 in train and perfectible."""
    bad = _jsonl(tmp_path / "train.jsonl", GOOD, "", {"prompt_text": "x+1=", "answer": "1"})
    with pytest.raises(ConfigError, match=rf"^config\.task\.files: {re.escape(bad)}:3: prompt: text 'x\+1=' has "
                                          r"characters outside the tokenizer's vocabulary: \['x'\]$"):
        _task_data(model_dir, tmp_path, bad, _jsonl(tmp_path / "val.jsonl", GOOD))
    assert issubclass(T.UnknownCharactersError, ValueError)


# -- finding 5: a file without records -------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "\n   \n\n"])
def test_a_task_file_without_records_is_refused_before_the_build(model_dir, tmp_path, text):
    """TFDS failed with `AssertionError: ... No examples were yielded` (exit 1)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    with pytest.raises(ConfigError, match=rf"^config\.task\.files: {re.escape(str(empty))}: no records"):
        _task_data(model_dir, tmp_path, _jsonl(tmp_path / "train.jsonl", GOOD), str(empty))
    assert not (tmp_path / "tfds").exists()


# -- finding 6: the tokenizer folder ----------------------------------------------------------------------------------
@pytest.mark.parametrize("content, needle", [(b'["pad_token"]', "expected a JSON object, got list"),
                                             (b'"eos_token"', "expected a JSON object, got str"),
                                             (b'\xff\xfe{}', "is not UTF-8"),
                                             (b'{"model_max_length": ' + b"9" * 5000 + b"}",
                                              "is not valid JSON (Exceeds the limit (4300 digits)"),
                                             (b"[" * 100_000 + b"]" * 100_000, "is not valid JSON (maximum recursion")])
def test_a_tokenizer_config_that_is_no_utf8_json_object_names_the_file(model_dir, tmp_path, content, needle):
    """A list or a string was a TypeError, bytes that are not UTF-8 a UnicodeDecodeError: exit 1."""
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    (d / "tokenizer_config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^config\.model\.path: {re.escape(str(d / 'tokenizer_config.json'))}"
                                          rf":? {re.escape(needle)}"):
        _task_data(str(d), tmp_path, _jsonl(tmp_path / "t.jsonl", GOOD))


def test_a_tokenizer_larger_than_the_models_vocabulary_names_the_field(model_dir, tmp_path):
    """`check_model_vocab` ran outside the try that makes tokenizer faults one line: a ValueError, exit 1."""
    c = base_config()
    c.model.path = model_dir
    with pytest.raises(ConfigError, match=rf"^config\.model\.path: {re.escape(model_dir)}/tokenizer\.json: "
                                          r"tokenizer/model mismatch: the tokenizer has 26 ids but the model's "
                                          r"vocab_size is 8"):
        TaskData(c, model_vocab_size=8)


# -- finding 8: a prompt over max_prompt_len -------------------------------------------------------------------------
def test_a_too_long_prompt_names_file_and_line(model_dir, tmp_path):
    """It was "prompt 4" (the 0-based record index, blank lines not counted) and no file."""
    rows = [GOOD] * 4 + ["", {"prompt_text": "1+1+1+1+1+1+1+1+1+1=", "answer": "10"}]
    bad = _jsonl(tmp_path / "train.jsonl", *rows)
    with pytest.raises(ConfigError, match=rf"^config\.task\.max_prompt_len: {re.escape(bad)}:6: prompt has 21 tokens "
                                          r"> max_prompt_len=8: "):
        _task_data(model_dir, tmp_path, bad, _jsonl(tmp_path / "val.jsonl", GOOD), max_prompt_len=8)
    assert issubclass(PromptTooLongError, PromptError)


def test_file_records_carry_where_they_were_read(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", GOOD, "", GOOD)
    b = _jsonl(tmp_path / "b.jsonl", "  ", GOOD)
    recs = M.load_records("prompts", {"train": [a, b]}, str(tmp_path / "tfds"), "train")
    assert [r["where"] for r in recs] == [f"{a}:1", f"{a}:3", f"{b}:2"]


# -- finding 9: the math format's answer field ------------------------------------------------------------------------
def test_a_numeric_math_answer_is_the_gold_answer(tmp_path):
    """docs/data.md: the `answer` field wins when present. A number was ignored for the solution's box, and without
    a solution the record was refused ("missing field 'solution'")."""
    rows = [{"problem": "p", "answer": 5}, {"problem": "q", "answer": 0.5, "solution": "so \\boxed{6}"},
            {"problem": "r", "answer": "  ", "solution": "so \\boxed{6}"}, {"problem": "s", "answer": 1e20},
            {"problem": "t", "answer": 1.5e-7}]
    recs = M.load_records("math", {"train": _jsonl(tmp_path / "m.jsonl", *rows)}, str(tmp_path / "tfds"), "train")
    # positional: str(1e20) = "1e+20" was read by math-verify as Euler's number e + 20 ("\\boxed{e+20}" scored 1.0)
    assert [r["answer"] for r in recs] == ["5", "0.5", "6", "100000000000000000000", "0.00000015"]
    assert math_reward("\\boxed{10^{20}}", recs[3]["answer"]) == 1.0
    assert math_reward("\\boxed{e+20}", recs[3]["answer"]) == 0.0
    for answer, kind in ((True, "bool"), ([5], "list")):
        bad = _jsonl(tmp_path / "b.jsonl", {"problem": "p", "answer": answer, "solution": "\\boxed{5}"})
        with pytest.raises(M.DataFormatError, match=rf"b\.jsonl:1: field 'answer' should be a string or a number, "
                                                    rf"got {kind}"):
            M.build("math", {"train": bad}, str(tmp_path / "tfds2"))


@pytest.mark.parametrize("where, declared", [("config.json", 5), ("generation_config.json", [5, 6])])
def test_a_tokenizer_whose_eos_the_model_does_not_declare_names_both(model_dir, tmp_path, where, declared):
    """Only a tokenizer larger than the model's vocabulary was refused: another model's tokenizer that fits trained
    with rollouts stopping at an id the model never ended with. A model declaring the tokenizer's EOS among others
    (a list, as Qwen's generation_config.json), or declaring none, passes."""
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    tok = T.load_tokenizer(str(d))
    tok.check_model_eos(str(d))  # declares nothing
    (d / where).write_text(json.dumps({"eos_token_id": declared}))
    c = base_config()
    c.model.path = str(d)
    with pytest.raises(ConfigError, match=rf"^config\.model\.path: {re.escape(str(d))}/tokenizer\.json: "
                                          rf"tokenizer/model mismatch: the tokenizer's EOS is id {tok.eos_id} "
                                          r"\('<eos>'\) but the "
                                          r"model declares \[5(, 6)?\] \(eos_token_id in config\.json"):
        TaskData(c, model_vocab_size=64)
    (d / where).write_text(json.dumps({"eos_token_id": [5, tok.eos_id]}))
    T.load_tokenizer(str(d)).check_model_eos(str(d))
