"""`TaskData`: the run's `seed` drives the order of the training prompts, `task.data_seed` the problems, so
that every seed of a paired comparison is scored on the same held-out prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxrl_mismatch.data.tokenizer import build_arithmetic_tokenizer, save_tokenizer
from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_checks import validate
from jaxrl_mismatch.train.task_data import TaskData


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(build_arithmetic_tokenizer(), str(d))
    return str(d)


def _data(model_dir: str, seed: int, data_seed: int = 0) -> TaskData:
    c = base_config()
    c.model.path = model_dir
    c.seed, c.task.data_seed = seed, data_seed
    c.task.num_train, c.task.num_val = 64, 16
    c.batch.prompts_per_step = 8
    return TaskData(c, model_vocab_size=10_000)


def test_validation_prompts_are_the_same_for_every_seed(model_dir):
    a, b = _data(model_dir, seed=0), _data(model_dir, seed=3)
    assert a.val_ids == b.val_ids and a.val_answers == b.val_answers
    # The seed still drives the order of the training prompts (same problem set, another order).
    epoch_a = [a.next_prompts() for _ in range(8)]  # 64 problems, 8 per batch: one epoch
    epoch_b = [b.next_prompts() for _ in range(8)]
    assert epoch_a[0] != epoch_b[0]
    pool = lambda epoch: sorted((tuple(p), ans) for ids, answers in epoch for p, ans in zip(ids, answers))
    assert pool(epoch_a) == pool(epoch_b)


def test_data_seed_chooses_the_problems(model_dir):
    a, c = _data(model_dir, seed=0, data_seed=0), _data(model_dir, seed=0, data_seed=1)
    assert a.val_answers != c.val_answers or a.val_ids != c.val_ids


def test_data_seed_must_be_non_negative():
    c = base_config()
    c.task.data_seed = -1
    with pytest.raises(ConfigError, match="config.task.data_seed"):
        validate(c)


def test_a_bad_task_file_is_a_config_error_naming_file_and_line(model_dir, tmp_path):
    """It was a bare DataFormatError (exit 1, a traceback); `perfectible` and `analyze` already said exit 2."""
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt_text": "1+1=", "answer": "2"}\n{"prompt_text": "2+2="}\n')
    c = base_config()
    c.model.path, c.run_dir = model_dir, str(tmp_path / "run")
    c.task.name, c.task.data_dir = "arithmetic_prompts", str(tmp_path / "tfds")
    c.task.files = {"train": str(bad), "validation": str(bad)}
    with pytest.raises(ConfigError, match=r"config.task.files: .*train.jsonl:2: missing field 'answer'"):
        TaskData(c, model_vocab_size=10_000)


def test_junk_tokens_inside_an_answer_are_not_read_past(model_dir):
    """A padded-vocabulary id or a special token inside the answer made it malformed text, not the answer
    decoding silently dropped them to (`#2<bos>0` scored as `#20`); the final stop token is not text."""
    d = _data(model_dir, seed=0)
    good = d.tok.encode("7+15-2=22-2=20#20", add_special_tokens=False)
    assert d.reward(good + [d.eos_id], "20") == 1.0 and d.reward(good, "20") == 1.0
    assert d.tok.vocab_size < 30  # the model's rows past the tokenizer's ids (a padded vocabulary)
    for junk in (30, d.tok.bos_id, d.pad_id):
        assert d.reward(good[:-1] + [junk] + good[-1:] + [d.eos_id], "20") == 0.0, junk


def test_a_prompt_longer_than_max_prompt_len_names_the_field(model_dir):
    c = base_config()
    c.model.path = model_dir
    c.task.num_train, c.task.num_val, c.task.max_prompt_len = 64, 16, 1
    with pytest.raises(ConfigError, match=r"^config\.task\.max_prompt_len: prompt 0 has \d+ tokens > max_prompt_len=1"):
        TaskData(c, model_vocab_size=10_000)


def test_a_damaged_tokenizer_is_a_config_error_naming_the_file(model_dir, tmp_path):
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    c = base_config()
    c.model.path = str(broken)
    with pytest.raises(ConfigError, match=rf"^config\.model\.path: {broken / 'tokenizer.json'} is not a readable "
                                          r"tokenizer"):
        TaskData(c, model_vocab_size=10_000)
    (broken / "tokenizer.json").write_text((Path(model_dir) / "tokenizer.json").read_text())
    (broken / "tokenizer_config.json").write_text("{")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json is not valid JSON"):
        TaskData(c, model_vocab_size=10_000)


def test_a_split_too_small_for_num_val_is_a_config_error_naming_the_field_without_tfds(tmp_path, monkeypatch):
    """Within the bound but past what the split holds (25 problems, ~1 of them validation), the generator's
    ValueError escaped (exit 1), and with the `math` extra absent the handler's TFDS import hid it."""
    import json
    import sys

    save_tokenizer(build_arithmetic_tokenizer(), str(tmp_path))
    (tmp_path / "task.json").write_text(json.dumps({"spec": {"min_operands": 2, "max_operands": 2, "max_value": 4,
                                                             "ops": "+"}}))
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # an install without the `math` extra
    c = base_config()
    c.model.path, c.task.num_train, c.task.num_val, c.batch.prompts_per_step = str(tmp_path), 20, 3, 4
    with pytest.raises(ConfigError, match=r"^config\.task\.num_val: could only generate \d of 3 unique 'validation'"):
        TaskData(c, model_vocab_size=10_000)
