"""math-verify rewards: boxed / 'Answer:' / '####' answers, equivalent forms, malformed completions."""

import threading

import pytest

from jaxrl_mismatch.data import rewards as R


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("so the answer is \\boxed{0.5}", "1/2"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{1/2}", "\\frac{1}{2}"),
        ("\\boxed{\\dfrac12}", "\\frac{1}{2}"),
        ("steps...\nAnswer: 34", "34"),  # DAPO's own answer line
        ("Answer: $\\frac{3}{4}$", "0.75"),
        ("48/2 = 24\n#### 72", "72"),  # GSM8K style
        ("\\boxed{x^2+1}", "1+x^2"),
        ("first \\boxed{3}, finally \\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}"),  # the last box counts
        ("\\boxed{1,000}", "1000"),
        # trailing punctuation and markdown: the plain-expression pass (LaTeX's raw-string fallback skipped it)
        ("steps...\nAnswer: 34.", "34"),
        ("**Answer:** 34", "34"),
        ("Answer: **34**", "34"),
        ("#### 34.", "34"),
        ("Answer: 1/2.", "1/2"),
        ("\\boxed 5.", "5"),
        ("\\boxed 5 so check \\frac{10}{2}=5", "5"),  # a brace-less box: the later "{" is not its argument
        # the last answer marker counts, whichever kind: an empty box in passing hid the Answer line (0.0), and
        # a box in the working outranked the final Answer line after it
        ("Answer: 12\n(as requested, no \\boxed{} used)", "12"),
        ("try \\boxed{5}, recheck...\nAnswer: 7", "7"),
        ("Answer: 7? no: \\boxed{5}", "5"),
        ("\\boxed{12} (\\boxed{} left empty)", "12"),
        # "name = value" is an answer; prose after the final box is not a marker ("the answer:", a "####" heading)
        ("\\boxed{x = 5}", "5"),
        ("\\boxed{f(x) = 2x}", "2x"),
        ("\\boxed{a_1=3}", "3"),
        ("\\boxed{5}. Let me double-check the answer: yes.", "5"),
        ("\\boxed{5}\n\n#### Verification\nok", "5"),
        # the answer on the next line(s) of a markdown answer line: its span was "*" or " " (0.0, and it outranked
        # an earlier box); a remark in parentheses after an answer line's answer is not part of it
        ("so \\boxed{34}.\n\n**Answer:**\n34", "34"),
        ("**Answer:**\n\n$34$", "34"),
        ("Answer: \n34", "34"),
        ("Answer: 12 (dollars)", "12"),
        ("#### 72 (the total)", "72"),
        ("Answer: (1, 2)", "(1,2)"),
        ("\\boxed{x \\le 3}", "x<=3"),  # an inequality is an answer
        # a thin space as the thousands separator: read as 5·000 = 0 before (5,\\!000 and 5{,}000 were fine)
        ("\\boxed{5\\,000}", "5000"),
        ("\\boxed{1\\,234\\,567}", "1234567"),
        # a superscript unit is no second number (str.isdigit() took "²" for one: 0.0)
        ("Answer: 25 m²", "25"),
        ("#### 12 ft³", "12"),
        # a box command mentioned after the final box, with no argument: the span was None or "asks)." (0.0)
        ("\\boxed{5}\nI put it in \\boxed.", "5"),
        ("The answer is \\boxed{5} (as \\boxed asks).", "5"),
        ("\\boxed{}, then \\boxed{5}; \\fbox and \\boxed were used", "5"),
        # one math segment among words, a unit in the segment, and an escaped dollar are one answer
        ("Answer: $7$ apples", "7"),
        ("Answer: $$7$$", "7"),
        ("Answer: \\(7\\) apples", "7"),
        ("\\boxed{5 \\text{ cm}^2}", "5"),
        # several segments joined by commas, operators or blanks are one answer (a first version of the rule above
        # refused these: a review of the change found them scoring 0)
        ("Answer: $1$, $2$, $3$", "1, 2, 3"),
        ("so \\boxed{$-2$, $3$}", "-2, 3"),
        ("Answer: $\\frac{1}{2}$ $\\text{m}^2$", "\\frac{1}{2}"),
        ("Answer: $6$ $\\text{cm}^3$", "6"),
        ("Answer: $x^2$ + $3$", "x^2+3"),
        # a brace-less box takes the next text whatever it starts with; only a word of prose is a mention
        ("final: \\boxed -\\frac{1}{2}", "-1/2"),
        ("final: \\boxed .5", "0.5"),
        ("final: \\boxed (1,2)", "(1,2)"),
        ("final: \\boxed -x", "-x"),
    ],
)
def test_correct_answers_in_equivalent_forms(completion, gold):
    assert R.math_reward(completion, gold) == 1.0


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("\\boxed{3}", "4"),
        ("\\boxed{0.51}", "1/2"),
        ("the answer is 5", "5"),  # no final-answer marker: malformed
        ("\\boxed{5", "5"),  # truncated box
        ("\\boxed{}", "5"),
        ("1/2 appears in the text but \\boxed{7}", "1/2"),  # only the final answer is graded
        ("", "5"),
        ("Answer: 35.", "3"),
        ("Answer: 34 or 35", "34"),
        ("Answer: not 5", "5"),
        ("try \\boxed{5}, recheck...\nAnswer: 7", "5"),  # the box was the working, not the final answer
        # an equation in the answer: math-verify grades the right side of its last "=", which rewarded these
        ("Answer: 6 (since 2+3=5)", "5"),
        ("Answer: 6. Verification: 1+4=5", "5"),
        ("\\boxed{6 \\text{ since } 2+3=5}", "5"),
        ("\\boxed{6=5}", "5"),
        ("\\boxed{1=2=3=4=5}", "5"),
        ("\\boxed{5}\n\n#### 6", "5"),  # a GSM8K final line after the box is the final answer
        # other relations math-verify grades by a side, as it does "=" (each scored 1.0)
        ("\\boxed{3 \\to 5}", "5"),
        ("\\boxed{x \\Rightarrow 5}", "5"),
        ("\\boxed{3 \\implies 5}", "5"),
        ("\\boxed{3 \\Longrightarrow 5}", "5"),
        ("\\boxed{3 == 5}", "5"),
        ("\\boxed{3 := 5}", "5"),
        ("Answer: 3 → 5", "5"),
        ("\\boxed{3 \\approx 5}", "3"),
        # a hedge after an answer line's answer: the plain pass graded its last number
        ("Answer: 7 (or maybe 5)", "5"),
        ("Answer: 6 (since 2+3 -> 5)", "5"),
        # spans the LaTeX pass cannot read, graded by the plain pass's last number (a review found 30 such)
        ("\\boxed{5 \\xrightarrow{} 7}", "7"),
        ("\\boxed{5 \\hookrightarrow 7}", "7"),
        ("\\boxed{5 \\propto 7}", "7"),
        ("\\boxed{1, 2, \\dots, 42}", "42"),
        ("Answer: 5 or 7.", "7"),
        ("Answer: 5 [or 7]", "7"),
        ("Answer: 5 -- or maybe 7", "7"),
        ("Answer: 5 & 7", "7"),
        # a degenerate span: no final answer, and no 10 s in math-verify's timeouts
        ("Answer: 5" + " " * 3000 + "7", "7"),
        # math segments with numbers and words between them: the LaTeX pass graded the last one (each scored 1.0)
        ("Answer: either $5$ or $7$", "7"),
        ("Answer: $5$ apples and $7$ pears", "7"),
        ("#### $5$ apples and $7$ pears", "7"),
        ("\\boxed{\\text{$5$ or $7$}}", "7"),
        ("Answer: $12$ if order matters, otherwise $6$", "6"),
        ("Answer: \\(5\\) or \\(7\\)", "7"),
        ("\\boxed{5} then \\boxed{", "5"),  # a truncated last box still hides the earlier one
    ],
)
def test_wrong_or_malformed_score_zero(completion, gold):
    assert R.math_reward(completion, gold) == 0.0


def test_last_boxed_balances_braces():
    assert R.last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert R.last_boxed("\\boxed 7") == "7"
    assert R.last_boxed("no box") is None
    assert R.last_boxed("so \\boxed{42}. We used \\boxed as asked.") == "42"  # a solution's gold after a mention
    assert R.last_boxed("\\boxed{42} and \\boxed.") == "42" and R.last_boxed("\\boxed{4") is None


def test_gsm8k_final_answer():
    assert R.gsm8k_final_answer("a\nb\n#### 1,234") == "1234"
    with pytest.raises(ValueError, match="####"):
        R.gsm8k_final_answer("no marker")


@pytest.mark.parametrize("gold", ["\\", "$", "$$", "\\boxed{}", "\\text{}"])
def test_a_gold_answer_math_verify_reads_nothing_in_is_refused_when_checked(gold):
    """The load-time check refused only blank gold answers: these passed it and raised at the first step that
    sampled their prompt, after the rollout server had started."""
    with pytest.raises(ValueError, match="cannot be parsed by math-verify"):
        R.check_gold_answer("math", gold)


def test_a_gold_answer_is_read_as_before_even_where_a_prediction_must_hold_one_answer():
    """The one-answer rule is for predictions: applied to gold answers, a repeating decimal (0.\\overline{3})
    refused a whole MATH-style file at load."""
    R.check_gold_answer("math", "0.\\overline{3}")
    R.check_gold_answer("math", "5 cm²")


def test_answer_lines_are_found_in_linear_time():
    """A lazy span before "[ \\t*_]*$" rescanned a run of spaces from every position: 19 s for 32,000 spaces."""
    import time

    t0 = time.perf_counter()
    assert R.extract_math_answer("Answer: 5" + " " * 32000 + "7") is not None
    assert R.extract_math_answer("#### 5" + " " * 32000 + "x") is not None
    assert time.perf_counter() - t0 < 5.0  # a hang guard, as the helper test's: about 1 ms now, 40 s before
    assert R.extract_math_answer("**Answer:** 34 \t ** ") == "34" and R.gsm8k_final_answer("#### 1,234  \n") == "1234"


def test_empty_gold_is_a_data_error():
    with pytest.raises(ValueError, match="gold answer"):
        R.math_reward("\\boxed{1}", "  ")


def test_text_answers_compare_literally():
    assert R.math_reward("\\boxed{(B)}", "(B)") == 1.0
    assert R.math_reward("\\boxed{(C)}", "(B)") == 0.0


def test_works_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(R.math_reward("\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]


def test_off_the_main_thread_a_pathological_answer_is_bounded_and_errors_still_raise(monkeypatch):
    """`\\boxed{9^{9^{9}}}` ran > 100 s on a worker thread (math-verify's alarms only work in a main thread);
    the helper process's alarms end it at ~5 s with 0.0, and a stuck helper is replaced after the backstop."""
    import time

    def on_thread(fn):
        out = []
        t = threading.Thread(target=lambda: out.append(_call(fn)))
        t.start()
        t.join()
        return out[0]

    def _call(fn):
        try:
            return fn()
        except ValueError as e:
            return e

    t0 = time.monotonic()
    assert on_thread(lambda: R.math_reward("\\boxed{9^{9^{9}}}", "5")) == 0.0
    assert time.monotonic() - t0 < 20
    assert on_thread(lambda: R.math_reward("\\boxed{5}", "5")) == 1.0  # the same helper goes on
    assert isinstance(on_thread(lambda: R.math_reward("\\boxed{1}", " ")), ValueError)  # a data error still raises
    monkeypatch.setattr(R, "OFF_THREAD_TIMEOUT_S", 0.5)  # the backstop: a helper that does not answer in time
    assert on_thread(lambda: R.math_reward("\\boxed{9^{9^{9}}}", "5")) == 0.0 and R._helper is None
    monkeypatch.setattr(R, "OFF_THREAD_TIMEOUT_S", 30.0)
    assert on_thread(lambda: R.math_reward("\\boxed{0.5}", "1/2")) == 1.0  # a fresh helper


def test_registry():
    assert R.get_reward("math") is R.math_reward
    assert R.get_reward("arithmetic")("1+1=2#2", "2") == 1.0
    with pytest.raises(ValueError, match="valid"):
        R.get_reward("nope")
