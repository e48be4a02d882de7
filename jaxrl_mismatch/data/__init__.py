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


def _file_loader(fmt: str, reward_name: str) -> Callable[..., list[dict]]:
    """The loader of a file-backed task: its records in format `fmt`, every gold answer checked against the task's
    reward before the dataset is built (one line naming file and line, not a failure at the first step)."""

    def load(split: str, *, files: Mapping[str, str | Sequence[str]], data_dir: str) -> list[dict]:
        try:
            from jaxrl_mismatch.data import math_datasets  # deferred TFDS import
        except ModuleNotFoundError as e:
            from jaxrl_mismatch.usage import UsageError

            raise UsageError(f"task format {fmt!r} needs the math extra ({e.name} is not installed): "
                             "pip install -e '.[math]'") from None

        from jaxrl_mismatch.data.rewards import check_gold_answer

        return math_datasets.load_records(fmt, files, data_dir, split,
                                          check_answer=lambda answer: check_gold_answer(reward_name, answer))

    return load


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(name="arithmetic", reward_name="arithmetic", template="arithmetic", loader=_load_arithmetic),
        Task(name="gsm8k", reward_name="math", template="qwen_boxed", loader=_file_loader("gsm8k", "math")),
        Task(name="math", reward_name="math", template="r1_distill", loader=_file_loader("math", "math")),
        Task(name="dapo", reward_name="math", template="dapo", loader=_file_loader("dapo", "math")),
        # Saved prompt sets (e.g. a perfectible subset), scored like the task they were drawn from.
        Task(name="prompts", reward_name="math", template="raw", loader=_file_loader("prompts", "math")),
        Task(name="arithmetic_prompts", reward_name="arithmetic", template="arithmetic",
             loader=_file_loader("prompts", "arithmetic")),
    )
}


def get_task(name: str) -> Task:
    """A registered task by name; raises naming the valid ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {sorted(TASKS)}")
    return TASKS[name]
