"""Prompt templates render the papers' instructions and chat formats exactly."""

import pytest

from jaxrl_mismatch.data import templates as T


def test_boxed_instruction_and_chatml():
    out = T.render("qwen_boxed", "What is 1+1?")
    assert out == (
        "<|im_start|>user\nWhat is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}."
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_r1_distill_has_no_bos_and_opens_think():
    out = T.render("r1_distill", "Q")
    assert out == "<｜User｜>Q\n\nPlease reason step by step, and put your final answer within \\boxed{}.<｜Assistant｜><think>\n"


def test_dapo_keeps_the_dataset_prompt_and_instruction_variant():
    assert T.render("dapo", "Solve ... Answer: $Answer") == "<|im_start|>user\nSolve ... Answer: $Answer<|im_end|>\n<|im_start|>assistant\n"
    assert 'after "Answer:".' in T.render("dapo_instruction", "2+2?")
    assert T.render("arithmetic", "7+5=") == "7+5="


def test_braces_in_question_are_literal():
    assert "{x}" in T.render("qwen_boxed", "f({x})")


def test_unknown_and_bad_templates_raise():
    with pytest.raises(ValueError, match="valid"):
        T.get_template("nope")
    with pytest.raises(ValueError, match="placeholder"):
        T.PromptTemplate(name="bad", instruction="no slot")
    with pytest.raises(ValueError, match="chat_format"):
        T.PromptTemplate(name="bad", instruction="{question}", chat_format="llama9")
