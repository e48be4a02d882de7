"""`TaskData`: what a run draws from its task — tokenised train prompts in a resumable order, the
validation set, the tokenizer and the reward of a completion.

Every training prompt is tokenised at start-up, so a prompt over `task.max_prompt_len` fails before the
first step, not at step 900.
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections

from jaxrl_mismatch.data import get_task
from jaxrl_mismatch.data.arithmetic import read_task_json
from jaxrl_mismatch.data.batching import (PromptError, PromptIterator, PromptTooLongError, generation_stop_ids,
                                         response_text, tokenize_prompts)
from jaxrl_mismatch.data.tokenizer import load_tokenizer
from jaxrl_mismatch.train.config import ConfigError


def task_options(c: ml_collections.ConfigDict, split: str, n: int) -> dict[str, Any]:
    """Loader options of the configured task; the synthetic task reuses the warm start's spec (task.json) and
    generates its problems from `task.data_seed`, not the run's `seed`: every seed of a grid then trains on the
    same problem set (in its own order) and is scored on the same held-out prompts."""
    if c.task.name == "arithmetic":
        try:
            spec = read_task_json(c.model.path)[0]
        except ValueError as e:  # a damaged task.json: one line naming the field and the file
            raise ConfigError(f"config.model.path: {e}") from None
        return {"n": n, "seed": c.task.data_seed, **spec}
    return {"files": c.task.files.to_dict(), "data_dir": c.task.data_dir or os.path.join(c.run_dir, "tfds")}


def _places(records: list[dict]) -> list[str] | None:
    """The "path:line" of each record of a file task (what `tokenize_prompts` names), else None ("prompt i")."""
    return [r["where"] for r in records] if records and all("where" in r for r in records) else None


class TaskData:
    def __init__(self, c: ml_collections.ConfigDict, model_vocab_size: int) -> None:
        try:
            self.tok = load_tokenizer(c.model.path)
        except (ValueError, OSError) as e:  # a damaged or missing tokenizer: one line naming the field and file
            raise ConfigError(f"config.model.path: {e}") from None
        try:
            self.tok.check_model_vocab(model_vocab_size)
            self.tok.check_model_eos(c.model.path)
        except ValueError as e:  # another model's tokenizer: a ValueError (exit 1) before it was caught here
            raise ConfigError(f"config.model.path: {os.path.join(c.model.path, 'tokenizer.json')}: {e}") from None
        self.task = get_task(c.task.name)
        self.template = c.task.template or self.task.template
        self.stop_ids = generation_stop_ids(self.tok, self.template)  # what ends a rollout and what the reward strips
        self.max_prompt_len = c.task.max_prompt_len
        train = self._load(c, c.task.train_split, c.task.num_train, "num_train")
        val = self._load(c, c.task.val_split, c.task.num_val, "num_val")
        for split, records in ((c.task.train_split, train), (c.task.val_split, val)):
            if not records:
                raise ConfigError(f"config.task: split {split!r} of task {c.task.name!r} is empty")
        val = val[: c.task.num_val]
        # Every prompt a run uses is tokenised before any weight is pushed or rollout made, an error naming the
        # prompt's file and line (a file task's records carry `where`; the loader checked the gold answers).
        source = "config.task.files" if c.task.name != "arithmetic" else "config.task"
        try:
            ids = self.tokenize([r["prompt_text"] for r in train], _places(train))
            val_ids = self.tokenize([r["prompt_text"] for r in val], _places(val))
        except PromptTooLongError as e:  # one line naming the field, and the prompt's file and line
            raise ConfigError(f"config.task.max_prompt_len: {e}") from None
        except PromptError as e:  # characters outside the vocabulary, no tokens at all
            raise ConfigError(f"{source}: {e}") from None
        self.prompts = PromptIterator([{"prompt_ids": p, "answer": r["answer"]} for p, r in zip(ids, train)],
                                      c.batch.prompts_per_step, seed=c.seed)
        self.val_ids = val_ids
        self.val_answers = [r["answer"] for r in val]
        self.longest_prompt = max(len(p) for p in ids + val_ids)  # tokens: what a rollout's context must hold

    def _load(self, c: ml_collections.ConfigDict, split: str, num: int, field: str) -> list[dict]:
        """The task's records of `split`; ConfigError naming the field for a file's bad record (file and line) or a
        generated task that cannot give `num` distinct problems (`config.task.<field>`)."""
        try:
            return self.task.load(split, **task_options(c, split, num))
        except ValueError as e:
            if self.task.check_files is None:  # a generated task (the arithmetic demo, which needs no TFDS)
                raise ConfigError(f"config.task.{field}: {e}") from None
            from jaxrl_mismatch.data.math_datasets import DataFormatError  # file tasks only (it imports TFDS)

            if isinstance(e, DataFormatError):  # names the file and line: one line, exit 2, like a config fault
                raise ConfigError(f"config.task.files: {e}") from None
            raise

    def tokenize(self, texts: list[str], where: list[str] | None = None) -> list[list[int]]:
        return tokenize_prompts(self.tok, texts, template=self.template, max_prompt_len=self.max_prompt_len,
                                where=where)

    def next_prompts(self) -> tuple[list[list[int]], list[str]]:
        recs = self.prompts.next_batch()
        return [r["prompt_ids"] for r in recs], [r["answer"] for r in recs]

    def reward(self, token_ids: list[int], answer: str) -> float:
        """The task's reward of a completion's text (`data.batching.response_text`: a final stop token is not
        text, other special tokens stay visible, an id past the tokenizer's vocabulary scores 0.0)."""
        text = response_text(self.tok, token_ids, self.stop_ids)
        return 0.0 if text is None else float(self.task.reward(text, answer))

    @property
    def eos_id(self) -> int:
        return self.tok.eos_id

    @property
    def pad_id(self) -> int:
        return self.tok.pad_id
