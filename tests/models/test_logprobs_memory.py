"""`token_logprobs` never materialises the full [B, S, V] logits, forward or backward.

The check is XLA's own accounting: `jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes`
is the scratch memory the compiled program needs besides its inputs and outputs. With V = 32768,
B·S·V·4 bytes = 64 MiB dwarfs everything else in the 1-layer d=32 model, so a program that ever holds
the logits needs at least that much; the naive reference (full logits, then log-softmax) is compiled
alongside to show the measurement does see them. Measured on CPU: chunked 16 MiB forward, 36 MiB
forward+backward; naive 128 MiB and 260 MiB.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch.models import ModelConfig, Transformer, positions_from_mask, token_logprobs
from jaxrl_mismatch.precision import policy


def _model(vocab: int, tied: bool) -> Transformer:
    cfg = ModelConfig.from_hf(
        dict(
            architectures=["Qwen3ForCausalLM"], vocab_size=vocab, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
        )
    )
    return Transformer(cfg, policy("fp32"), rngs=nnx.Rngs(1))


def _naive(model, ids, targets, mask):
    """Reference: the full logits tensor, then log-softmax over it."""
    hidden = model(ids, positions_from_mask(mask), mask)
    logp_all = jax.nn.log_softmax(model.logits(hidden), axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[:, :, None], axis=-1)[:, :, 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    valid = mask.astype(bool)
    return jnp.where(valid, logp, 0.0), jnp.where(valid, entropy, 0.0)


def _fns(model, chunk_size):
    graphdef, state = nnx.split(model)

    def chunked(state, ids, targets, mask):
        return token_logprobs(nnx.merge(graphdef, state), ids, targets, mask, chunk_size=chunk_size)

    def naive(state, ids, targets, mask):
        return _naive(nnx.merge(graphdef, state), ids, targets, mask)

    def loss(f):
        def scalar(state, ids, targets, mask):
            logp, entropy = f(state, ids, targets, mask)
            return jnp.sum(logp) + 0.1 * jnp.sum(entropy)

        return jax.grad(scalar)

    return state, chunked, naive, loss


def _batch(b, s, vocab, seed=0):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, vocab, (b, s)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, vocab, (b, s)), jnp.int32)
    mask = np.ones((b, s), np.int32)
    mask[0, :5] = 0
    return ids, targets, jnp.asarray(mask)


def test_chunked_logprobs_never_hold_full_logits():
    b, s, vocab = 2, 256, 32768
    logits_bytes = b * s * vocab * 4
    model = _model(vocab, tied=True)
    state, chunked, naive, loss = _fns(model, chunk_size=32)
    args = (state, *_batch(b, s, vocab))
    programs = {"chunked": chunked, "naive": naive, "chunked_grad": loss(chunked), "naive_grad": loss(naive)}
    compiled = {name: jax.jit(f).lower(*args).compile() for name, f in programs.items()}
    temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in compiled.items()}
    print({k: f"{v / 2**20:.1f} MiB" for k, v in temp.items()}, f"logits {logits_bytes / 2**20:.0f} MiB")
    assert temp["naive"] >= logits_bytes and temp["naive_grad"] >= logits_bytes  # the probe sees logits
    assert temp["chunked"] < 0.5 * logits_bytes
    assert temp["chunked_grad"] < logits_bytes

    # Same numbers as the naive program, values and gradients.
    (lp_c, ent_c), (lp_n, ent_n) = compiled["chunked"](*args), compiled["naive"](*args)
    np.testing.assert_allclose(lp_c, lp_n, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ent_c, ent_n, atol=1e-4, rtol=0)
    g_c, g_n = compiled["chunked_grad"](*args), compiled["naive_grad"](*args)
    for a, n in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_n)):
        np.testing.assert_allclose(a, n, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chunk_size_not_dividing_sequence(tied):
    """Padding the last chunk must not change any value (S = 10, chunk = 4)."""
    model = _model(256, tied)
    state, chunked, naive, _ = _fns(model, chunk_size=4)
    args = (state, *_batch(3, 10, 256, seed=1))
    lp_c, ent_c = jax.jit(chunked)(*args)
    lp_n, ent_n = jax.jit(naive)(*args)
    assert lp_c.shape == (3, 10) and lp_c.dtype == jnp.float32 and ent_c.dtype == jnp.float32
    np.testing.assert_allclose(lp_c, lp_n, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ent_c, ent_n, atol=1e-5, rtol=0)
