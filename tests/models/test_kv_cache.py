"""KV-cache prefill + decode give the same logits as a full forward pass over the whole sequence.

Prompts are left-padded by different amounts; decoding is greedy from the cached logits, and the
full forward then re-reads the generated sequence (teacher forcing), so any slip in cache slots,
RoPE positions or masks shows up as a logit difference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch.models import (ModelConfig, Transformer, decode_loop, decode_step, init_cache,
                                   positions_from_mask, prefill)
from jaxrl_mismatch.precision import policy
from tests.models.hf_tiny import LLAMA3_SCALING

ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@functools.cache
def _model(family: str) -> Transformer:
    """One random model per family for the module (the tests only read it)."""
    d = dict(
        architectures=[ARCH[family]], vocab_size=128, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
    )
    if family == "llama":
        d["rope_scaling"] = LLAMA3_SCALING
    model = Transformer(ModelConfig.from_hf(d), policy("fp32"), rngs=nnx.Rngs(3))
    # Larger weights than the 0.02 init so that next-token distributions are far from uniform.
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 5.0 if x.ndim == 2 else x, state))
    return model


# Module-level programs keyed by the (static) graph definition: the tests of one family and shape share them.
# Both tests use B rows, PROMPT_LEN prompt slots and NEW new tokens.
B, PROMPT_LEN, NEW = 4, 7, 6


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, state, ids, m, cache):
    return prefill(nnx.merge(graphdef, state), ids, m, cache)


@functools.partial(jax.jit, static_argnums=0)
def _decode(graphdef, state, token, cache):
    return decode_step(nnx.merge(graphdef, state), token, cache)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_decode_matches_full_forward(family):
    model = _model(family)
    graphdef, state = nnx.split(model)
    b, prompt_len, new = B, PROMPT_LEN, NEW
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 128, (b, prompt_len)).astype(np.int32)
    mask = np.ones((b, prompt_len), np.int32)
    mask[1, :2] = 0
    mask[2, :5] = 0
    mask[3, :3] = 0
    prompt[mask == 0] = 0

    cache = init_cache(model.cfg, b, prompt_len + new, jnp.float32)
    logits, cache = _prefill(graphdef, state, prompt, mask, cache)
    step_logits, tokens = [logits], []
    for _ in range(new):
        token = np.argmax(np.asarray(logits), axis=-1).astype(np.int32)
        tokens.append(token)
        logits, cache = _decode(graphdef, state, token, cache)
        step_logits.append(logits)
    cached = np.stack([np.asarray(x) for x in step_logits[:-1]], axis=1)  # [B, new, V]

    seq = np.concatenate([prompt, np.stack([np.asarray(t) for t in tokens], axis=1)], axis=1)
    full_mask = np.concatenate([mask, np.ones((b, new), np.int32)], axis=1)

    @jax.jit
    def full(state, ids, m):
        mod = nnx.merge(graphdef, state)
        return mod.logits(mod(ids, positions_from_mask(m), m))

    ref = np.asarray(full(state, seq, full_mask))[:, prompt_len - 1 : prompt_len - 1 + new]
    assert np.abs(ref).max() > 1.0  # logits are not trivially flat
    np.testing.assert_allclose(cached, ref, atol=1e-5, rtol=0)
    assert int(cache.index) == prompt_len + new
    np.testing.assert_array_equal(np.asarray(cache.next_position), full_mask.sum(axis=1))


def test_decode_loop_ends_rows_on_stop_ids_and_limits_and_feeds_what_it_returns():
    """`decode_loop`'s bookkeeping with scripted tokens: row 0 stops on a stop id, row 1 at its limit, row 2 on a stop
    id that is also its last allowed token, row 3 runs the full width; ended rows get `pad_id` and zero records,
    and every step's logits are those of the tokens the loop returned (checked against explicit decode steps)."""
    model = _model("qwen3")
    graphdef, state = nnx.split(model)
    (b, prompt_len, new), stop, pad = (B, PROMPT_LEN, NEW), 9, 77
    rng = np.random.default_rng(1)
    prompt = rng.integers(10, 128, (b, prompt_len)).astype(np.int32)
    mask = np.ones((b, prompt_len), np.int32)
    mask[1, :3] = 0
    script = rng.integers(10, 128, (b, new)).astype(np.int32)
    script[0, 2], script[2, 3] = stop, stop
    limits = np.array([6, 2, 4, 6], np.int32)

    @jax.jit
    def run(state, ids, m, script, limits):
        mod = nnx.merge(graphdef, state)
        logits, cache = prefill(mod, ids, m, init_cache(mod.cfg, b, prompt_len + new, jnp.float32))

        def pick(t, logits):
            return script[:, t], {"top": jnp.argmax(logits, axis=-1), "seen": jnp.ones((b, 2), jnp.float32)}

        records = {"top": jnp.zeros((b, new), jnp.int32), "seen": jnp.zeros((b, new, 2), jnp.float32),
                   "after": jnp.zeros((b, new), jnp.int32)}
        return decode_loop(mod, logits, cache, pick, new_len=new, max_tokens=limits, stop_ids=jnp.array([stop, -1]),
                           pad_id=pad, records=records, observe=lambda: {"after": jnp.full((b,), 5, jnp.int32)})

    tokens, records, lengths, stopped = jax.device_get(run(state, prompt, mask, script, limits))
    np.testing.assert_array_equal(lengths, [3, 2, 4, 6])
    np.testing.assert_array_equal(stopped, [True, False, True, False])
    live = np.arange(new)[None, :] < lengths[:, None]
    np.testing.assert_array_equal(tokens, np.where(live, script, pad))
    np.testing.assert_array_equal(records["seen"], np.repeat(live[..., None], 2, axis=-1).astype(np.float32))
    np.testing.assert_array_equal(records["after"], np.where(live, 5, 0))

    # The argmax the loop recorded at step t is that of the logits after feeding its own tokens 0..t-1 (explicit
    # prefill and decode steps: the programs of test_greedy_decode_matches_full_forward[qwen3]).
    logits, cache = _prefill(graphdef, state, prompt, mask, init_cache(model.cfg, b, prompt_len + new, jnp.float32))
    for t in range(new):
        want = np.argmax(np.asarray(logits), axis=-1)
        np.testing.assert_array_equal(records["top"][:, t][live[:, t]], want[live[:, t]])
        logits, cache = _decode(graphdef, state, tokens[:, t], cache)


def test_left_pad_puts_every_prompt_against_the_right_edge():
    from jaxrl_mismatch.models import left_pad

    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=2)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [2, 2, 8]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1]])
    ids, mask = left_pad([[5, 6, 7], [8]], width=5)  # the engine's bucketed width, pad 0
    np.testing.assert_array_equal(ids, [[0, 0, 5, 6, 7], [0, 0, 0, 0, 8]])
    assert ids.dtype == mask.dtype == np.int32 and mask.sum() == 4
