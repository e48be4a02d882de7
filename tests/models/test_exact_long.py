"""Exact mode at a length where attention runs chunked (issue 21): rows of ≥ `CHUNKED_MIN_SEQ` tokens are computed
by `attention._chunked` (query blocks under `lax.map`), not by the S×S `xla` kernel the short tests exercise.
There too the speculative sampler returns the reference exact sampler's tokens and log-probs, the trainer's
exact scorer gives μ = π(θ_old), and the update's exact forward gives the scorer's bits — all bit for bit."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import ModelConfig, Transformer, load_hf, save_hf
from jaxrl_mismatch.models.attention import CHUNKED_MIN_SEQ, DEFAULT_BLOCK
from jaxrl_mismatch.models.exact import canonical_length, score_exact
from jaxrl_mismatch.rollout.engine import SamplingSpec
from jaxrl_mismatch.rollout.jax_engine import JaxEngine
from jaxrl_mismatch.train.batch import from_completions
from jaxrl_mismatch.train.exact_forward import exact_forward_logprobs

pytestmark = pytest.mark.xla_full_opt  # exact mode: bit-for-bit claims about the programs users compile

VOCAB = 61
MAX_TOKENS = 8
PRESETS = {"float32": "fp32", "bfloat16": "bf16"}


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """A tiny random Qwen3 (2 layers, hidden 32) whose position range covers the long rows."""
    cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                      rope_theta=1e4, rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
                      max_position_embeddings=2048)
    d = tmp_path_factory.mktemp("long_qwen3")
    save_hf(Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(3)), cfg, d)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_mode_is_bitwise_at_a_chunked_length(long_checkpoint, dtype):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, size=k).tolist() for k in (1003, 1011)]
    lengths = {canonical_length(len(p), MAX_TOKENS) for p in prompts}
    assert lengths == {1024} and min(lengths) >= CHUNKED_MIN_SEQ  # row_hidden takes the chunked kernel
    assert min(lengths) > DEFAULT_BLOCK  # ... with more than one query block
    spec = SamplingSpec(n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=5, exact=True)
    fast = JaxEngine(str(long_checkpoint), dtype=dtype)
    out = fast.generate(prompts, spec)
    ref = JaxEngine(str(long_checkpoint), dtype=dtype, exact_sampler="reference").generate(prompts, spec)
    flat = lambda o: [(c.token_ids, c.logprobs) for g in o for c in g]  # noqa: E731
    assert flat(out) == flat(ref)  # float32 lists: bit for bit
    assert all(len(c.token_ids) == MAX_TOKENS for g in out for c in g)
    assert fast.exact_stats.exact_forwards >= 4

    # μ = π(θ_old): the trainer's exact scorer (float32 master weights in the engine's precision) ...
    rows = [prompts[i] for i, g in enumerate(out) for _ in g]
    b = from_completions(rows, [c.token_ids for g in out for c in g], [c.logprobs for g in out for c in g],
                         np.zeros(len(rows)), pad_id=0)
    _, model = load_hf(str(long_checkpoint), policy=precision.policy(PRESETS[dtype], param_dtype="float32"))
    graphdef, params = nnx.split(model, nnx.Param)
    pi = score_exact(graphdef, params, b.tokens, b.attention_mask, b.response_mask, max_tokens=MAX_TOKENS,
                     temperature=1.0)
    m = b.response_mask > 0
    assert m.sum() == 4 * MAX_TOKENS and np.array_equal(pi[m], b.rollout_logp[m])
    # ... and the update's exact forward, inside jit.
    logp, _ = jax.jit(lambda p: exact_forward_logprobs(graphdef, p, b.tokens, b.attention_mask, b.response_mask,
                                                       max_tokens=MAX_TOKENS, temperature=1.0))(params)
    assert np.array_equal(np.asarray(logp)[m], pi[m])
