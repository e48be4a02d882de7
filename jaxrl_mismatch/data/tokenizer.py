"""Tokenizers: the character-level tokenizer of the arithmetic task, and a thin loader for any HF
``tokenizer.json`` (Qwen3, R1-distill, ...).

Why our own tokenizer for the demo: a real BPE vocabulary (150k entries) would make the tiny model's
embedding and LM head dominate its size and its 2-core training time. A character-level vocabulary of
~24 symbols keeps the model at a few hundred thousand parameters. It is built with the ``tokenizers``
library and saved as a standard ``tokenizer.json`` + ``tokenizer_config.json`` +
``special_tokens_map.json``, so the HF checkpoint directory is self-contained: transformers
(``PreTrainedTokenizerFast`` / ``AutoTokenizer``), vLLM and :func:`load_tokenizer` all read it.

The post-processor prepends ``<bos>``, so encoding a prompt "with special tokens" gives the same ids
here, in transformers and in vLLM — the trainer and the rollout engine see identical prompt tokens.
Runtime code depends only on ``tokenizers`` (transformers is a test-only dependency).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from jaxrl_mismatch.data.jsonl import json_error

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Everything the arithmetic task writes, plus a little headroom (space, parentheses, a few letters)
# so that templates like "Q: ...\nA:" stay in-vocabulary. Order fixes the ids: never reorder.
ARITHMETIC_CHARS = "0123456789+-*=#() :QA\n"


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the special ids the trainer needs.

    ``bos_id`` may be None (Qwen tokenizers have no BOS); ``pad_id`` falls back to ``eos_id`` when the
    tokenizer defines no pad token, which is what HF generation does too. ``extra_stop_ids`` are the other
    ids that end a generation: ``generation_config.json``'s ``eos_token_id`` list (Qwen instruct models list
    ``<|im_end|>`` and ``<|endoftext|>``; vLLM and HF ``generate`` stop at every one of them).
    """

    tokenizer: Tokenizer
    pad_id: int
    bos_id: int | None
    eos_id: int
    extra_stop_ids: tuple[int, ...] = ()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation, ``eos_id`` first, each once."""
        return tuple(dict.fromkeys((self.eos_id, *self.extra_stop_ids)))

    @functools.cached_property
    def vocab_size(self) -> int:
        """One past the highest id the tokenizer can produce (added special tokens included): the rows a model's
        embedding needs. Not the number of tokens: a vocabulary may leave ids unused, and an id past a model's
        table would be clipped by its gather (`check_model_vocab`)."""
        return id_bound(self.tokenizer)

    @functools.cached_property
    def _is_id(self) -> np.ndarray:
        """[vocab_size] bool: which ids name a token (False for an unused id of a vocabulary with gaps)."""
        used = np.zeros((self.vocab_size,), bool)
        used[list(self.tokenizer.get_vocab(with_added_tokens=True).values())] = True
        return used

    def all_tokens(self, ids: Sequence[int]) -> bool:
        """Whether every id names a token of this tokenizer (in range, and not an unused id of a gapped vocabulary)."""
        a = np.asarray(ids, np.int64)
        return bool(a.size == 0 or (a.min() >= 0 and a.max() < self.vocab_size and self._is_id[a].all()))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``; with ``add_special_tokens`` the post-processor adds BOS (as vLLM/HF do)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, seqs: Sequence[Sequence[int]], *, skip_special_tokens: bool = True) -> list[str]:
        return self.tokenizer.decode_batch([list(s) for s in seqs], skip_special_tokens=skip_special_tokens)

    def check_model_vocab(self, model_vocab_size: int) -> None:
        """Raise if a model with ``model_vocab_size`` logits cannot represent every token id.

        A model may have *more* rows than the tokenizer (vocabularies are padded for efficient
        matmuls), never fewer: an id past the embedding table would be silently clipped by a gather.
        """
        if model_vocab_size < self.vocab_size:
            raise ValueError(
                f"tokenizer/model mismatch: the tokenizer has {self.vocab_size} ids but the model's "
                f"vocab_size is {model_vocab_size}; this tokenizer does not belong to this model"
            )

    def check_model_eos(self, model_dir: str) -> None:
        """Raise if the model at ``model_dir`` declares its end-of-sequence ids (config.json's and
        generation_config.json's ``eos_token_id``) and this tokenizer's EOS is none of them: another model's
        tokenizer, whose vocabulary fits (`check_model_vocab`) but whose ids mean other text. Rollouts would stop at
        an id the model never learned to end with. A model that declares none is not checked."""
        path = os.path.join(model_dir, "config.json")
        cfg = _read_json(path) if os.path.exists(path) else None
        e = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
        declared = [i for i in (e if isinstance(e, list) else [e]) if isinstance(i, int) and not isinstance(i, bool)]
        declared += _generation_eos_ids(model_dir, self.tokenizer)  # what `load_tokenizer` read as stop ids
        if declared and self.eos_id not in declared:
            raise ValueError(
                f"tokenizer/model mismatch: the tokenizer's EOS is id {self.eos_id} "
                f"({self.tokenizer.id_to_token(self.eos_id)!r}) but the model declares {sorted(set(declared))} "
                "(eos_token_id in config.json / generation_config.json); this tokenizer does not belong to this model"
            )

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        """The texts of the special tokens, read once (not per prompt of a dataset)."""
        return tuple(sorted({t.content for t in self.tokenizer.get_added_tokens_decoder().values()
                             if t.special and t.content}))

    def special_tokens_in(self, text: str) -> list[str]:
        """The special (control) tokens whose text occurs in ``text``. ``tokenizers`` matches them anywhere in
        the input, whatever ``add_special_tokens`` says, so ``<|im_end|>`` or ``<eos>`` written in a question
        is encoded as that control token."""
        return [t for t in self._special_texts if t in text]

    def check_known(self, text: str, *, specials: bool = True) -> None:
        """Raise when ``text`` contains characters this tokenizer maps to its unknown token (``<unk>`` here, the
        model's own, ``[UNK]`` say, in a loaded one): a prompt with an unknown character would otherwise train the
        model on the unknown token silently. A tokenizer without one (byte-level BPE, byte fallback) has no unknown
        characters. With ``specials``, a special token's text (``<eos>``) counts as unknown characters too: it is
        not made of the vocabulary's characters, and encoded it would be the control token (False for a prompt a
        chat template rendered: its own turn tokens are meant).
        """
        unk = unknown_id(self.tokenizer)
        if unk is None:
            return
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        unknown = {text[s:e] for i, (s, e) in zip(enc.ids, enc.offsets) if i == unk}
        bad = sorted(unknown | (set(self.special_tokens_in(text)) if specials else set()))
        if bad:
            raise UnknownCharactersError(f"text {text[:60]!r} has characters outside the tokenizer's vocabulary: {bad}")


class UnknownCharactersError(ValueError):
    """Text with characters a closed vocabulary maps to ``<unk>`` (`TextTokenizer.check_known`): bad input, which the
    loaders report naming the prompt's file and line."""


def build_arithmetic_tokenizer(chars: str = ARITHMETIC_CHARS) -> TextTokenizer:
    """Character-level tokenizer: ids 0..3 are ``<pad> <bos> <eos> <unk>``, then one id per character."""
    if len(set(chars)) != len(chars):
        raise ValueError(f"duplicate characters in tokenizer alphabet {chars!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character (spaces and newlines included) is its own pre-token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without separators
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return TextTokenizer(tokenizer=tok, pad_id=vocab[PAD], bos_id=vocab[BOS], eos_id=vocab[EOS])


def save_tokenizer(tok: TextTokenizer, out_dir: str, *, model_max_length: int = 512) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` to ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    tok.tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    t = tok.tokenizer
    special = {
        "pad_token": t.id_to_token(tok.pad_id),
        "eos_token": t.id_to_token(tok.eos_id),
    }
    if tok.bos_id is not None:
        special["bos_token"] = t.id_to_token(tok.bos_id)
    if t.token_to_id(UNK) is not None:
        special["unk_token"] = UNK
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",  # generation pads prompts on the left; training batches are built by us
        **special,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)


def _token_str(value: object) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(path: str) -> TextTokenizer:
    """Load a tokenizer directory (or a ``tokenizer.json`` path) with its special ids.

    Special tokens come from ``tokenizer_config.json`` (then ``special_tokens_map.json``); when EOS
    is missing there, the first of ``generation_config.json``'s ``eos_token_id`` is used (Qwen base models),
    and the others in that list become ``extra_stop_ids``.
    """
    d, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else (os.path.dirname(path), path)
    if not os.path.exists(file):
        raise FileNotFoundError(f"no tokenizer.json at {file}")
    try:
        tok = Tokenizer.from_file(file)
    except Exception as e:  # the tokenizers library raises its own exception types for a damaged file
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{file} is not a readable tokenizer ({why})") from None
    # A tokenizer.json may carry truncation or padding settings (saved from a pipeline that used them): the
    # prompts would be cut (past the task.max_prompt_len check, which sees the cut length) or padded with
    # tokens the model then continues after. Every caller here needs the exact ids of the text.
    tok.no_truncation()
    tok.no_padding()
    names: dict[str, str | None] = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):  # later wins
        p = os.path.join(d, fname)
        if os.path.exists(p):
            cfg = _read_json(p)
            if not isinstance(cfg, dict):  # a list or a string: `key in cfg` and cfg[key] were a TypeError
                raise ValueError(f"{p}: expected a JSON object, got {type(cfg).__name__}")
            for key in ("pad_token", "bos_token", "eos_token"):
                if key in cfg:
                    names[key] = _token_str(cfg[key])

    def _id(key: str) -> int | None:
        name = names.get(key)
        if name is None:
            return None
        i = tok.token_to_id(name)
        if i is None:
            raise ValueError(f"{d}: {key} {name!r} from the tokenizer config is not in tokenizer.json's vocabulary")
        return i

    gen_eos = _generation_eos_ids(d, tok)
    eos_id = _id("eos_token")
    if eos_id is None:
        eos_id = gen_eos[0] if gen_eos else None
    if eos_id is None:
        raise ValueError(f"{d}: no eos_token in tokenizer_config.json/special_tokens_map.json or generation_config.json")
    pad_id = _id("pad_token")
    return TextTokenizer(tokenizer=tok, pad_id=eos_id if pad_id is None else pad_id, bos_id=_id("bos_token"), eos_id=eos_id,
                         extra_stop_ids=tuple(i for i in gen_eos if i != eos_id))


def id_bound(tok: Tokenizer) -> int:
    """One past the highest id of `tok`'s vocabulary and added tokens (0 for an empty one)."""
    return max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def unknown_id(tok: Tokenizer) -> int | None:
    """The id `tok` encodes unknown text as: its model's unknown token (WordLevel, WordPiece and BPE name one), else
    ``<unk>`` if the vocabulary has it; None for none."""
    name = getattr(tok.model, "unk_token", None)
    i = tok.token_to_id(name) if isinstance(name, str) and name else None
    return i if i is not None else tok.token_to_id(UNK)


def _read_json(path: str):
    """The JSON value in `path`; ValueError naming the file (and line) when it is not UTF-8 JSON (the locale's
    encoding was used, and a byte it could not decode was a UnicodeDecodeError: exit 1)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # see jsonl.json_error
        at = f", line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise ValueError(f"{path} is not valid JSON ({json_error(e)}{at})") from None


def _generation_eos_ids(d: str, tok: Tokenizer) -> tuple[int, ...]:
    """``generation_config.json``'s ``eos_token_id`` (an id or a list of ids) as a tuple; () without the file or
    the key. A value that is not a token id of this tokenizer is refused, naming the file."""
    path = os.path.join(d, "generation_config.json")
    if not os.path.exists(path):
        return ()
    e = _read_json(path)
    e = e.get("eos_token_id") if isinstance(e, dict) else None
    ids = e if isinstance(e, list) else [] if e is None else [e]
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2**31
           or tok.id_to_token(i) is None]  # an unused id of a vocabulary with gaps names no token either
    if bad:
        raise ValueError(f"{path}: eos_token_id {e!r} is not a token id of this tokenizer (0..{id_bound(tok) - 1}, "
                         "ids naming a token)")
    return tuple(dict.fromkeys(ids))
