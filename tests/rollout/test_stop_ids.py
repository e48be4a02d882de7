"""What ends a response: the tokenizer's EOS, every id of `generation_config.json`'s `eos_token_id` list, and the
chat format's end-of-turn token. A Qwen base model's tokenizer names only `<|endoftext|>` as EOS; prompted in
ChatML it closes its answer with `<|im_end|>`, and the rollout used to run on past it to `max_tokens`."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxrl_mismatch.data.batching import generation_stop_ids, response_text
from jaxrl_mismatch.data.tokenizer import load_tokenizer
from jaxrl_mismatch.rollout.jax_engine import JaxEngine
from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.loop import Trainer
from jaxrl_mismatch.train.task_data import TaskData

from tests.rollout.conftest import VOCAB, make_tiny_qwen3

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
IDS = {ENDOFTEXT: 90, IM_START: 91, IM_END: 92}


def _qwen_like_tokenizer(d, *, gen_eos=None, eos_in_config=True, turn_tokens=True):
    """A word-level tokenizer laid out like Qwen's: no BOS, `<|endoftext|>` the EOS of tokenizer_config.json."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    # the words of the qwen_boxed template's text: a closed word vocabulary maps nothing it lacks to its unknown token
    for i, word in enumerate(("user", "assistant", "Please", "reason", "step", "by", "step,", "and", "put", "your",
                              "final", "answer", "within", "\\boxed{}."), start=60):
        vocab.pop(f"w{i}")
        vocab[word] = i
    for name, i in IDS.items():
        if turn_tokens or name == ENDOFTEXT:
            vocab.pop(f"w{i}")
            vocab[name] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([n for n in IDS if n in vocab])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": ENDOFTEXT} if eos_in_config else {}))
    if gen_eos is not None:
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    return d


def test_generation_config_eos_list_adds_stop_ids(tmp_path):
    tok = load_tokenizer(str(_qwen_like_tokenizer(tmp_path / "a", gen_eos=[IDS[IM_END], IDS[ENDOFTEXT]])))
    assert tok.eos_id == IDS[ENDOFTEXT] and tok.stop_ids == (IDS[ENDOFTEXT], IDS[IM_END])
    # Without EOS in tokenizer_config.json the list's first id is the EOS (Qwen base models), the rest stop too.
    tok = load_tokenizer(str(_qwen_like_tokenizer(tmp_path / "b", gen_eos=[IDS[IM_END], IDS[ENDOFTEXT]],
                                                  eos_in_config=False)))
    assert tok.eos_id == IDS[IM_END] and tok.stop_ids == (IDS[IM_END], IDS[ENDOFTEXT])
    tok = load_tokenizer(str(_qwen_like_tokenizer(tmp_path / "c", gen_eos=IDS[ENDOFTEXT])))
    assert tok.stop_ids == (IDS[ENDOFTEXT],)


@pytest.mark.parametrize("bad", [VOCAB + 5, -1, "2", [IDS[IM_END], None]])
def test_a_generation_config_eos_that_is_not_a_token_id_is_refused(tmp_path, bad):
    d = _qwen_like_tokenizer(tmp_path, gen_eos=bad)
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id .* is not a token id"):
        load_tokenizer(str(d))


def test_the_chat_format_end_of_turn_stops_when_the_tokenizer_has_it(tmp_path):
    tok = load_tokenizer(str(_qwen_like_tokenizer(tmp_path / "q")))
    assert tok.stop_ids == (IDS[ENDOFTEXT],)
    assert generation_stop_ids(tok, "qwen_boxed") == (IDS[ENDOFTEXT], IDS[IM_END])
    assert generation_stop_ids(tok, "raw") == generation_stop_ids(tok, None) == (IDS[ENDOFTEXT],)
    plain = load_tokenizer(str(_qwen_like_tokenizer(tmp_path / "p", turn_tokens=False)))
    assert generation_stop_ids(plain, "qwen_boxed") == (IDS[ENDOFTEXT],)  # no such token: nothing added
    # the reward's text: a final stop token of either kind is not text; one inside the response stays visible
    w = [5, 6]
    assert response_text(tok, w + [IDS[IM_END]], (IDS[ENDOFTEXT], IDS[IM_END])) == "w5 w6"
    assert response_text(tok, w + [IDS[IM_END]], (IDS[ENDOFTEXT],)) == "w5 w6 " + IM_END


@pytest.fixture(scope="module")
def chatml_run(tmp_path_factory):
    """A tiny random model with the Qwen-like tokenizer, and the config of a `prompts` run in ChatML."""
    root = tmp_path_factory.mktemp("stop_ids")
    model = _qwen_like_tokenizer(make_tiny_qwen3(root / "model", tied=False), gen_eos=IDS[ENDOFTEXT])
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt_text": f"w{i} w{i + 1}", "answer": "w7"}) + "\n" for i in range(1, 9)))
    c = base_config()
    c.model.path, c.run_dir = str(model), str(root / "run")
    c.task.name, c.task.template, c.task.data_dir = "prompts", "qwen_boxed", str(root / "tfds")
    c.task.files = {"train": str(data), "validation": str(data)}
    c.task.num_train, c.task.num_val = 8, 4
    c.batch.prompts_per_step = 4
    c.rollout.group_size, c.rollout.max_tokens, c.rollout.temperature = 4, 48, 30.0  # near uniform: many stops
    return c


def test_the_loop_stops_rollouts_at_the_end_of_turn_and_the_reward_drops_it(chatml_run):
    """The training loop's SamplingSpec carries every stop id, and the engine's sampled responses end at the first
    `<|im_end|>`: the same seed without it (EOS only) gives the same tokens up to there, then runs on."""
    c = chatml_run
    d = TaskData(c, model_vocab_size=VOCAB)
    assert d.stop_ids == (IDS[ENDOFTEXT], IDS[IM_END])
    spec = Trainer._spec(types.SimpleNamespace(c=c, data=d, collect_routing=False), seed=11, step=0)
    assert spec.stop_token_ids == d.stop_ids
    prompts, _ = d.next_prompts()
    engine = JaxEngine(c.model.path)
    stopped = [x for g in engine.generate(prompts, spec) for x in g]
    control = [x for g in engine.generate(prompts, spec.__class__(**{**spec.__dict__, "stop_token_ids": (d.eos_id,)}))
               for x in g]
    ended_at_turn = 0
    for s, r in zip(stopped, control):
        hits = [t for t, i in enumerate(r.token_ids) if i in d.stop_ids]
        cut = hits[0] + 1 if hits else len(r.token_ids)
        assert list(s.token_ids) == list(r.token_ids[:cut])
        np.testing.assert_array_equal(s.logprobs, r.logprobs[:cut])
        if hits and r.token_ids[hits[0]] == IDS[IM_END]:
            ended_at_turn += 1
            assert s.finish_reason == "stop" and len(r.token_ids) > cut  # the control ran on past it
            assert d.reward(list(s.token_ids), "w7") == d.reward(list(s.token_ids[:-1]), "w7")
    assert ended_at_turn >= 1


def test_a_bad_generation_config_is_a_config_error(chatml_run, tmp_path):
    import shutil

    c = chatml_run.copy_and_resolve_references()
    model = tmp_path / "model"
    shutil.copytree(c.model.path, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [IDS[IM_END], 10_000]}))
    c.model.path = str(model)
    with pytest.raises(ConfigError, match=r"config.model.path: .*generation_config.json: eos_token_id"):
        TaskData(c, model_vocab_size=VOCAB)
