"""TFDS builders over tiny local JSONL files: build, read back via as_data_source, clear errors."""

import json
import re

import pytest

tfds = pytest.importorskip("tensorflow_datasets")

from jaxrl_mismatch.data import get_task  # noqa: E402
from jaxrl_mismatch.data import math_datasets as M  # noqa: E402
from jaxrl_mismatch.data.rewards import math_reward  # noqa: E402

tfds.disable_progress_bar()


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GSM8K = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?", "answer": "48/2 = 24\n#### 72"},
    {"question": "What is 1,000 + 234?", "answer": "#### 1,234"},
    {"question": "Half of one?", "answer": "#### 0.5"},
]
MATH = [
    {"problem": "Compute $\\frac{2}{4}$.", "solution": "Reduce: $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
    {"problem": "What is $3^2$?", "solution": "It is $\\boxed{9}$."},
    {"problem": "With answer field", "solution": "no box here", "answer": "\\sqrt{2}"},
]
DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is 6*7?\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
DAPO = [
    {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PROMPT, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "42", "style": "rule-lax"},
        "extra_info": {"index": "a1b2"},
    },
    {"data_source": "math_dapo", "prompt": "plain string prompt", "reward_model": {"ground_truth": 7}},
]


def test_build_leaves_nothing_in_the_temp_directory(tmp_path, monkeypatch):
    """TFDS's first build made an empty mkdtemp folder (for GCS info it never fetched) and left it behind."""
    system_tmp = tmp_path / "system_tmp"
    system_tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(system_tmp))
    recs = M.load_records("gsm8k", {"train": _write(tmp_path / "train.jsonl", GSM8K)}, str(tmp_path / "tfds"), "train")
    assert len(recs) == 3
    assert list(system_tmp.iterdir()) == []


def test_gsm8k_build_and_read(tmp_path):
    ds = M.build("gsm8k", {"train": _write(tmp_path / "train.jsonl", GSM8K), "test": _write(tmp_path / "test.jsonl", GSM8K[:1])}, str(tmp_path / "tfds"))
    recs = ds.records("train")
    assert [r["answer"] for r in recs] == ["72", "1234", "0.5"]
    assert recs[0]["prompt_text"].startswith("Natalia") and [r["index"] for r in recs] == [0, 1, 2]
    assert json.loads(recs[0]["extra"]) == {"answer": "48/2 = 24\n#### 72"}
    assert len(ds.data_source("test")) == 1
    # array_record on disk, readable by name from any process via tfds.data_source
    assert list((tmp_path / "tfds").rglob("*.array_record-*"))
    src = tfds.data_source(ds.name, data_dir=str(tmp_path / "tfds"), split="train", try_gcs=False)
    assert len(src) == 3
    # gold answers grade with the math reward
    assert math_reward("\\boxed{1/2}", recs[2]["answer"]) == 1.0


def test_a_split_of_several_files_reads_in_file_order(tmp_path):
    """The per-file line number was the index: train = [a, b] read A0 B0 A1 B1 ..., so `val[:num_val]` took a
    mix of both files."""
    rows = lambda tag, n: [{"prompt_text": f"{tag}{i}", "answer": str(i)} for i in range(n)]  # noqa: E731
    ds = M.build("prompts", {"train": [_write(tmp_path / "a.jsonl", rows("A", 3)),
                                       _write(tmp_path / "b.jsonl", rows("B", 4))]}, str(tmp_path / "tfds"))
    recs = ds.records("train")
    assert [r["prompt_text"] for r in recs] == ["A0", "A1", "A2", "B0", "B1", "B2", "B3"]
    assert [r["index"] for r in recs] == list(range(7))


def test_math_and_dapo_build_and_read(tmp_path):
    recs = M.load_records("math", {"train": _write(tmp_path / "m.jsonl", MATH)}, str(tmp_path / "tfds"), "train")
    assert [r["answer"] for r in recs] == ["\\frac{1}{2}", "9", "\\sqrt{2}"]
    assert json.loads(recs[0]["extra"])["level"] == "Level 1"
    assert math_reward("so \\boxed{0.5}", recs[0]["answer"]) == 1.0

    recs = M.load_records("dapo", {"train": _write(tmp_path / "d.jsonl", DAPO)}, str(tmp_path / "tfds"), "train")
    assert [r["prompt_text"] for r in recs] == [DAPO_PROMPT, "plain string prompt"]
    assert [r["answer"] for r in recs] == ["42", "7"]
    assert json.loads(recs[0]["extra"])["extra_info"] == {"index": "a1b2"}
    assert math_reward("6*7 = 42\nAnswer: 42", recs[0]["answer"]) == 1.0
    assert math_reward("Answer: 41", recs[0]["answer"]) == 0.0


def test_changed_source_rebuilds(tmp_path):
    path = tmp_path / "g.jsonl"
    a = M.load_records("gsm8k", {"train": _write(path, GSM8K[:1])}, str(tmp_path / "tfds"), "train")
    b = M.load_records("gsm8k", {"train": _write(path, GSM8K[:2])}, str(tmp_path / "tfds"), "train")
    assert len(a) == 1 and len(b) == 2


@pytest.mark.parametrize(
    "fmt, rows, match",
    [
        ("gsm8k", [GSM8K[0], {"question": "q"}], r"b\.jsonl:2: missing field 'answer'"),
        ("gsm8k", [GSM8K[0], {"question": "q", "answer": "no marker"}], r"b\.jsonl:2: field 'answer'.*####"),
        ("gsm8k", ["{not json"], r"b\.jsonl:1: not valid JSON"),
        ("math", [{"problem": "p", "solution": "no box"}], r"b\.jsonl:1: field 'solution' has no complete"),
        ("math", [{"problem": 3, "solution": "\\boxed{1}"}], r"b\.jsonl:1: field 'problem' should be str"),
        ("dapo", [{"prompt": [{"role": "system", "content": "x"}], "reward_model": {"ground_truth": "1"}}], r"b\.jsonl:1: field 'prompt' has no user"),
        ("dapo", [{"prompt": "p", "reward_model": {}}], r"b\.jsonl:1: field 'reward_model.ground_truth'"),
        ("prompts", [{"prompt_text": "p", "answer": "1"}, {"prompt_text": "q", "answer": "  "}],
         r"b\.jsonl:2: field 'answer' is empty"),
    ],
)
def test_bad_lines_name_file_line_and_field(tmp_path, fmt, rows, match):
    with pytest.raises(M.DataFormatError, match=match):
        M.build(fmt, {"train": _write(tmp_path / "b.jsonl", rows)}, str(tmp_path / "tfds"))
    assert not (tmp_path / "tfds").exists()  # validated before anything is written


def test_bad_utf8_and_non_object_lines_name_file_and_line(tmp_path):
    from jaxrl_mismatch.data.jsonl import read_task_file
    from jaxrl_mismatch.usage import UsageError

    bad = tmp_path / "b.jsonl"
    bad.write_bytes(json.dumps(GSM8K[0]).encode() + b"\n" + b'{"question": "\xff", "answer": "#### 1"}\n')
    with pytest.raises(M.DataFormatError, match=r"b\.jsonl:2: not UTF-8"):
        M.build("gsm8k", {"train": str(bad)}, str(tmp_path / "tfds"))
    with pytest.raises(UsageError, match=r"--file .*b\.jsonl:2: not UTF-8"):
        read_task_file("gsm8k", str(bad), 0)
    five = tmp_path / "five.jsonl"
    five.write_text(json.dumps(GSM8K[0]) + "\n5\n")
    with pytest.raises(UsageError, match=r"five\.jsonl:2: expected a JSON object, got int"):
        read_task_file("gsm8k", str(five), 0)
    # An unpaired surrogate escape is valid JSON but no text: the dataset writer raised a RuntimeError (a
    # traceback, a half-made build folder) and the tokenizer a TypeError, neither naming the file or line.
    lone = tmp_path / "lone.jsonl"
    lone.write_text(json.dumps(GSM8K[0]) + "\n" + '{"question": "What is 1+1? \\ud800", "answer": "#### 2"}\n')
    with pytest.raises(M.DataFormatError, match=r"lone\.jsonl:2: a string holds the unpaired surrogate escape "
                                                 r"\\ud800, which is not text$"):
        M.build("gsm8k", {"train": str(lone)}, str(tmp_path / "tfds"))
    assert not (tmp_path / "tfds").exists()
    with pytest.raises(UsageError, match=r"--file .*lone\.jsonl:2: a string holds the unpaired surrogate escape"):
        read_task_file("gsm8k", str(lone), 0)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        M.build("gsm8k", {"train": str(tmp_path / "nope.jsonl")}, str(tmp_path))
    with pytest.raises(ValueError, match="unknown data format"):
        M.builder_class("csv")


def test_task_registry_loads_file_tasks(tmp_path):
    task = get_task("gsm8k")
    recs = task.load("train", files={"train": _write(tmp_path / "g.jsonl", GSM8K)}, data_dir=str(tmp_path / "tfds"))
    assert task.reward("\\boxed{72}", recs[0]["answer"]) == 1.0
    assert task.template == "qwen_boxed"
    with pytest.raises(ValueError, match="unknown task"):
        get_task("imagenet")


def test_a_converter_change_builds_anew_instead_of_reading_the_records_an_older_one_wrote(tmp_path, monkeypatch):
    """The config name fingerprints the converted records, not the file bytes: a build made by an older converter
    (here one that read other gold answers) is not reused by the current one."""
    path, data_dir = _write(tmp_path / "m.jsonl", MATH), str(tmp_path / "tfds")
    current = M.CONVERTERS["math"]
    monkeypatch.setitem(M.CONVERTERS, "math", lambda obj, where: (lambda t, a, e: (t, "7", e))(*current(obj, where)))
    assert [r["answer"] for r in M.load_records("math", {"train": path}, data_dir, "train")] == ["7"] * 3
    monkeypatch.setitem(M.CONVERTERS, "math", current)
    assert [r["answer"] for r in M.load_records("math", {"train": path}, data_dir, "train")] == [
        "\\frac{1}{2}", "9", "\\sqrt{2}"]


RACE = """
import sys, time
from jaxrl_mismatch.data import math_datasets as M
while time.time() < float(sys.argv[3]):
    time.sleep(0.001)
print(len(M.load_records("prompts", {"train": sys.argv[1]}, sys.argv[2], "train")))
"""


def test_two_processes_building_one_dataset_at_once_both_read_it(tmp_path):
    """The processes of a multi-host job (or two runs sharing `task.data_dir`) build the same dataset at the same
    moment: without the build lock, the second one's rename into place failed (FileExistsError)."""
    import os
    import subprocess
    import sys
    import time

    rows = [{"prompt_text": f"question {i} " + "x" * 200, "answer": str(i)} for i in range(2000)]
    path, data_dir = _write(tmp_path / "p.jsonl", rows), str(tmp_path / "tfds")
    start = str(time.time() + 8)  # both processes have imported TFDS by then
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", RACE, path, data_dir, start], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "2000"  # TFDS prints its own lines before


@pytest.mark.parametrize("line, needle", [
    ('{"question": "q", "answer": "#### 1", "n": ' + "1" * 5000 + "}", "Exceeds the limit (4300 digits)"),
    ('{"question": "q", "answer": "#### 1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "maximum recursion depth"),
])
def test_a_line_json_refuses_without_a_decode_error_names_file_and_line(tmp_path, line, needle):
    """An integer past Python's 4,300-digit limit (a plain ValueError) or nesting past the recursion limit (a
    RecursionError) escaped the JSONDecodeError handlers: a message naming no file, or a traceback."""
    from jaxrl_mismatch.data.jsonl import read_task_file
    from jaxrl_mismatch.usage import UsageError

    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps(GSM8K[0]) + "\n" + line + "\n")
    with pytest.raises(M.DataFormatError, match=rf"b\.jsonl:2: not valid JSON \({re.escape(needle)}"):
        M.build("gsm8k", {"train": str(bad)}, str(tmp_path / "tfds"))
    assert not (tmp_path / "tfds").exists()
    with pytest.raises(UsageError, match=rf"--file .*b\.jsonl:2: not JSON \({re.escape(needle)}"):
        read_task_file("gsm8k", str(bad), 0)


@pytest.mark.parametrize("split", ["a b", "train[:1]", "x+y"])
def test_a_split_name_tfds_would_read_as_a_slice_is_refused_before_anything_is_built(tmp_path, split):
    """"a b" built the whole dataset, then TFDS failed parsing the split ("train[:1]": Unknown split 'train')."""
    path = _write(tmp_path / "g.jsonl", GSM8K[:1])
    with pytest.raises(ValueError, match=rf"split {re.escape(repr(split))}: a split name is letters, digits and _"):
        M.build("gsm8k", {"train": path, split: path}, str(tmp_path / "tfds"))
    assert not (tmp_path / "tfds").exists()
