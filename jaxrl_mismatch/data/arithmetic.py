"""Synthetic verifiable reasoning task: multi-step integer arithmetic with a written scratchpad.

Why this task: the CPU demo needs a problem that a 2–4 layer, d=128 transformer learns to *partly*
solve in a few minutes of supervised training, that is checked exactly (no reward model), and whose
responses get longer with difficulty — so the length monitor and the mismatch metrics have something
to see. Each scratchpad step rewrites the whole expression with one operation carried out; copying
with a local edit is what small attention stacks learn fastest, and every step is short-range.

Format (character level, no spaces)::

    prompt:    "7+5*3-2="
    response:  "7+15-2=22-2=20#20"          (then <eos>)

Multiplications are done first, left to right, then additions/subtractions left to right; the final
answer follows ``#``. A negative running result can only appear at the front of the expression
(``2-9+1=`` → ``-7+1=-6#-6``), so the grammar stays ``term (op term)*`` with an optional leading
minus.

Splits never overlap: a problem's split is a pure function of the *prompt string* (a SHA-256
bucket), so the same expression cannot appear in two splits whatever the seed or the count asked
for. Within a split, problems are unique and generated deterministically from ``seed``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re

import numpy as np

SPLITS = ("train", "validation", "test")
_OPS = ("+", "-", "*")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticSpec:
    """Difficulty knob of the task.

    Attributes:
      min_operands, max_operands: number of operands per problem (inclusive range); each extra
        operand adds one scratchpad step, so this sets response length.
      max_value: operands are drawn uniformly from ``[0, max_value]``.
      ops: the operator alphabet to draw from (subset of ``"+-*"``).
      mul_prob: probability that an operator is ``*`` (when ``*`` is in ``ops``); the rest is split
        evenly between the other operators. Chains of ``*`` make multi-digit products — the hard part.
      validation_permille, test_permille: share of the problem space (by prompt hash) reserved for
        the held-out splits, in 1/1000.
    """

    min_operands: int = 3
    max_operands: int = 5
    max_value: int = 9
    ops: str = "+-*"
    mul_prob: float = 0.3
    validation_permille: int = 50
    test_permille: int = 50

    def __post_init__(self) -> None:
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(
                f"ArithmeticSpec: need 2 <= min_operands <= max_operands, got {self.min_operands}, {self.max_operands}"
            )
        if self.max_value < 1:
            raise ValueError(f"ArithmeticSpec.max_value must be >= 1, got {self.max_value}")
        if not self.ops or any(o not in _OPS for o in self.ops) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ArithmeticSpec.ops must be distinct characters from '+-*', got {self.ops!r}")
        if not 0.0 <= self.mul_prob <= 1.0:
            raise ValueError(f"ArithmeticSpec.mul_prob must be in [0, 1], got {self.mul_prob}")
        if self.validation_permille < 0 or self.test_permille < 0 or self.validation_permille + self.test_permille >= 1000:
            raise ValueError("ArithmeticSpec: validation_permille + test_permille must be in [0, 1000)")

    @property
    def num_problems(self) -> int:
        """How many distinct problems the spec can draw, all splits together: Σ_k (max_value + 1)^k · m^(k − 1)
        over the operand counts k, m the operators that can occur (`*` only when mul_prob > 0 or alone; the others
        only when mul_prob < 1 or `*` is absent). A rendered prompt names its operands and operators, so distinct
        draws are distinct prompts."""
        others = [o for o in self.ops if o != "*"]
        star = "*" in self.ops and (self.mul_prob > 0 or not others)
        other = bool(others) and not ("*" in self.ops and self.mul_prob >= 1.0)
        m = int(star) + (len(others) if other else 0)
        return sum((self.max_value + 1) ** k * m ** (k - 1) for k in range(self.min_operands, self.max_operands + 1))

    def split_capacity(self, split: str) -> int:
        """An upper bound on the distinct problems of `split`: its share of `num_problems` (the prompt hash's
        buckets) plus six standard deviations of that binomial count. Asked for more, `generate` could never
        finish (and drawing until it gives up took hours for a spec of millions)."""
        check_split(split)
        share = {"validation": self.validation_permille, "test": self.test_permille}.get(
            split, 1000 - self.validation_permille - self.test_permille) / 1000
        n = self.num_problems
        return min(n, math.floor(share * n + 6 * math.sqrt(share * (1 - share) * n)) + 1)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: the prompt, the full scratchpad response used for SFT, and the final answer."""

    prompt: str
    response: str
    answer: int

    def record(self) -> dict[str, str]:
        """The uniform record every task yields (``prompt_text``, ``answer``), plus the SFT target."""
        return {"prompt_text": self.prompt, "answer": str(self.answer), "target_text": self.response}


def _render(values: list[int], ops: list[str]) -> str:
    out = [str(values[0])]
    for op, v in zip(ops, values[1:]):
        out.append(op + str(v))
    return "".join(out)


def solve_steps(values: list[int], ops: list[str]) -> list[str]:
    """The scratchpad: the expression after each single operation, ending with the bare result.

    One multiplication per step (leftmost first), then one addition/subtraction per step (leftmost
    first, which keeps the running result at the front).
    """
    values, ops = list(values), list(ops)
    steps = []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, b, op = values[i], values[i + 1], ops[i]
        r = a * b if op == "*" else a + b if op == "+" else a - b
        values[i : i + 2] = [r]
        del ops[i]
        steps.append(_render(values, ops))
    return steps


def make_problem(values: list[int], ops: list[str]) -> Problem:
    """Build a :class:`Problem` from operands and operators (``len(ops) == len(values) - 1``)."""
    if len(ops) != len(values) - 1 or not ops:
        raise ValueError(f"need len(ops) == len(values) - 1 >= 1, got {len(values)} values, {len(ops)} ops")
    steps = solve_steps(values, ops)
    answer = int(steps[-1])
    return Problem(prompt=_render(values, ops) + "=", response="=".join(steps) + f"#{answer}", answer=answer)


def split_of(prompt: str, spec: ArithmeticSpec) -> str:
    """Which split a prompt belongs to — a pure function of the prompt text, so splits cannot overlap."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little") % 1000
    if bucket < spec.validation_permille:
        return "validation"
    if bucket < spec.validation_permille + spec.test_permille:
        return "test"
    return "train"


def _sample(rng: np.random.Generator, spec: ArithmeticSpec) -> Problem:
    n = int(rng.integers(spec.min_operands, spec.max_operands + 1))
    values = [int(v) for v in rng.integers(0, spec.max_value + 1, size=n)]
    others = [o for o in spec.ops if o != "*"]
    ops = []
    for _ in range(n - 1):
        if "*" in spec.ops and (not others or rng.random() < spec.mul_prob):
            ops.append("*")
        else:
            ops.append(others[int(rng.integers(len(others)))])
    return make_problem(values, ops)


SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(ArithmeticSpec))  # the options a spec takes
TASK_FILE = "task.json"  # what a warm start writes beside its checkpoint: the spec it was trained on


def read_task_json(model_dir: str | os.PathLike) -> tuple[dict, int | None]:
    """(ArithmeticSpec fields, max_new_tokens or None) from a warm-started checkpoint's `task.json`; ({}, None)
    when there is none. Training, `analyze` and `perfectible` draw their prompts from that spec, so a damaged
    file is a ValueError naming it (not valid JSON, not an object, an unknown or invalid spec field)."""
    path = os.path.join(os.fspath(model_dir), TASK_FILE)
    if not os.path.exists(path):
        return {}, None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    spec = record.get("spec", {}) if isinstance(record, dict) else None
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: expected a JSON object with a 'spec' object")
    if unknown := sorted(set(spec) - SPEC_FIELDS):
        raise ValueError(f"{path}: unknown spec field(s) {unknown}; valid: {sorted(SPEC_FIELDS)}")
    try:
        ArithmeticSpec(**spec)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    max_new = record.get("max_new_tokens")
    return spec, max_new if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new > 0 else None


def check_split(split: str) -> None:
    """ValueError naming the valid splits unless `split` is one (before any work: `perfectible`, `analyze`)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")


def generate(spec: ArithmeticSpec, split: str, n: int, seed: int = 0) -> list[Problem]:
    """``n`` unique problems of ``split``, deterministic in ``(spec, split, n, seed)``.

    Candidates are drawn from one stream seeded by ``(seed, split index)`` and kept when their prompt
    hashes into ``split``; a prefix of the result for a smaller ``n`` is the same problems.
    """
    capacity = spec.split_capacity(split)
    if n > capacity:  # found at once: drawing would take hours to give up for millions
        raise ValueError(f"asked for {n} unique {split!r} problems, but the {split!r} split of {spec} holds at most "
                         f"{capacity} (its share of {spec.num_problems} distinct problems); widen the spec (operands, "
                         "max_value) or ask for fewer")
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    seen: set[str] = set()
    out: list[Problem] = []
    tries, max_tries = 0, 200 * max(n, 1) + 10_000
    while len(out) < n:
        tries += 1
        if tries > max_tries:
            raise ValueError(
                f"could only generate {len(out)} of {n} unique {split!r} problems from {spec}; "
                "widen the spec (operands, max_value) or ask for fewer"
            )
        p = _sample(rng, spec)
        if p.prompt in seen or split_of(p.prompt, spec) != split:
            continue
        seen.add(p.prompt)
        out.append(p)
    return out


def records(spec: ArithmeticSpec, split: str, n: int, seed: int = 0) -> list[dict[str, str]]:
    """:func:`generate` as uniform records ``{"prompt_text", "answer", "target_text"}``."""
    return [p.record() for p in generate(spec, split, n, seed)]


# The answer as the scratchpad writes it: ASCII digits, no leading zero, no "-0", directly after "#"; only
# whitespace after it. (`\d` took Unicode digits, and `#\s*` a space or newline before the answer: "#06", "# 6"
# and "#\n6" scored 1.0 against 6.)
_ANSWER_RE = re.compile(r"#(0|-?[1-9][0-9]*)\s*$")
# the answer written as above
_CHAIN_RE = re.compile(r"^-?[0-9]+([+\-*][0-9]+)*(=-?[0-9]+([+\-*][0-9]+)*)*#(0|-?[1-9][0-9]*)$")


def extract_answer(completion: str) -> int | None:
    """The integer right after the single ``#`` at the end, written as the scratchpad writes integers (ASCII
    digits, no leading zeros, no ``-0``; trailing whitespace allowed), or None when malformed.

    Anything after the answer other than whitespace, or a second ``#`` (a policy that keeps writing
    past where ``<eos>`` should have come), makes the completion malformed: we score what the policy
    wrote, not the most favourable piece of it. What precedes ``#`` is not checked here — the reward
    is the final answer; :func:`is_well_formed` checks the scratchpad grammar.
    """
    if completion.count("#") != 1:
        return None
    m = _ANSWER_RE.search(completion)
    return None if m is None else int(m.group(1))


def is_well_formed(completion: str) -> bool:
    """Whether the completion follows the scratchpad grammar ``expr(=expr)*#int`` (whatever its values)."""
    return _CHAIN_RE.match(completion.strip()) is not None


def gold_answer(answer: str | int) -> int:
    """The integer a gold answer stands for, as `reward` reads it; ValueError when it is none ("4.0", "abc"): the
    loaders check every record's answer with it, so bad data fails at start-up naming its line, not at a step."""
    text = str(answer).strip()
    if re.fullmatch(r"[+-]?[0-9]+", text) is None:  # int() also reads "1_0" as 10 and Unicode digits
        raise ValueError(f"arithmetic reward: gold answer {answer!r} is not an integer")
    return int(text)


def reward(completion: str, answer: str | int, *, format_bonus: float = 0.0) -> float:
    """Exact-match reward: 1.0 if the final answer equals ``answer``, else ``format_bonus`` for a
    well-formed but wrong scratchpad, else 0.0.

    The default (``format_bonus=0``) is the pure verifiable 0/1 reward the papers use; a small bonus
    (e.g. 0.1) can help a policy that has not learnt the format, at the price of a reward that is no
    longer a success indicator.
    """
    gold = gold_answer(answer)
    pred = extract_answer(completion)
    if pred is not None and pred == gold:
        return 1.0
    return float(format_bonus) if format_bonus and is_well_formed(completion) else 0.0
