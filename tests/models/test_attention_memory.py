"""Compiled temp memory of the forward+backward log-prob computation grows linearly in S with the chunked
attention, quadratically with the S×S xla path (XLA's own accounting, `memory_analysis()`, on CPU).

A 1-layer model whose other activations are small, so the attention scores dominate. Measured on this CPU
(block 128, batch 1, 2 heads): chunked 3.0 → 5.9 → 11.9 MiB at S = 512 → 1024 → 2048 (×2.0 per doubling);
xla 8.7 → 33.5 MiB at 512 → 1024 (×3.8) and 131 MiB at 2048.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_mismatch.models import ModelConfig, Transformer, token_logprobs
from jaxrl_mismatch.precision import policy


def _temp_bytes(impl: str, seq: int) -> int:
    cfg = ModelConfig.from_hf(dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    ))
    model = Transformer(cfg, policy("fp32"), rngs=nnx.Rngs(0), attention_impl=impl, attention_block=128)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p, ids, mask):
        lp, _ = token_logprobs(nnx.merge(graphdef, p), ids[:, :-1], ids[:, 1:], mask[:, :-1], chunk_size=128)
        return jnp.sum(lp)

    ids = jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(params, ids, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_attention_memory_grows_linearly():
    chunked = [_temp_bytes("chunked", s) for s in (512, 1024, 2048)]
    xla = [_temp_bytes("xla", s) for s in (512, 1024)]
    print({"chunked MiB": [c / 2**20 for c in chunked], "xla MiB": [x / 2**20 for x in xla]})
    assert xla[1] / xla[0] > 3.5  # the probe sees quadratic growth where there is some
    for small, big in zip(chunked, chunked[1:]):
        assert big / small < 2.3, chunked
    assert chunked[2] < xla[1]  # at 4x the length, still below the S×S path
