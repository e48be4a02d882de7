"""Prompt templates used by the papers, rendered to raw text (no tokenizer chat template needed).

Why raw text: the rollout engine (built-in or vLLM) and the trainer must tokenise *exactly* the same
prompt string. Rendering the chat markup ourselves keeps that string in one place and out of each
engine's chat-template code path, and lets a base model (no chat template at all) use the same
templates.

A template is two parts: an *instruction* wrapped around the question (``{question}`` placeholder)
and a *chat format* wrapped around that user message, ending where the assistant's answer starts.

Sources:
- ``qwen_boxed``: the Qwen2.5-Math / DAPO-style instruction "Please reason step by step, and put your
  final answer within \\boxed{}." in the Qwen ChatML format — used with Qwen3-4B-Base on DAPO data in
  the LR-schedule paper's setup (verl recipes).
- ``r1_distill``: the DeepSeek-R1-Distill recommended usage (question, blank line, the same boxed
  instruction; DeepSeek's ``<｜User｜>``/``<｜Assistant｜><think>`` format) — the FP16 paper's sanity test
  runs DeepSeek-R1-Distill-Qwen-1.5B on MATH (§4.1); its code base (Oat) uses this instruction.
- ``dapo``: DAPO-Math-17k prompts already carry their instruction ("... The last line of your response
  should be of the form Answer: $Answer ..."), so only the ChatML wrapper is added;
  ``dapo_instruction`` adds that same instruction to questions from other sets.
- ``arithmetic``: the synthetic task — the bare expression, no wrapper (the tokenizer adds ``<bos>``).
"""

from __future__ import annotations

import dataclasses

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# The instruction inside every DAPO-Math-17k prompt (its ``prompt[0]["content"]``), for applying the
# same wording to questions from other sets (e.g. AIME validation in GSM8K/MATH format).
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{question}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

CHAT_FORMATS: dict[str, str] = {
    "none": "{user}",
    "chatml": "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n",
    # No BOS here: the R1 tokenizer's post-processor adds it when encoding with special tokens, and
    # a second one would put the prompt off-distribution.
    "deepseek_r1": "<｜User｜>{user}<｜Assistant｜><think>\n",
}
# The token that closes the assistant's turn in each chat format. A model prompted in that format ends its answer
# with it, so it stops generation: a base model's tokenizer (Qwen3-4B-Base) names only `<|endoftext|>` as EOS, and
# without this the response would run on past `<|im_end|>` into a made-up next turn.
END_OF_TURN: dict[str, str] = {"chatml": "<|im_end|>", "deepseek_r1": "<｜end▁of▁sentence｜>"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptTemplate:
    """``render(question)`` = ``chat_format`` applied to ``instruction.format(question=...)``.

    ``instruction`` uses ``{question}`` as its only placeholder; literal braces (``\\boxed{}``) are
    kept as-is because substitution is a plain string replace, not ``str.format``.
    """

    name: str
    instruction: str
    chat_format: str = "none"

    def __post_init__(self) -> None:
        if "{question}" not in self.instruction:
            raise ValueError(f"template {self.name!r}: instruction has no {{question}} placeholder")
        if self.chat_format not in CHAT_FORMATS:
            raise ValueError(f"template {self.name!r}: unknown chat_format {self.chat_format!r}; valid: {sorted(CHAT_FORMATS)}")

    def user_message(self, question: str) -> str:
        """The user turn (what a tokenizer chat template would receive as ``content``)."""
        return self.instruction.replace("{question}", question)

    @property
    def end_of_turn(self) -> str | None:
        """The text of the token that ends the assistant's turn in this chat format (None for plain text)."""
        return END_OF_TURN.get(self.chat_format)

    def render(self, question: str) -> str:
        """The full prompt text given to the engine; the model's response follows it directly."""
        return CHAT_FORMATS[self.chat_format].replace("{user}", self.user_message(question))


TEMPLATES: dict[str, PromptTemplate] = {
    t.name: t
    for t in (
        PromptTemplate(name="arithmetic", instruction="{question}"),
        PromptTemplate(name="raw", instruction="{question}"),
        PromptTemplate(name="qwen_boxed", instruction="{question}\n" + BOXED_INSTRUCTION, chat_format="chatml"),
        PromptTemplate(name="qwen_boxed_base", instruction="Question: {question}\n" + BOXED_INSTRUCTION + "\nAnswer:"),
        PromptTemplate(name="r1_distill", instruction="{question}\n\n" + BOXED_INSTRUCTION, chat_format="deepseek_r1"),
        PromptTemplate(name="dapo", instruction="{question}", chat_format="chatml"),
        PromptTemplate(name="dapo_instruction", instruction=DAPO_INSTRUCTION, chat_format="chatml"),
    )
}


def get_template(name: str) -> PromptTemplate:
    """A registered template by name; raises naming the valid ones."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown prompt template {name!r}; valid: {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def render(name: str, question: str) -> str:
    """Shorthand for ``get_template(name).render(question)``."""
    return get_template(name).render(question)
