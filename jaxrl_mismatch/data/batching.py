"""Host-side batching for the RL loop: a resumable prompt iterator, prompt tokenisation, and the
assembly of fixed-shape training batches from prompt + completion ids.

Why fixed shapes: every distinct ``[B, T]`` is a new XLA compilation of the update step. Padding the
sequence axis up to a small set of bucket lengths bounds the number of compilations (one per bucket)
at the cost of some padding, which never changes a loss or a metric because every consumer masks.

Alignment (the contract with ``models.scoring.token_logprobs`` and the objectives)::

    tokens          [B, T+1]   prompt ids, then completion ids, then pad_id (right padding)
    attention_mask  [B, T+1]   1 on prompt and completion tokens, 0 on padding
    input_ids  = tokens[:, :-1]          [B, T]
    targets    = tokens[:, 1:]           [B, T]
    response_mask   [B, T]     1.0 at t iff targets[b, t] is a completion token,
                               i.e. t in [P_b - 1, P_b - 1 + C_b)
    rollout_logp    [B, T]     μ's log-prob of targets[b, t] where response_mask is 1, else 0

so ``logp[b, t] = log π(targets[b, t] | tokens[b, :t+1])`` from the model lines up element-wise with
``rollout_logp`` and ``response_mask``. ``T`` is the bucketed target length: the smallest bucket
``>= max_b(P_b + C_b) - 1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Generic, TypeVar

import numpy as np
from jaxtyping import Float, Int

from jaxrl_mismatch.data.templates import get_template
from jaxrl_mismatch.data.tokenizer import TextTokenizer, UnknownCharactersError

T = TypeVar("T")

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class PromptIterator(Generic[T]):
    """Endless, epoch-wise shuffled batches of prompt records with an exactly resumable position.

    The order of epoch ``e`` is ``np.random.default_rng([seed, e]).permutation(n)`` — a pure function
    of ``(seed, epoch)`` — so the position ``{"epoch", "index", "seed", "num_records"}`` (``state``) is
    all a checkpoint needs: restoring it replays exactly the batches an uninterrupted run would have
    produced. A batch that crosses an epoch boundary is completed from the next epoch's order.
    """

    def __init__(self, records: Sequence[T], batch_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if not records:
            raise ValueError("PromptIterator: no records")
        if batch_size < 1:
            raise ValueError(f"PromptIterator: batch_size must be >= 1, got {batch_size}")
        self._records = records
        self.batch_size = batch_size
        self.shuffle = shuffle
        self._seed = int(seed)
        self._epoch = 0
        self._index = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self._records)
        return np.random.default_rng([self._seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    @property
    def state(self) -> dict[str, int]:
        """Serialisable position: the next batch starts at ``order(epoch)[index]``."""
        return {"epoch": self._epoch, "index": self._index, "seed": self._seed, "num_records": len(self._records)}

    def restore(self, state: Mapping[str, int]) -> None:
        """Continue from a saved ``state``; raises if it belongs to a dataset of another size."""
        missing = {"epoch", "index", "seed", "num_records"} - set(state)
        if missing:
            raise ValueError(f"PromptIterator.restore: state lacks {sorted(missing)}")
        if int(state["num_records"]) != len(self._records):
            raise ValueError(
                f"PromptIterator.restore: checkpointed position is for {state['num_records']} records, "
                f"this dataset has {len(self._records)}; resuming would replay a different order"
            )
        if not 0 <= int(state["index"]) < len(self._records) or int(state["epoch"]) < 0:
            raise ValueError(f"PromptIterator.restore: position out of range: {dict(state)}")
        self._seed, self._epoch, self._index = int(state["seed"]), int(state["epoch"]), int(state["index"])
        self._order = self._epoch_order(self._epoch)

    def next_batch(self) -> list[T]:
        out = []
        while len(out) < self.batch_size:
            take = min(self.batch_size - len(out), len(self._records) - self._index)
            out.extend(self._records[int(i)] for i in self._order[self._index : self._index + take])
            self._index += take
            if self._index == len(self._records):
                self._epoch, self._index = self._epoch + 1, 0
                self._order = self._epoch_order(self._epoch)
        return out

    def __iter__(self) -> Iterator[list[T]]:
        return self

    def __next__(self) -> list[T]:
        return self.next_batch()


def tokenize_prompts(
    tokenizer: TextTokenizer,
    texts: Sequence[str],
    *,
    template: str | None = None,
    max_prompt_len: int | None = None,
    where: Sequence[str] | None = None,
) -> list[list[int]]:
    """Render (optionally through a registered template) and encode prompts to id lists.

    Special tokens are added the way the tokenizer's post-processor says (BOS for ours and R1, none
    for Qwen) — the same ids a vLLM engine gets from the same text. A prompt with characters outside a
    closed vocabulary, with no tokens at all (an engine has nothing to continue) or longer than
    ``max_prompt_len`` raises a `PromptError` naming it, as does a question (with a template) holding a
    special token's text (a chat turn ended or begun from inside the data): ``where[i]`` (its file and line)
    when given, else its position ("prompt 3").
    """
    tmpl = get_template(template) if template is not None else None
    rendered = [tmpl.render(t) if tmpl is not None else t for t in texts]
    name = (lambda i: f"{where[i]}: prompt") if where is not None else (lambda i: f"prompt {i}")
    for i, t in enumerate(rendered):
        try:  # a template's own turn tokens are meant; special tokens in its question are refused just below
            tokenizer.check_known(t, specials=tmpl is None)
        except UnknownCharactersError as e:
            if tmpl is not None:  # the question alone may be fine: then it is the template's text the tokenizer lacks
                try:
                    tokenizer.check_known(texts[i], specials=False)
                except UnknownCharactersError:
                    pass
                else:
                    raise PromptError(f"{name(i)}: the template {template!r} writes text outside the tokenizer's "
                                      f"vocabulary ({str(e).rsplit(': ', 1)[-1]}); choose a template this tokenizer "
                                      "can spell") from None
            raise PromptError(f"{name(i)}: {e}") from None
        if tmpl is not None and (specials := tokenizer.special_tokens_in(texts[i])):
            raise PromptError(f"{name(i)}: the question holds the text of the tokenizer's special token(s) {specials}, "
                              "which would be encoded as those control tokens inside the templated prompt; remove "
                              "them from the data")
    try:
        ids = tokenizer.encode_batch(rendered)
    except Exception:  # `tokenizers` raises a bare Exception for text it cannot encode (a closed vocabulary, no unk)
        for i, t in enumerate(rendered):
            try:
                tokenizer.encode(t)
            except Exception as e:
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise PromptError(f"{name(i)} {t[:60]!r} cannot be encoded by the tokenizer ({why})") from None
        raise
    for i, p in enumerate(ids):
        if not p:
            raise PromptError(f"{name(i)} {rendered[i][:60]!r} has no tokens (the tokenizer adds no BOS); a rollout "
                              "engine cannot continue an empty prompt")
        if max_prompt_len is not None and len(p) > max_prompt_len:
            raise PromptTooLongError(f"{name(i)} has {len(p)} tokens > max_prompt_len={max_prompt_len}: "
                                     f"{rendered[i][:60]!r}")
    return ids


class PromptError(ValueError):
    """A prompt the policy cannot be given (`tokenize_prompts`); the message names it (file and line when known)."""


class PromptTooLongError(PromptError):
    """A prompt has more tokens than `max_prompt_len` (`tokenize_prompts`)."""


def generation_stop_ids(tokenizer: TextTokenizer, template: str | None) -> tuple[int, ...]:
    """The ids that end a response to prompts rendered through ``template``: the tokenizer's stop ids (EOS and
    ``generation_config.json``'s) and the chat format's end-of-turn token when the tokenizer has it as one id."""
    end = get_template(template).end_of_turn if template is not None else None
    turn = tokenizer.tokenizer.token_to_id(end) if end is not None else None
    return tuple(dict.fromkeys((*tokenizer.stop_ids, *(() if turn is None else (turn,)))))


def response_text(tokenizer: TextTokenizer, token_ids: Sequence[int], stop_ids: Sequence[int]) -> str | None:
    """The text a reward reads from a response: the stop token ending it is not text; any other special token stays
    visible (dropping it made `#2<bos>0` read as the answer `#20`). None when an id is outside the tokenizer's
    vocabulary (a padded row of the model's): the response is malformed."""
    ids = list(token_ids)
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    if not tokenizer.all_tokens(ids):
        return None
    return tokenizer.decode(ids, skip_special_tokens=False)


def bucket_length(n: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """Smallest bucket ``>= n``; raises when ``n`` exceeds the largest."""
    for b in sorted(buckets):
        if b >= n:
            return int(b)
    raise ValueError(f"sequence length {n} exceeds the largest bucket {max(buckets)}")


@dataclasses.dataclass(frozen=True)
class PaddedRows:
    """Prompt + completion rows right-padded to one bucketed length (SFT batches, and the layout of
    `train.batch.RolloutBatch`); see the module docstring for the alignment."""

    tokens: Int[np.ndarray, "batch seq_plus_1"]
    attention_mask: Int[np.ndarray, "batch seq_plus_1"]
    response_mask: Float[np.ndarray, "batch seq"]
    rollout_logp: Float[np.ndarray, "batch seq"]
    prompt_lens: Int[np.ndarray, " batch"]
    completion_lens: Int[np.ndarray, " batch"]
    row_mask: Float[np.ndarray, " batch"]  # 0.0 on rows added only to reach a fixed batch size

    @property
    def input_ids(self) -> Int[np.ndarray, "batch seq"]:
        return self.tokens[:, :-1]

    @property
    def targets(self) -> Int[np.ndarray, "batch seq"]:
        return self.tokens[:, 1:]

    @property
    def input_mask(self) -> Int[np.ndarray, "batch seq"]:
        """Attention mask of ``input_ids`` (what ``token_logprobs`` takes)."""
        return self.attention_mask[:, :-1]

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def pad_rows(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    rollout_logp: Sequence[Sequence[float]] | None = None,
    *,
    pad_id: int,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    batch_size: int | None = None,
) -> PaddedRows:
    """Right-pad prompt+completion rows into a :class:`PaddedRows` of bucketed length.

    Args:
      prompt_ids: per row, the prompt ids exactly as the engine saw them (BOS included), non-empty.
      completion_ids: per row, the sampled ids (EOS included when the engine produced it; a
        truncated completion simply has none). May be empty (then the row trains on nothing).
      rollout_logp: per row, μ's log-prob of each completion token (same length as the row's
        completion); None for SFT batches (zeros).
      pad_id: id written into padding (never seen by a loss: every mask is 0 there).
      buckets: allowed target lengths ``T``.
      batch_size: pad the batch with empty rows (``row_mask = 0``) up to this size, so that the batch
        axis is fixed too (and divisible by the data-parallel mesh size).

    Returns:
      A :class:`PaddedRows`; all arrays numpy, ``int32`` ids/masks, ``float32`` logp/masks.
    """
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("pad_rows: empty batch")
    if len(completion_ids) != n:
        raise ValueError(f"pad_rows: {n} prompts but {len(completion_ids)} completions")
    if rollout_logp is not None and len(rollout_logp) != n:
        raise ValueError(f"pad_rows: {n} prompts but {len(rollout_logp)} rollout_logp rows")
    B = n if batch_size is None else batch_size
    if B < n:
        raise ValueError(f"pad_rows: {n} rows do not fit batch_size={batch_size}")
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        if len(p) == 0:
            raise ValueError(f"pad_rows: row {i} has an empty prompt (nothing to condition the first token on)")
        if rollout_logp is not None and len(rollout_logp[i]) != len(c):
            raise ValueError(
                f"pad_rows: row {i} has {len(c)} completion tokens but {len(rollout_logp[i])} rollout logprobs"
            )
    T = bucket_length(max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)) - 1, buckets)

    tokens = np.full((B, T + 1), pad_id, dtype=np.int32)
    attention_mask = np.zeros((B, T + 1), dtype=np.int32)
    response_mask = np.zeros((B, T), dtype=np.float32)
    logp = np.zeros((B, T), dtype=np.float32)
    prompt_lens = np.zeros((B,), dtype=np.int32)
    completion_lens = np.zeros((B,), dtype=np.int32)
    row_mask = np.zeros((B,), dtype=np.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        P, C = len(p), len(c)
        tokens[i, :P] = p
        tokens[i, P : P + C] = c
        attention_mask[i, : P + C] = 1
        # target t predicts tokens[t+1]; completion token j sits at P+j, so its target index is P-1+j
        response_mask[i, P - 1 : P - 1 + C] = 1.0
        if rollout_logp is not None and C:
            row = np.asarray(rollout_logp[i], dtype=np.float32)
            if not np.all(np.isfinite(row)):
                raise ValueError(f"pad_rows: row {i} has non-finite rollout logprobs (engine output is corrupt)")
            logp[i, P - 1 : P - 1 + C] = row
        prompt_lens[i], completion_lens[i], row_mask[i] = P, C, 1.0
    return PaddedRows(tokens, attention_mask, response_mask, logp, prompt_lens, completion_lens, row_mask)
