"""Parity of our Transformer with the transformers PyTorch reference on the same weights.

Each checkpoint is a random tiny HF model (all parameters redrawn, see hf_tiny.py) saved with
`save_pretrained` and loaded with `load_hf`. The batch mixes full, left-padded and right-padded rows;
only positions whose input and target are both real tokens are compared.

Measured on this CPU (2026-11, tiny configs of hf_tiny.py, log-probs ≈ -5.5, vs fp32 transformers):
fp32 max|Δ| ≈ 1e-6; bf16 preset 0.030–0.042; fp16 preset 0.0034–0.0053. The asserted bounds below are
those measurements rounded up by ~2x (bf16 ≤ 0.08, fp16 ≤ 0.01). The lower bounds check that the
low-precision presets really compute in low precision rather than silently in fp32.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from tests.models.hf_tiny import hf_token_logprobs, make_hf_model, padded_batch, real_positions, tiny_hf_config

from jaxrl_mismatch.models import ModelConfig, load_hf, token_logprobs
from jaxrl_mismatch.precision import policy

FAMILIES = ("llama", "qwen2", "qwen3")
LOW_PRECISION_BOUND = {"bf16": (1e-3, 0.08), "fp16": (1e-4, 0.01)}  # (must exceed, must not exceed)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(family, tied) -> (checkpoint dir, reference log-probs [B, S-1]); built once per module."""
    cache = {}

    def get(family: str, tied: bool):
        if (family, tied) not in cache:
            hf = make_hf_model(family, tied, seed=2 * FAMILIES.index(family) + int(tied))
            d = tmp_path_factory.mktemp(f"{family}_{'tied' if tied else 'untied'}")
            hf.save_pretrained(d)
            tokens, mask = padded_batch(seed=1)
            cache[family, tied] = d, hf_token_logprobs(hf, tokens, mask)
        return cache[family, tied]

    return get


def our_logprobs(model, tokens, mask, chunk_size=5, segment_ids=None):
    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state, ids, targets, m, seg):
        return token_logprobs(nnx.merge(graphdef, state), ids, targets, m, chunk_size=chunk_size, segment_ids=seg)

    seg = None if segment_ids is None else segment_ids[:, :-1]
    logp, entropy = f(state, tokens[:, :-1], tokens[:, 1:], mask[:, :-1], seg)
    return np.asarray(logp, np.float64), np.asarray(entropy, np.float64)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logprobs_match_transformers(checkpoints, family, tied):
    d, ref = checkpoints(family, tied)
    cfg, model = load_hf(d, policy=policy("fp32"))
    assert cfg.tie_word_embeddings == tied
    tokens, mask = padded_batch(seed=1)
    logp, entropy = our_logprobs(model, tokens, mask)
    real = real_positions(mask)
    err = np.abs(logp - ref)[real].max()
    assert err <= 2e-5, f"{family} tied={tied}: max |Δ logp| = {err:.3g}"
    # Entropy of a 256-way distribution lies in (0, log 256]; padded input positions are zeroed.
    valid_in = mask[:, :-1] == 1
    assert np.all((entropy[valid_in] > 0) & (entropy[valid_in] <= np.log(256) + 1e-4))
    assert np.all(logp[~valid_in] == 0) and np.all(entropy[~valid_in] == 0)


@pytest.mark.parametrize("impl", ["xla", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_attention_impls_match_transformers_on_padded_rows(checkpoints, family, impl):
    """Left-, right- and un-padded rows through each CPU attention kernel (chunked: 3-query blocks, so
    rows span several blocks and the last one is ragged)."""
    d, ref = checkpoints(family, False)
    _, model = load_hf(d, policy=policy("fp32"), attention_impl=impl, attention_block=3)
    tokens, mask = padded_batch(seed=1)
    logp, _ = our_logprobs(model, tokens, mask)
    err = np.abs(logp - ref)[real_positions(mask)].max()
    assert err <= 2e-5, f"{family} {impl}: max |Δ logp| = {err:.3g}"


@pytest.mark.parametrize("impl", ["xla", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_match_transformers(checkpoints, family, impl):
    """The four sequences of the padded batch packed into two rows (segment ids, per-sequence positions) score
    like transformers scoring each sequence alone."""
    d, _ = checkpoints(family, False)
    hf = make_hf_model(family, False, seed=2 * FAMILIES.index(family))
    _, model = load_hf(d, policy=policy("fp32"), attention_impl=impl, attention_block=4)
    tokens, mask = padded_batch(seed=1)
    seqs = [t[m == 1] for t, m in zip(tokens, mask)]
    rows = [[0, 3], [1, 2]]  # which sequences share a packed row
    width = max(sum(len(seqs[i]) for i in r) for r in rows) + 2  # + trailing padding
    packed = np.zeros((2, width), np.int32)
    seg = np.zeros((2, width), np.int32)
    where = {}
    for r, members in enumerate(rows):
        o = 0
        for k, i in enumerate(members):
            packed[r, o:o + len(seqs[i])] = seqs[i]
            seg[r, o:o + len(seqs[i])] = k + 1
            where[i] = (r, o)
            o += len(seqs[i])
    logp, entropy = our_logprobs(model, packed, (seg > 0).astype(np.int32), segment_ids=seg)
    for i, seq in enumerate(seqs):
        ref = hf_token_logprobs(hf, seq[None], np.ones((1, len(seq)), np.int32))[0]
        r, o = where[i]
        got = logp[r, o:o + len(seq) - 1]
        err = np.abs(got - ref).max()
        assert err <= 2e-5, f"{family} {impl} sequence {i}: max |Δ logp| = {err:.3g}"
    assert np.all(logp[seg[:, :-1] == 0] == 0) and np.all(entropy[seg[:, :-1] == 0] == 0)


@pytest.mark.parametrize("preset", ["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_low_precision_presets_within_measured_bound(checkpoints, family, preset):
    d, ref = checkpoints(family, False)
    _, model = load_hf(d, policy=policy(preset))
    assert model.layers[0].attn.q_proj.kernel[...].dtype == policy(preset).param_dtype
    tokens, mask = padded_batch(seed=1)
    logp, _ = our_logprobs(model, tokens, mask)
    err = np.abs(logp - ref)[real_positions(mask)].max()
    print(f"{family} {preset}: max |Δ logp| vs fp32 transformers = {err:.4g}")
    lower, upper = LOW_PRECISION_BOUND[preset]
    assert np.all(np.isfinite(logp))
    assert lower < err <= upper, f"{family} {preset}: max |Δ logp| = {err:.3g}, expected in ({lower}, {upper}]"


def test_padding_does_not_change_logprobs(checkpoints):
    """Extra left padding (shifts the slots but not the RoPE positions) and extra right padding."""
    d, _ = checkpoints("llama", False)
    _, model = load_hf(d, policy=policy("fp32"))
    tokens, mask = padded_batch(seed=1)
    logp, _ = our_logprobs(model, tokens, mask)
    rng = np.random.default_rng(0)
    pad_l, pad_r = rng.integers(0, 256, (4, 3)).astype(np.int32), rng.integers(0, 256, (4, 3)).astype(np.int32)
    tokens2 = np.concatenate([pad_l, tokens, pad_r], axis=1)
    mask2 = np.concatenate([np.zeros((4, 3), np.int32), mask, np.zeros((4, 3), np.int32)], axis=1)
    logp2, _ = our_logprobs(model, tokens2, mask2)
    real = real_positions(mask)
    np.testing.assert_allclose(logp2[:, 3 : 3 + logp.shape[1]][real], logp[real], atol=2e-6, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_from_hf_round_trip(family):
    hf_cfg = tiny_hf_config(family, tied=False)
    d = hf_cfg.to_dict()
    d["architectures"] = [f"{family.capitalize()}ForCausalLM"]
    cfg = ModelConfig.from_hf(d)
    assert cfg.head_dim == (32 if family == "qwen3" else 16)
    assert cfg.attention_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    assert (cfg.rope_scaling is not None) == (family == "llama")
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    # The legacy spelling (top-level rope_theta / rope_scaling, transformers 4.x hub files) reads the same.
    legacy = {k: v for k, v in cfg.to_hf().items() if k != "rope_parameters"}
    assert ModelConfig.from_hf(legacy) == cfg
    hash(cfg)  # rides in the jit-static graph definition


def test_config_refuses_unsupported_rope_scaling():
    d = ModelConfig.from_hf({**_minimal("LlamaForCausalLM")}).to_hf()
    d.pop("rope_parameters")
    d["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="'yarn'"):
        ModelConfig.from_hf(d)
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf({**_minimal("Qwen2ForCausalLM"), "use_sliding_window": True})


def _minimal(arch: str) -> dict:
    return dict(
        architectures=[arch], vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
