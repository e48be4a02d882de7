"""HF checkpoint interop: multi-shard loads, save → transformers, bit-exact round trips, bad input."""

from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

from jaxrl_mismatch.models import hf_to_params, load_hf, params_to_hf, save_hf, token_logprobs
from jaxrl_mismatch.models.hf_io import ModelFilesError, check_model_files
from jaxrl_mismatch.precision import policy
from tests.models.hf_tiny import hf_token_logprobs, make_hf_model, padded_batch, real_positions


@pytest.fixture(scope="module")
def qwen2_sharded(tmp_path_factory):
    """A Qwen2 (biases) untied checkpoint written by transformers in several shards, and its reference."""
    hf = make_hf_model("qwen2", tied=False, seed=11)
    d = tmp_path_factory.mktemp("qwen2_sharded")
    hf.save_pretrained(d, max_shard_size="100KB")
    return d, hf


@pytest.fixture(scope="module")
def llama_tied(tmp_path_factory):
    hf = make_hf_model("llama", tied=True, seed=12)
    d = tmp_path_factory.mktemp("llama_tied")
    hf.save_pretrained(d)
    return d


def _logprobs(model, tokens, mask):
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda s, a, b, c: token_logprobs(nnx.merge(graphdef, s), a, b, c, chunk_size=8))
    return np.asarray(f(state, tokens[:, :-1], tokens[:, 1:], mask[:, :-1])[0], np.float64)


def _params(model) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in params_to_hf(nnx.state(model, nnx.Param), model.cfg).items()}


def test_sharded_transformers_checkpoint_loads(qwen2_sharded):
    d, hf = qwen2_sharded
    assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) > 1
    assert os.path.exists(d / "model.safetensors.index.json")
    cfg, model = load_hf(d, policy=policy("fp32"))
    assert cfg.attention_bias and not cfg.tie_word_embeddings
    # Every tensor arrived unchanged (modulo our transposes), names matching transformers' state dict.
    ours = _params(model)
    theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert set(ours) == set(theirs)
    for name, x in theirs.items():
        np.testing.assert_array_equal(ours[name], x, err_msg=name)


def test_save_loads_in_transformers_and_round_trips_bit_exact(qwen2_sharded, tmp_path):
    d, _ = qwen2_sharded
    cfg, model = load_hf(d, policy=policy("fp32"))
    check_model_files(d, cfg)  # the headers-only check a job runs first agrees with load_hf on a sharded folder
    out = tmp_path / "ours"
    files = save_hf(model, cfg, out, max_shard_bytes=120_000)
    assert len(files) > 1 and os.path.exists(out / "model.safetensors.index.json")

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    tokens, mask = padded_batch(seed=5)
    real = real_positions(mask)
    err = np.abs(hf_token_logprobs(hf, tokens, mask) - _logprobs(model, tokens, mask))[real].max()
    assert err <= 2e-5, f"transformers on our saved checkpoint: max |Δ logp| = {err:.3g}"

    _, reloaded = load_hf(out, policy=policy("fp32"))
    a, b = _params(model), _params(reloaded)
    assert set(a) == set(b)
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_tied_bf16_round_trip_bit_exact(llama_tied, tmp_path):
    """bf16 parameters are stored as bf16 safetensors and come back identical; no lm_head for tied."""
    cfg, model = load_hf(llama_tied, policy=policy("bf16"))
    save_hf(model, cfg, tmp_path)
    assert os.listdir(tmp_path).count("model.safetensors") == 1
    stored = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in stored and stored["model.embed_tokens.weight"].dtype.name == "bfloat16"
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    cfg2, reloaded = load_hf(tmp_path, policy=policy("bf16"))
    assert cfg2 == cfg
    a, b = _params(model), _params(reloaded)
    assert all(np.array_equal(a[n].view(np.uint16), b[n].view(np.uint16)) for n in a)


def test_wire_format_round_trip_keeps_shardings(qwen2_sharded):
    """params_to_hf → hf_to_params onto the live parameters (weight sync) reproduces them exactly."""
    from jaxrl_mismatch.models.sharding import make_mesh, param_shardings

    d, _ = qwen2_sharded
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _, model = load_hf(d, policy=policy("fp32"), mesh=mesh)
    params = nnx.state(model, nnx.Param)
    expected = param_shardings(params, mesh)
    for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
        assert leaf.sharding == sharding
    wire = params_to_hf(params, model.cfg)
    assert all(isinstance(x, np.ndarray) for x in wire.values())
    assert wire["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # torch [out, in]
    back = hf_to_params(wire, model.cfg, params)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert y.sharding == x.sharding and np.array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------------------------- bad input


def _copy_checkpoint(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_unsupported_architecture_is_named(llama_tied, tmp_path):
    d = _copy_checkpoint(
        llama_tied, tmp_path / "x", edit_config=lambda c: c.update(architectures=["MistralForCausalLM"])
    )
    supported = "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=rf"'MistralForCausalLM'; supported: {supported}"):
        load_hf(d, policy=policy("fp32"))


def test_missing_tensor_is_named(llama_tied, tmp_path):
    d = _copy_checkpoint(llama_tied, tmp_path / "x", edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf(d, policy=policy("fp32"))


def test_wrong_shape_is_named(llama_tied, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)

    d = _copy_checkpoint(llama_tied, tmp_path / "x", edit_tensors=edit)
    msg = r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(48, 64\), expected \(32, 64\)"
    with pytest.raises(ValueError, match=msg):
        load_hf(d, policy=policy("fp32"))


def test_unexpected_tensor_is_named(llama_tied, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.extra_proj.weight"] = np.zeros((4, 4), np.float32)

    d = _copy_checkpoint(llama_tied, tmp_path / "x", edit_tensors=edit)
    with pytest.raises(ValueError, match=r"does not use: 'model\.layers\.0\.mlp\.extra_proj\.weight'"):
        load_hf(d, policy=policy("fp32"))


# ------------------------------------------------------------------------------------------------ vLLM

_VLLM_SCORE = r"""
import json, sys
import vllm

def main(model_dir, tokens_json, out_json):
    rows = json.load(open(tokens_json))
    llm = vllm.LLM(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=64, seed=0,
                   generation_config="vllm", enable_prefix_caching=False, enforce_eager=True)
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": r} for r in rows], params)
    result = []
    for r, o in zip(rows, outs):
        # prompt_logprobs[t] holds log p(r[t] | r[:t]) (None at t = 0), keyed by token id.
        result.append([o.prompt_logprobs[t][r[t]].logprob for t in range(1, len(r))])
    json.dump(result, open(out_json, "w"))

if __name__ == "__main__":
    main(*sys.argv[1:])
"""


@pytest.mark.vllm
def test_saved_checkpoint_loads_in_vllm(tmp_path):
    """vLLM (CPU, fp32) scores our saved tied Llama-3-scaled checkpoint like our model does.

    head_dim 32: vLLM's CPU attention kernels reject head_dim 16.
    """
    import subprocess
    import sys

    make_hf_model("llama", tied=True, seed=14, num_attention_heads=2, num_key_value_heads=1).save_pretrained(
        tmp_path / "hf"
    )
    cfg, model = load_hf(tmp_path / "hf", policy=policy("fp32"))
    assert cfg.head_dim == 32 and cfg.rope_scaling is not None
    out = tmp_path / "ours"
    save_hf(model, cfg, out)
    tokens, mask = padded_batch(seed=7)
    rows = [[int(t) for t, m in zip(tr, mr) if m] for tr, mr in zip(tokens, mask)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "score.py").write_text(_VLLM_SCORE)
    env = {
        **os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
    }
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "score.py"), str(out), str(tmp_path / "rows.json"), str(tmp_path / "o.json")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    vllm_logp = json.loads((tmp_path / "o.json").read_text())
    ours = _logprobs(model, tokens, mask)
    for b, row in enumerate(vllm_logp):
        real = np.flatnonzero(real_positions(mask)[b])
        np.testing.assert_allclose(np.asarray(row), ours[b, real], atol=1e-4, rtol=0, err_msg=f"row {b}")


def test_save_refuses_a_folder_that_already_holds_weights(llama_tied, tmp_path):
    """A single-file save over a sharded checkpoint left its index and shards, and `load_hf` read the index first:
    the old weights came back."""
    cfg, model = load_hf(llama_tied, policy=policy("fp32"))
    out = tmp_path / "ckpt"
    save_hf(model, cfg, out, max_shard_bytes=20_000)
    before = sorted(os.listdir(out))
    with pytest.raises(FileExistsError, match=r"already holds a checkpoint's weights \(model-00001-of-"):
        save_hf(model, cfg, out)
    assert sorted(os.listdir(out)) == before


@pytest.mark.parametrize("index, needle", [
    ("[]", "expected an object with a non-empty 'weight_map'"),
    ('{"weight_map": ["model.safetensors"]}', "expected an object with a non-empty 'weight_map'"),
    ('{"metadata": {}}', "expected an object with a non-empty 'weight_map'"),
    ('{"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}', "not a .safetensors file name in the"),
    ("{not json", "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON (maximum recursion depth"),
])
def test_a_malformed_shard_index_is_named(llama_tied, tmp_path, index, needle):
    """A TypeError / AttributeError / KeyError traceback before; every job's check expects ModelFilesError."""
    d = _copy_checkpoint(llama_tied, tmp_path / "x")
    (d / "model.safetensors.index.json").write_text(index)
    for load in (lambda: check_model_files(d), lambda: load_hf(d, policy=policy("fp32"))):
        with pytest.raises(ModelFilesError, match=re.escape(needle)):
            load()


@pytest.mark.parametrize("value, needle", [("9" * 5000, "Exceeds the limit (4300 digits)"),
                                           ("[" * 100_000 + "]" * 100_000, "maximum recursion depth")])
def test_a_config_json_python_cannot_parse_is_named(llama_tied, tmp_path, value, needle):
    """An integer past Python's 4,300 digits (a plain ValueError, not a JSONDecodeError) gave a message naming no
    file; nesting past the recursion limit was a RecursionError traceback."""
    d = _copy_checkpoint(llama_tied, tmp_path / "x")
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text.replace("{", '{"extra": ' + value + ", ", 1))
    with pytest.raises(ValueError, match=re.escape(f"{d / 'config.json'} is not valid JSON ({needle}")):
        load_hf(d, policy=policy("fp32"))


def test_a_stray_safetensors_copy_of_a_tensor_is_refused_naming_both_files(llama_tied, tmp_path):
    """Without an index every safetensors file was read and the name sorting last won: a zeroed
    model_old.safetensors beside model.safetensors replaced the weights silently."""
    d = _copy_checkpoint(llama_tied, tmp_path / "x")
    t = load_file(d / "model.safetensors")
    save_file({"model.embed_tokens.weight": np.zeros_like(t["model.embed_tokens.weight"])},
              d / "model_old.safetensors", metadata={"format": "pt"})
    msg = "tensor 'model.embed_tokens.weight' is in both model.safetensors and model_old.safetensors"
    for load in (lambda: check_model_files(d), lambda: load_hf(d, policy=policy("fp32"))):
        with pytest.raises(ModelFilesError, match=re.escape(msg)):
            load()


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}


@pytest.mark.parametrize("edit, needle", [
    # read as Llama, while transformers builds a Mistral with a sliding window (logits 1.6 apart) or refuses
    ({"model_type": "mistral", "sliding_window": 8}, "model_type 'mistral' is not LlamaForCausalLM's ('llama')"),
    ({"model_type": "bogus"}, "model_type 'bogus' is not LlamaForCausalLM's"),
    # transformers 5 and vLLM take a non-null rope_scaling first, this reader rope_parameters
    ({"rope_scaling": _LLAMA3, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
     "give different RoPE settings"),
    # a KeyError / TypeError / AttributeError before: exit 1 from train and serve, no file named
    ({"hidden_size": None}, "config.json: hidden_size is null"),
    ({"num_hidden_layers": "2"}, "config.json: num_hidden_layers must be an integer, got '2'"),
    ({"rms_norm_eps": [1e-6]}, "config.json: rms_norm_eps must be a number"),
    ({"rope_scaling": "llama3", "rope_parameters": None}, "config.json: rope_scaling must be an object or null"),
    ({"num_key_value_heads": 0}, "config.json: num_key_value_heads=0: sizes must be >= 1"),
    ({"vocab_size": 10**400}, "config.json: vocab_size is out of range (401 digits)"),  # float() overflowed
    ({"vocab_size": 1e300}, "config.json: vocab_size is out of range (1e+300)"),
    ({"num_attention_heads": None}, "config.json: num_attention_heads is null"),
    # without rope_scaling too: a reader of the older keys takes rope_theta
    ({"rope_theta": 50000.0, "rope_scaling": None, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
     "give different RoPE settings"),
    # transformers 5 takes a rope_theta inside rope_scaling (logits 0.48 apart), older readers the top-level one
    ({"rope_theta": 1e4, "rope_scaling": {**_LLAMA3, "rope_theta": 1e6}, "rope_parameters": None},
     "rope_scaling.rope_theta 1000000.0 and rope_theta 10000.0 differ"),
    # both spellings, the theta only in rope_parameters: transformers 5 takes rope_scaling and its default 1e4
    ({"rope_scaling": {"rope_type": "default"}, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
      "rope_theta": None}, "give different RoPE settings"),
    # a top-level original_max_position_embeddings goes over the dict's in transformers 5; it was ignored here
    ({"original_max_position_embeddings": 64, "rope_scaling": None, "rope_parameters": {"rope_theta": 1e4, **_LLAMA3}},
     "rope_parameters.original_max_position_embeddings 32 and original_max_position_embeddings 64 differ"),
])
def test_a_config_json_this_reader_would_misread_is_refused(llama_tied, tmp_path, edit, needle):
    d = _copy_checkpoint(llama_tied, tmp_path / "x", edit_config=lambda c: c.update(edit))
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_hf(d, policy=policy("fp32"))


def test_rope_settings_in_both_spellings_that_agree_load(llama_tied, tmp_path):
    """What `save_hf` writes (both spellings, the same settings) and a legacy config's `type` key load as one."""
    d = _copy_checkpoint(llama_tied, tmp_path / "x", edit_config=lambda c: c.update(
        rope_theta=5e5, rope_scaling={**{k: v for k, v in _LLAMA3.items() if k != "rope_type"}, "type": "llama3"},
        rope_parameters={"rope_theta": 5e5, **_LLAMA3}))
    cfg, _ = load_hf(d, policy=policy("fp32"))
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == _LLAMA3
    # a legacy rope_scaling holding the theta (no top-level one) is read as transformers 5 reads it; a top-level
    # original_max_position_embeddings fills the dict's
    d = _copy_checkpoint(llama_tied, tmp_path / "z", edit_config=lambda c: [c.pop(k, None) for k in (
        "rope_theta", "rope_parameters")] and c.update(rope_scaling={**{k: v for k, v in _LLAMA3.items() if k != (
            "original_max_position_embeddings")}, "rope_theta": 1e6}, original_max_position_embeddings=32))
    cfg, _ = load_hf(d, policy=policy("fp32"))
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == _LLAMA3
    # rope_parameters alone with the same top-level rope_theta (a null rope_scaling says nothing): it was refused
    d = _copy_checkpoint(llama_tied, tmp_path / "y", edit_config=lambda c: c.update(
        rope_theta=5e5, rope_scaling=None, rope_parameters={"rope_theta": 5e5, **_LLAMA3}))
    cfg, _ = load_hf(d, policy=policy("fp32"))
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == _LLAMA3
