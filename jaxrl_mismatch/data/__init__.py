"""Tasks, datasets, tokenizers and rewards — everything before the rollout in the data flow.

The registry (:data:`TASKS`, :func:`get_task`) is what configs name: a task knows how to load its
uniform records ``{"prompt_text", "answer", ...}`` for a split, which reward scores a completion, and
which prompt template its prompts go through. See ``docs/data.md``.

TFDS (and with it the math builders) is imported only when a math task is loaded, so the arithmetic
demo and the rollout server do not pay for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from jaxrl_mismatch.data import arithmetic
from jaxrl_mismatch.data.rewards import RewardFn, get_reward

__all__ = ["TASKS", "Task", "get_task"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """A named task: a record loader, a reward function and a default prompt template.

    ``load(split, **options)`` returns the split's records; options depend on the task:

    - ``arithmetic``: ``n`` (number of problems), ``seed``, and any :class:`arithmetic.ArithmeticSpec`
      field (``min_operands``, ``max_operands``, ``max_value``, ``ops``, ``mul_prob``).
    - ``gsm8k``, ``math``, ``dapo``, ``prompts``, ``arithmetic_prompts``: ``files`` (split → JSONL path(s)) and ``data_dir``
      (where the TFDS ``array_record`` dataset is built).
    """

    name: str
    reward_name: str
    template: str
    loader: Callable[..., list[dict]]
    # A file task's check of its JSONL files (`files`: split → path(s)) without building anything: raises
    # `math_datasets.DataFormatError` naming file and line. None for a generated task.
    check_files: Callable[[Mapping[str, str | Sequence[str]]], None] | None = None

    @property
    def reward(self) -> RewardFn:
        return get_reward(self.reward_name)

    def load(self, split: str, **options) -> list[dict]:
        return self.loader(split, **options)


def _load_arithmetic(split: str, *, n: int, seed: int = 0, **spec_fields) -> list[dict]:
    unknown = set(spec_fields) - arithmetic.SPEC_FIELDS
    if unknown:
        raise ValueError(f"arithmetic task: unknown options {sorted(unknown)}; valid: n, seed, {sorted(arithmetic.SPEC_FIELDS)}")
    return arithmetic.records(arithmetic.ArithmeticSpec(**spec_fields), split, n, seed)


def _math_datasets(fmt: str):
    """The TFDS-backed module, imported when a file task needs it (a clear error without the math extra)."""
    try:
        from jaxrl_mismatch.data import math_datasets  # deferred TFDS import
    except ModuleNotFoundError as e:
        from jaxrl_mismatch.usage import UsageError

        raise UsageError(f"task format {fmt!r} needs the math extra ({e.name} is not installed): "
                         "pip install -e '.[math]'") from None
    return math_datasets


def _gold_check(reward_name: str) -> Callable[[str], None]:
    from jaxrl_mismatch.data.rewards import check_gold_answer

    return lambda answer: check_gold_answer(reward_name, answer)


def _file_loader(fmt: str, reward_name: str) -> Callable[..., list[dict]]:
    """The loader of a file-backed task: its records in format `fmt`, every gold answer checked against the task's
    reward before the dataset is built (one line naming file and line, not a failure at the first step)."""

    def load(split: str, *, files: Mapping[str, str | Sequence[str]], data_dir: str) -> list[dict]:
        return _math_datasets(fmt).load_records(fmt, files, data_dir, split, check_answer=_gold_check(reward_name))

    return load


def _file_check(fmt: str, reward_name: str) -> Callable[[Mapping[str, str | Sequence[str]]], None]:
    """What `_file_loader` validates (every line, every gold answer), without building: for `train`'s checks."""

    def check(files: Mapping[str, str | Sequence[str]]) -> None:
        _math_datasets(fmt).read_records(fmt, files, check_answer=_gold_check(reward_name))

    return check


def _file_task(name: str, fmt: str, reward_name: str, template: str) -> Task:
    return Task(name=name, reward_name=reward_name, template=template, loader=_file_loader(fmt, reward_name),
                check_files=_file_check(fmt, reward_name))


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(name="arithmetic", reward_name="arithmetic", template="arithmetic", loader=_load_arithmetic),
        _file_task("gsm8k", "gsm8k", "math", "qwen_boxed"),
        _file_task("math", "math", "math", "r1_distill"),
        _file_task("dapo", "dapo", "math", "dapo"),
        # Saved prompt sets (e.g. a perfectible subset), scored like the task they were drawn from.
        _file_task("prompts", "prompts", "math", "raw"),
        _file_task("arithmetic_prompts", "prompts", "arithmetic", "arithmetic"),
    )
}


def get_task(name: str) -> Task:
    """A registered task by name; raises naming the valid ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {sorted(TASKS)}")
    return TASKS[name]
