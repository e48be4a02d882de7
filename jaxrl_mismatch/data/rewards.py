"""Verifiable rewards: math answers checked with ``math-verify``, and a registry of reward functions.

Every reward function has the signature ``reward(completion: str, answer: str) -> float`` with values
in [0, 1]: 1.0 correct, 0.0 wrong or malformed. The completion is the *decoded response only*, never
prompt + response: its final stop token dropped, any other special token left visible so junk inside an
answer is not read past, and an id outside the tokenizer's vocabulary scoring 0.0 (`TaskData.reward`).

Math answers (:func:`math_reward`): the prediction is taken from the completion's last answer marker,
whichever kind: a non-empty ``\\boxed{...}`` (MATH, the Qwen/R1 templates), an ``Answer: ...`` line
(DAPO-Math-17k's own prompt asks for it) or a ``#### ...`` line (GSM8K). Only that span is parsed — parsing the whole
text would let math-verify pick up some intermediate number and reward an answer the policy never
gave. The gold answer is parsed as LaTeX and as a plain expression, so ``1/2``, ``0.5``,
``\\frac{1}{2}`` and ``\\dfrac12`` are all equal, as in the math-verify grader used by verl/Oat.

Timeouts: math-verify guards parsing and verifying with ``signal.alarm``, which only works in a main
thread. Off the main thread (the asynchronous rollout producer computes rewards on its own thread) a
completion such as ``\\boxed{9^{9^{9}}}`` would run unbounded and stall the run, so there the reward runs
in one persistent helper process (spawned, not forked: the trainer is multithreaded), in that process's
main thread where the alarms work, with ``OFF_THREAD_TIMEOUT_S`` as a backstop after which the helper is
killed, replaced, and the completion scores 0.0.
"""

from __future__ import annotations

import atexit
import re
import threading
from collections.abc import Callable

from jaxrl_mismatch.data import arithmetic

RewardFn = Callable[[str, str], float]

# An answer line starts its line ("Answer: 34", "**Answer:** 34"): "... the answer: yes" inside prose is not one,
# and a GSM8K final line gives a number ("#### 72"): a markdown heading "#### Verification" is not one.
# The answer may stand on one of the next two lines ("**Answer:**\n34"): the span starts at the first character not
# markdown emphasis or blank (a lone "*" or " " was the span, and outranked an earlier box).
# The span runs to the end of its line and its trailing emphasis / blanks are stripped after the match
# (`_line_span`): a lazy span before "[ \t*_]*$" rescanned a run of spaces from every position, quadratic (19 s for
# "Answer: 5" and 32,000 spaces).
_ANSWER_LINE = re.compile(r"^[ \t*_>#-]*answer[ \t*_]*:(?:[ \t*_]*\n){0,2}[ \t*_]*([^\s*_][^\n]*)$",
                          re.IGNORECASE | re.MULTILINE)
_GSM8K_FINAL = re.compile(r"^[ \t]*####[ \t]*([-+$]?[ \t]*[0-9.][^\n]*)$", re.MULTILINE)
# An equation in the answer span: math-verify grades the right-hand side of its last "=", so "6 (since 2+3=5)"
# or "1=2=3=4=5" graded as 5. Only "name = value" is an answer ("x = 5", "f(x) = 2x", "a_1 = 3"); any other
# span with "=" scores 0. ("<=", ">=", "!=" and ":=" are not equalities here.)
_EQUALS = re.compile(r"(?<![<>!:=])=(?!=)")
_ANSWER_NAME = re.compile(r"^\s*\\?[A-Za-z]+(?:_\{?[A-Za-z0-9]+\}?)?(?:\([^()=]*\))?\s*$")
# Other relations math-verify grades by a side, as it does "=": "3 \to 5", "x \Rightarrow 5", "3 == 5", "3 := 5"
# graded as 5, "3 \approx 5" as 3. A span holding one scores 0. (Inequalities stay answers: "x \le 3".)
_RELATION = re.compile(r"\\(?:to|gets|mapsto|(?:[Ll]ong)?(?:right|left|leftright)arrow"
                       r"|(?:Right|Left|Leftright)arrow|implies|impliedby|iff|equiv|sim|simeq|cong|approx|doteq)(?![A-Za-z])"
                       r"|[→←↔⇒⇐⇔⟹⟸⟺↦≈≡∼≃≅]|->|<-|=>|==|:=")
# A remark after an answer line's answer, "Answer: 7 (or maybe 5)", "#### 12 (dollars)": math-verify's plain pass
# graded its last number. The remark (a parenthesis after a space, ending the line) is not part of the answer.
_TRAILING_REMARK = re.compile(r"^(?!\()(.*?\S)\s+\([^()]*\)$")
# Inline math segments of a span ($...$, $$...$$, \(...\)), an escaped \$ being no delimiter. math-verify's LaTeX
# pass grades a span's last one, so "either $5$ or $7$" and "$5$ apples and $7$ pears" graded as 7: segments holding
# numbers with words between them state several answers. Commas, operators and blanks between them join one answer
# ("$1$, $2$, $3$", "$6$ $\text{cm}^3$", "$x^2$ + $3$").
_MATH_SEGMENT = re.compile(r"(?<!\\)\$+([^$]*?)(?<!\\)\$+|\\\((.*?)\\\)", re.DOTALL)
_WORD = re.compile(r"[A-Za-z]{2,}")


def _segments_with_words_between(span: str) -> bool:
    numeric = [m for m in _MATH_SEGMENT.finditer(span) if any(c in "0123456789" for c in m.group(0))]
    return any(_WORD.search(span[a.end():b.start()]) for a, b in zip(numeric, numeric[1:]))


def _one_answer(span: str) -> bool:
    """Whether `span` states one answer: no relation but "=", no "=" or one "=" after a name (`_EQUALS`), and
    no words between math segments holding numbers (`_MATH_SEGMENT`)."""
    if _RELATION.search(span):
        return False
    if _segments_with_words_between(span):
        return False  # several answers: math-verify would grade the last
    parts = _EQUALS.split(span)
    return len(parts) == 1 or (len(parts) == 2 and bool(_ANSWER_NAME.match(parts[0])))


def _line_span(m: re.Match) -> str:
    """The answer of an `Answer:` / `####` line match, without its trailing markdown emphasis and blanks."""
    return m.group(1).rstrip(" \t\r*_")


def _line_answer(span: str) -> str:
    """An `Answer:` / `####` line's answer without a trailing remark in parentheses (`_TRAILING_REMARK`)."""
    m = _TRAILING_REMARK.match(span.strip())
    return m.group(1) if m else span


def _last_box_start(text: str) -> int:
    """Where the last ``\\boxed`` / ``\\fbox`` starts, or -1."""
    return max(text.rfind("\\boxed"), text.rfind("\\fbox"))


# The argument of a box command without braces: "\\boxed 5" is valid LaTeX for one token; the span is the next
# blank-delimited text ("\\boxed -\\frac{1}{2}", "\\boxed .5"). No such text, or a word of prose ("I put it in
# \\boxed.", "as \\boxed asks"), is a mention of the command, no answer.
_BARE_BOX_ARG = re.compile(r"\s+(?![A-Za-z]{2})(\S+)")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces, or None (none, or the last one
    truncated). A box command with no argument is a mention: the box before it counts (it hid the answer)."""
    return _last_box(text)[1]


def _last_box(text: str) -> tuple[int, str | None]:
    """`last_boxed`'s box: where it starts (-1: none) and its content (None: none, or truncated)."""
    while (start := _last_box_start(text)) >= 0:
        i = start + len("\\boxed" if text.startswith("\\boxed", start) else "\\fbox")
        j = i
        while j < len(text) and text[j].isspace():
            j += 1
        if j < len(text) and text[j] == "{":
            depth = 0
            for k in range(j, len(text)):
                if text[k] == "{":
                    depth += 1
                elif text[k] == "}":
                    depth -= 1
                    if depth == 0:
                        return start, text[j + 1 : k]
            return start, None  # unbalanced: truncated response
        if m := _BARE_BOX_ARG.match(text, i):
            return start, m.group(1)
        text = text[:start]
    return -1, None


def extract_math_answer(completion: str) -> str | None:
    """The span holding the final answer, or None: the last answer marker of the completion, whichever kind — a
    non-empty ``\boxed{}``, an ``Answer:`` line (DAPO), a ``####`` line (GSM8K). So a box in the working does not
    outrank the ``Answer:`` line after it, and an empty ``\boxed{}`` mentioned in passing hides no answer."""
    candidates = []  # (where the marker starts, its span)
    text = completion
    while (box := _last_box(text))[1] is not None:  # the last non-empty box (an unbalanced last one: none)
        start, boxed = box
        if boxed.strip():
            candidates.append((start, boxed))
            break
        text = text[:start]
    for pattern in (_ANSWER_LINE, _GSM8K_FINAL):
        found = list(pattern.finditer(completion))
        if found:
            candidates.append((found[-1].start(), _line_answer(_line_span(found[-1]))))
    return max(candidates, key=lambda c: c[0])[1] if candidates else None


def gsm8k_final_answer(solution: str) -> str:
    """The gold answer of a GSM8K solution (text after ``####``, thousands separators removed)."""
    found = [_line_span(m) for m in _GSM8K_FINAL.finditer(solution)]
    if not found:
        raise ValueError(f"GSM8K answer has no '#### <answer>' line: {solution[-80:]!r}")
    return found[-1].replace(",", "").strip()


# An answer span longer than this is no final answer: a degenerate response ("Answer: 5", 32,000 spaces, "7"; a box
# of a million digits) held math-verify's parse to its timeouts, 10 s a completion, and scores 0.
MAX_ANSWER_CHARS = 2000
_BLANKS = re.compile(r"\s+")
_THIN_SPACE_THOUSANDS = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")
MATH_VERIFY_TIMEOUT_S = 5  # math-verify's alarms: `_math_reward` runs in a main thread (its own, or the helper's)


def _parse(text: str, *, one_answer: bool = True) -> list:
    import math_verify  # deferred: imports sympy (~1 s), not needed by the arithmetic demo
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    first = []
    # LaTeX wrapped in $...$ covers \frac, \sqrt, \pi; the plain-expression pass covers 0.5, 1/2, -3, "34.".
    # A pass that found no expression still returns the raw string (math-verify's fallback), which compares
    # literally: only an expression ends the search, else the first pass's string is the answer.
    for candidate, configs in (
        (f"${text}$", [LatexExtractionConfig()]),
        (text, [ExprExtractionConfig()]),
    ):
        try:
            parsed = math_verify.parse(candidate, extraction_config=configs, parsing_timeout=MATH_VERIFY_TIMEOUT_S)
        except Exception:  # math-verify raises on pathological input; treat as unparseable
            parsed = []
        if one_answer and candidate is text and _other_numbers(text, parsed):
            return []  # the plain pass took the last of several numbers: "5 or 7." and "5 \xrightarrow{} 7" read 7
        if any(not isinstance(p, str) for p in parsed):
            return parsed
        first = first or parsed
    return first


def _other_numbers(text: str, parsed: list) -> bool:
    """Whether the plain pass's match (math-verify returns [expression, matched text]) leaves a digit of `text`
    outside it. That pass takes the span's last expression, so a span the LaTeX pass could not read that holds
    several answers ("5 or 7.", "5 [or 7]", "1, 2, \\dots, 42", "5 \\hookrightarrow 7") was graded by its last
    number; it holds no one answer and scores 0."""
    matched = next((p for p in parsed[1:] if isinstance(p, str)), None) if len(parsed) > 1 else None
    if not matched or matched not in text:
        return False
    at = text.rfind(matched)
    return any(c in "0123456789" for c in text[:at] + text[at + len(matched):])  # not "m²": a unit, no number


OFF_THREAD_TIMEOUT_S = 30.0  # > math-verify's own alarms (5 s per parse, 5 s to verify) in the helper
_helper = None
_helper_lock = threading.Lock()


def _off_thread(completion: str, answer: str) -> float:
    """`math_reward` in the helper process (module doc); 0.0 if it has not answered in time."""
    import multiprocessing

    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = multiprocessing.get_context("spawn").Pool(1)
            atexit.register(_helper.terminate)  # before the interpreter tears down what its pipes use
        pending = _helper.apply_async(_math_reward, (completion, answer))
        try:
            return pending.get(timeout=OFF_THREAD_TIMEOUT_S)
        except multiprocessing.TimeoutError:
            _helper.terminate()  # it is stuck in that completion: a fresh one takes the next
            _helper = None
            return 0.0


def math_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer is mathematically equal to ``answer``, else 0.0.

    Malformed completions (no boxed/``Answer:``/``####`` answer, an unbalanced box, something that
    does not parse, an answer with an equation other than ``name = value``) score 0.0. An empty gold answer is
    a data error and raises. (math-verify keeps non-mathematical text as a string and compares it literally, so
    text answers still work.) Off the main thread it runs time-bounded in a helper process (module doc).
    """
    if threading.current_thread() is not threading.main_thread():
        return _off_thread(completion, answer)
    return _math_reward(completion, answer)


def math_gold_answer(answer: str) -> list:
    """The gold answer as `math_reward` reads it (math-verify's parse); ValueError when it is empty or math-verify
    reads nothing in it (`\\`, `$$`, `\\boxed{}`: checked only at the first step that sampled it before). About
    0.4 ms a gold answer: the task loaders check every record before a run starts."""
    if not str(answer).strip():
        raise ValueError(f"math reward: gold answer {answer!r} is empty")
    gold = _parse(str(answer), one_answer=False)  # read as before: one odd gold must not refuse a whole dataset
    if not gold:
        raise ValueError(f"math reward: gold answer {answer!r} cannot be parsed by math-verify")
    return gold


def _math_reward(completion: str, answer: str) -> float:
    import math_verify

    gold = math_gold_answer(answer)
    span = extract_math_answer(completion)
    if span is None or not span.strip() or len(span) > MAX_ANSWER_CHARS or not _one_answer(span):
        return 0.0
    span = _BLANKS.sub(" ", span)  # LaTeX and plain expressions ignore runs of blanks; math-verify's parse did not
    span = _THIN_SPACE_THOUSANDS.sub("", span)  # "5\,000" was read as 5·000 = 0 (5,\!000 and 5{,}000 were fine)
    pred = _parse(span)
    if not pred:
        return 0.0
    try:
        return 1.0 if math_verify.verify(gold, pred, timeout_seconds=MATH_VERIFY_TIMEOUT_S) else 0.0
    except Exception:
        return 0.0


REWARDS: dict[str, RewardFn] = {
    "arithmetic": arithmetic.reward,
    "math": math_reward,
}


# Each reward's reading of a gold answer (it raises ValueError, in the reward's words, on one it cannot read): the
# task loaders check every record with it before a run or a filter starts.
GOLD_ANSWERS: dict[str, Callable[[str], object]] = {
    "arithmetic": arithmetic.gold_answer,
    "math": math_gold_answer,
}


def check_gold_answer(name: str, answer: str) -> None:
    """Raise ValueError (the reward's own message) when reward `name` could not read the gold `answer`: it raised
    at the first step that sampled the prompt, after the rollout server had started."""
    GOLD_ANSWERS[name](answer)


def get_reward(name: str) -> RewardFn:
    """A reward function by name (``arithmetic`` exact integer match; ``math`` math-verify)."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {sorted(REWARDS)}")
    return REWARDS[name]
