"""Sequence packing: packed rows give each sequence exactly its unpacked log-probs, entropies and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch.models import ModelConfig, Transformer, token_logprobs
from jaxrl_mismatch.precision import policy
from jaxrl_mismatch.train.packing import pack_rows, pack_targets, unpack_targets

VOCAB = 80


def _model(impl: str) -> Transformer:
    cfg = ModelConfig.from_hf(dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4,
    ))
    model = Transformer(cfg, policy("fp32"), rngs=nnx.Rngs(5), attention_impl=impl, attention_block=8)
    # Larger weights than the 0.02 init: attention patterns far from uniform, so a leak across segments shows.
    # On the host (numpy): an eager jnp multiply would compile a program per weight shape.
    nnx.update(model, jax.tree.map(lambda x: np.asarray(x) * np.float32(4.0) if x.ndim == 2 else x,
                                   nnx.state(model, nnx.Param)))
    return model


def _rl_batch(seed=0, b=8, s=24):
    """Right-padded prompt+response rows of uneven length, one of them empty (a batch-filler row)."""
    rng = np.random.default_rng(seed)
    n = rng.integers(3, int(0.7 * s), b)
    n[0] = s  # one full-length row
    n[5] = 0
    mask = (np.arange(s)[None, :] < n[:, None]).astype(np.int32)
    tokens = rng.integers(1, VOCAB, (b, s)).astype(np.int32) * mask
    prompt = 2
    t = np.arange(s - 1)[None, :]
    response = ((t + 1 >= prompt) & (t + 1 < n[:, None])).astype(np.float32)
    adv = rng.normal(size=(b, 1)).astype(np.float32) * response
    return tokens, mask, response, adv


def _unpacked(model, tokens, mask):
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def f(p):
        return token_logprobs(nnx.merge(graphdef, p), tokens[:, :-1], tokens[:, 1:], mask[:, :-1], chunk_size=8)

    return f, params


def _packed(model):
    """A jitted forward on packed rows, unpacked to `[B, S-1]`. The rows are an argument: the probe with merged
    segments (`_merged`) runs the same compiled program as the real layout."""
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def f(p, r):
        logp, ent = token_logprobs(nnx.merge(graphdef, p), r.tokens[:, :-1], r.tokens[:, 1:], None, chunk_size=8,
                                   segment_ids=r.segment_ids[:, :-1], positions=r.positions[:, :-1])
        return tuple(unpack_targets(x, r.unpack_index, r.unpack_valid, num_groups=r.num_groups) for x in (logp, ent))

    return f, params


def _merged(rows):
    """The probe: one segment per packed row, so sequences would see their neighbours."""
    return rows.replace(segment_ids=(rows.segment_ids > 0).astype(rows.segment_ids.dtype))


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_packed_logprobs_equal_unpacked_per_token(impl):
    model = _model(impl)
    tokens, mask, response, _ = _rl_batch()
    packed = pack_rows(tokens, mask, num_groups=2)
    assert packed.num_rows < tokens.shape[0]  # it did pack
    (f_u, params), (f_p, _) = _unpacked(model, tokens, mask), _packed(model)
    lp_u, ent_u = (np.asarray(x) for x in f_u(params))
    lp_p, ent_p = (np.asarray(x) for x in f_p(params, packed.rows))
    valid = packed.rows.unpack_valid
    # Every real (input, target) pair of every sequence is covered, nothing else.
    np.testing.assert_array_equal(valid, (mask[:, :-1] == 1) & (mask[:, 1:] == 1))
    np.testing.assert_allclose(lp_p[valid], lp_u[valid], atol=1e-5, rtol=0)
    np.testing.assert_allclose(ent_p[valid], ent_u[valid], atol=1e-5, rtol=0)
    assert np.all(lp_p[~valid] == 0)
    # The comparison is sensitive: letting packed sequences see each other moves their log-probs.
    leaky, _ = f_p(params, _merged(packed.rows))
    assert np.abs(np.asarray(leaky)[valid] - lp_u[valid]).max() > 1e-2


def test_packed_gradient_equals_unpacked():
    """The policy-gradient surrogate Σ A·log π over response tokens: same value and same gradient."""
    model = _model("xla")
    tokens, mask, response, adv = _rl_batch(seed=1)
    packed = pack_rows(tokens, mask, num_groups=1)
    graphdef, params = nnx.split(model, nnx.Param)
    ptok, seg, pos = (jnp.asarray(x) for x in (packed.rows.tokens, packed.rows.segment_ids, packed.rows.positions))

    def loss_unpacked(p):
        lp, _ = token_logprobs(nnx.merge(graphdef, p), tokens[:, :-1], tokens[:, 1:], mask[:, :-1], chunk_size=8)
        return -jnp.sum(adv * lp * response) / jnp.sum(response)

    def loss_packed(p):
        lp, _ = token_logprobs(nnx.merge(graphdef, p), ptok[:, :-1], ptok[:, 1:], None, chunk_size=8,
                               segment_ids=seg[:, :-1], positions=pos[:, :-1])
        lp = unpack_targets(lp, packed.rows.unpack_index, packed.rows.unpack_valid)
        return -jnp.sum(adv * lp * response) / jnp.sum(response)

    (l_u, g_u), (l_p, g_p) = (jax.jit(jax.value_and_grad(f))(params) for f in (loss_unpacked, loss_packed))
    np.testing.assert_allclose(float(l_p), float(l_u), atol=1e-6, rtol=0)
    flat_u, flat_p = jax.tree.leaves(g_u), jax.tree.leaves(g_p)
    assert max(float(np.abs(np.asarray(g)).max()) for g in flat_u) > 1e-3
    for a, b in zip(flat_u, flat_p):
        np.testing.assert_allclose(b, a, atol=2e-6, rtol=1e-5)


def test_layout_groups_positions_and_round_trip():
    tokens, mask, response, adv = _rl_batch(seed=2, b=12, s=20)
    mask[3] = 0
    mask[3, 6:15] = 1  # a left- and right-padded row is one contiguous sequence too
    tokens = tokens * 0 + np.arange(1, 21)[None, :] * mask
    packed = pack_rows(tokens, mask, num_groups=3, rows_multiple=2)
    p, length = packed.rows.tokens.shape
    assert length == 20 and p % 3 == 0 and (p // 3) % 2 == 0
    rows = p // 3
    for i in range(12):
        k = int(mask[i].sum())
        if k == 0:
            continue
        g = i // 4
        r = g * rows + packed.row[i]  # group-local row inside the group's block of rows
        o = packed.offset[i]
        np.testing.assert_array_equal(packed.rows.tokens[r, o:o + k], tokens[i][mask[i] == 1])
        np.testing.assert_array_equal(packed.rows.positions[r, o:o + k], np.arange(k))
        seg = packed.rows.segment_ids[r, o]
        assert seg >= 1 and np.all(packed.rows.segment_ids[r, o:o + k] == seg)
    # Slots hold each real token exactly once; segment ids increase along every row.
    assert int((packed.rows.segment_ids > 0).sum()) == int(mask.sum())
    for row in packed.rows.segment_ids:
        ids = row[row > 0]
        assert np.all(np.diff(ids) >= 0)
    # pack_targets and unpack_targets are inverse on every valid target.
    packed_resp = pack_targets(response * adv, packed.rows)
    assert packed_resp.shape == (p, length - 1)
    back = unpack_targets(packed_resp, packed.rows.unpack_index, packed.rows.unpack_valid, num_groups=3)
    np.testing.assert_array_equal(back, np.where(packed.rows.unpack_valid, response * adv, 0))
    stats = packed.padding_stats(tokens.shape)
    assert stats["real_tokens"] == int(mask.sum()) and stats["padding_packed"] < stats["padding_unpacked"]


def test_bad_input_is_named():
    tokens, mask, _, _ = _rl_batch(b=6)
    holed = mask.copy()
    holed[2, 1] = 0
    holed[2, 0] = 1
    with pytest.raises(ValueError, match="row 2 has padding between its tokens"):
        pack_rows(tokens, holed)
    with pytest.raises(ValueError, match=r"more than the packed length 5"):
        pack_rows(tokens, mask, length=5)
    with pytest.raises(ValueError, match="does not split into num_groups=4"):
        pack_rows(tokens, mask, num_groups=4)
    with pytest.raises(ValueError, match=r"rows_per_group=1"):
        pack_rows(np.ones((4, 24), np.int32), np.ones((4, 24), np.int32), rows_per_group=1)


def test_row_buckets_bound_the_packed_shapes():
    """Every new packed shape is a new compilation: with row_buckets = k a group's row count is a multiple of
    ⌈(B/G)/k⌉ and never more than B/G, so 200 batches of random lengths give at most k shapes (else ~one per
    distinct need), and each still holds all its sequences."""
    rng = np.random.default_rng(0)
    shapes, exact = set(), set()
    for _ in range(200):
        n = rng.integers(4, 60, 64)
        mask = (np.arange(64)[None, :] < n[:, None]).astype(np.int32)
        tokens = rng.integers(1, VOCAB, (64, 64)).astype(np.int32) * mask
        packed = pack_rows(tokens, mask, num_groups=2, row_buckets=8)
        per_group = packed.rows.tokens.shape[0] // 2
        assert per_group % 4 == 0 and per_group <= 32  # ⌈32 / 8⌉ = 4
        assert int((packed.rows.segment_ids > 0).sum()) == int(mask.sum())
        shapes.add(packed.rows.tokens.shape)
        exact.add(pack_rows(tokens, mask, num_groups=2).rows.tokens.shape)
    assert len(shapes) <= 8 and len(exact) > len(shapes), (shapes, exact)
