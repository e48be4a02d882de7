"""The arithmetic tokenizer: round trips, special ids, HF-loadable files, vocabulary checks."""

import json

import pytest
from tokenizers import Tokenizer

from jaxrl_mismatch.data import arithmetic as A
from jaxrl_mismatch.data import tokenizer as T


@pytest.fixture(scope="module")
def tok():
    return T.build_arithmetic_tokenizer()


def test_special_ids_and_round_trip(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    for p in A.generate(A.ArithmeticSpec(), "train", 50):
        text = p.prompt + p.response
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and len(ids) == len(text) + 1  # one id per character
        assert tok.decode(ids) == text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_unknown_characters_are_reported(tok):
    tok.check_known("1+2=")
    with pytest.raises(ValueError, match=r"\['x', 'y'\]"):
        tok.check_known("1+x=y")


def test_model_vocab_check(tok):
    tok.check_model_vocab(tok.vocab_size)
    tok.check_model_vocab(64)  # padded embedding tables are fine
    n = tok.vocab_size
    assert n == tok.tokenizer.get_vocab_size(with_added_tokens=True)  # special tokens have embedding rows too
    with pytest.raises(ValueError, match=rf"tokenizer/model mismatch: the tokenizer has {n} ids .* vocab_size is {n - 1}"):
        tok.check_model_vocab(n - 1)


def test_saved_files_load_in_tokenizers_transformers_and_ours(tok, tmp_path):
    T.save_tokenizer(tok, str(tmp_path))
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert raw.encode("7+5*3=").ids == tok.encode("7+5*3=")

    back = T.load_tokenizer(str(tmp_path))
    assert (back.pad_id, back.bos_id, back.eos_id, back.vocab_size) == (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size)

    transformers = pytest.importorskip("transformers")
    for hf in (
        transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), **{
            k: v for k, v in json.loads((tmp_path / "special_tokens_map.json").read_text()).items()
        }),
        transformers.AutoTokenizer.from_pretrained(str(tmp_path)),
    ):
        assert hf("7+5*3=")["input_ids"] == tok.encode("7+5*3=")
        assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
        assert hf.decode(tok.encode("12-3=9#9") + [tok.eos_id], skip_special_tokens=True) == "12-3=9#9"


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        T.load_tokenizer(str(tmp_path))
    tok = T.build_arithmetic_tokenizer()
    T.save_tokenizer(tok, str(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<end>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="eos_token '<end>'"):
        T.load_tokenizer(str(tmp_path))


def test_a_saved_truncation_or_padding_setting_never_changes_the_ids(tok, tmp_path):
    """A tokenizer.json saved with truncation (or padding) on cut prompts past the task.max_prompt_len check
    (it saw the cut length) or padded them with tokens the model continued after: the loader turns both off."""
    T.save_tokenizer(tok, str(tmp_path))
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw.enable_truncation(max_length=4)
    raw.enable_padding(pad_id=tok.pad_id, length=12)
    raw.save(str(tmp_path / "tokenizer.json"))
    saved = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("12+34*5=").ids
    assert saved[:4] == tok.encode("12+34*5=")[:4] and saved[4:] == [tok.pad_id] * 8  # cut to 4, padded to 12
    back = T.load_tokenizer(str(tmp_path))
    texts = ["12+34*5=", "1+2="]
    assert back.encode_batch(texts) == [tok.encode(t) for t in texts] and back.encode("1+2=") == tok.encode("1+2=")


def _word_level(tmp_path, vocab: dict[str, int], unk: str | None, eos: str):
    """A closed character-level tokenizer folder with the given vocabulary and unknown token (None: none)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers

    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk) if unk else models.WordLevel(vocab=vocab))
    t.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    t.decoder = decoders.Fuse()
    t.add_special_tokens([k for k in vocab if k.startswith(("<", "["))])
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "pad_token": "<pad>"}))
    return T.load_tokenizer(str(tmp_path))


def test_a_loaded_closed_vocabulary_refuses_characters_its_own_unknown_token_stands_for(tmp_path):
    # The model's unknown token is "[UNK]", not "<unk>": `1+x=` encoded x as [UNK] and trained on it silently.
    vocab = {"<pad>": 0, "<eos>": 1, "[UNK]": 2, **{c: 3 + i for i, c in enumerate("0123456789+=")}}
    tok = _word_level(tmp_path, vocab, "[UNK]", "<eos>")
    tok.check_known("1+2=")
    with pytest.raises(T.UnknownCharactersError, match=r"\['x'\]"):
        tok.check_known("1+x=")


def test_a_closed_vocabulary_without_an_unknown_token_names_the_prompt_it_cannot_encode(tmp_path):
    from jaxrl_mismatch.data.batching import PromptError, tokenize_prompts

    vocab = {"<pad>": 0, "<eos>": 1, **{c: 2 + i for i, c in enumerate("0123456789+=")}}
    tok = _word_level(tmp_path, vocab, None, "<eos>")
    assert tokenize_prompts(tok, ["1+2="]) == [[3, 12, 4, 13]]
    with pytest.raises(PromptError, match=r"^t.jsonl:2: prompt '1\+x=' cannot be encoded by the tokenizer \(.*UNK"):
        tokenize_prompts(tok, ["1+2=", "1+x="], where=["t.jsonl:1", "t.jsonl:2"])


def test_vocab_size_is_one_past_the_highest_id_of_a_vocabulary_with_unused_ids(tmp_path):
    # ids 0-16 and an end token at 40: a model needs 41 rows, and 40 is a token; 20 (unused) is not.
    from jaxrl_mismatch.data.batching import response_text

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{c: 4 + i for i, c in enumerate("0123456789+-*")},
             "<end>": 40}
    tok = _word_level(tmp_path, vocab, "<unk>", "<end>")
    assert tok.eos_id == 40 and tok.vocab_size == 41
    tok.check_model_vocab(41)
    with pytest.raises(ValueError, match="tokenizer has 41 ids"):
        tok.check_model_vocab(20)
    assert response_text(tok, [vocab["1"], 40], (40,)) == "1"
    assert response_text(tok, [vocab["1"], 20], (40,)) is None  # an unused id: malformed
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 40}))
    assert T.load_tokenizer(str(tmp_path)).stop_ids == (40,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [40, 20]}))  # 20: unused
    with pytest.raises(ValueError, match=r"eos_token_id \[40, 20\] is not a token id of this tokenizer"):
        T.load_tokenizer(str(tmp_path))


def test_a_chat_templates_own_turn_tokens_are_not_unknown_characters(tmp_path):
    """Once a loaded tokenizer's own unknown token counts, a rendered ChatML prompt's <|im_start|> was refused as
    characters outside the vocabulary: the template's turn tokens are meant (the question's are still refused)."""
    from jaxrl_mismatch.data.batching import PromptError, tokenize_prompts

    vocab = {"<pad>": 0, "<eos>": 1, "[UNK]": 2, "<|im_start|>": 3, "<|im_end|>": 4,
             **{c: 5 + i for i, c in enumerate(dict.fromkeys(
                 "0123456789+= \nPlease reason step by step, and put your final answer within \\boxed{}."
                 "user assistant"))}}
    tok = _word_level(tmp_path, vocab, "[UNK]", "<eos>")
    template = "qwen_boxed"
    assert tokenize_prompts(tok, ["1+2="], template=template)[0][0] == 3
    with pytest.raises(PromptError, match=r"special token"):
        tokenize_prompts(tok, ["1+2=<|im_end|>"], template=template)
    with pytest.raises(PromptError, match=r"outside the tokenizer's vocabulary: \['#'\]"):
        tokenize_prompts(tok, ["1+2=#"], template=template)
