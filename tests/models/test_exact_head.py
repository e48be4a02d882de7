"""The exact head's log-probs are a normalised distribution in every dtype: the samplers draw with
`categorical(log p)`, which renormalises what it is given, so a head whose exp(log p) summed to 1 ± 1e-2 (a bf16
log-softmax) reported μ values that were not the probabilities the tokens were drawn with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import ModelConfig, Transformer
from jaxrl_mismatch.models.exact import EXACT_CHUNK, chunk_logprobs


@pytest.mark.parametrize("preset", ["bf16", "fp16"])
def test_the_exact_heads_distribution_sums_to_one_in_low_precision(preset):
    cfg = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=3001, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                      rope_theta=1e4, rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
                      max_position_embeddings=64)
    model = Transformer(cfg, precision.policy(preset), rngs=nnx.Rngs(0))
    hidden = jax.random.normal(jax.random.key(1), (EXACT_CHUNK, 32), jnp.float32) * 4
    for t in (1.0, 0.7):
        logp = chunk_logprobs(model, hidden, t)
        assert logp.dtype == jnp.float32
        lse = np.asarray(jax.nn.logsumexp(logp, axis=-1))
        assert np.max(np.abs(lse)) < 1e-5, (preset, t, lse)
        # still the policy's logits: log-probs differ from one another exactly as the rounded logits / T do
        logits = np.asarray(model.logits(hidden[None])[0]).astype(np.float32)
        assert logits.dtype == np.float32 and model.logits(hidden[None]).dtype == precision.policy(preset).logits_dtype
        gaps = np.asarray(logp) - np.asarray(logp)[:, :1]
        np.testing.assert_allclose(gaps, (logits - logits[:, :1]) / np.float32(t), rtol=0, atol=2e-5)
