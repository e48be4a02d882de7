"""Attention kernels (models/attention.py) against a float64 numpy reference of Vaswani eq. 1 with GQA.

Every route — xla, chunked (with blocks that do not divide S), and the cuDNN route (rows rotated to start at
slot 0, per-row lengths) run through XLA's kernel so it executes on CPU — must give the reference's values on
every real query for left-, right- and both-side-padded rows and for packed rows, stay finite on queries that
see nothing, and agree on gradients. The decode kernel must read only the filled prefix of the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_mismatch.models import attention as att

B, S, H, HKV, D = 5, 19, 4, 2, 8


def _segments(packed: bool) -> np.ndarray:
    seg = np.zeros((B, S), np.int32)
    seg[0] = 1  # no padding
    seg[1, 6:] = 1  # left padding
    seg[2, :11] = 1  # right padding
    seg[3, 4:15] = 1  # both sides
    # row 4 stays all padding (a batch-filler row)
    if packed:
        seg[0, 7:] = 2
        seg[0, 12:] = 3
        seg[2, 11:17] = 2
        seg[4, 2:9] = 1
        seg[4, 9:10] = 2  # a one-token sequence
    return seg


def _qkv(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(B, S, n, D)).astype(np.float32) * 1.5 for n in (H, HKV, HKV))
    return (jnp.asarray(x, dtype) for x in (q, k, v))


def _reference(q, k, v, seg) -> np.ndarray:
    """float64, loops over rows and heads: query i attends keys j <= i of its own segment (none on padding)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros(q.shape)
    for b in range(B):
        for i in range(S):
            if seg[b, i] == 0:
                continue
            keys = [j for j in range(i + 1) if seg[b, j] == seg[b, i]]
            for h in range(H):
                kv = h // (H // HKV)
                s = k[b, keys, kv] @ q[b, i, h] / np.sqrt(D)
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ v[b, keys, kv]
    return out


ROUTES = {
    "xla": lambda q, k, v, seg: att._xla(q, k, v, seg),
    "chunked": lambda q, k, v, seg: att._chunked(q, k, v, seg, block=4),  # 19 = 4·4 + 3: a ragged last block
    "cudnn_route": lambda q, k, v, seg: att._right_aligned(q, k, v, seg, implementation="xla"),
}


# The cuDNN route takes one sequence per row (resolve_impl never sends packed rows to it).
@pytest.mark.parametrize("route, packed", [("xla", False), ("xla", True), ("chunked", False), ("chunked", True),
                                           ("cudnn_route", False)])
def test_routes_match_reference(route, packed):
    seg = _segments(packed)
    q, k, v = _qkv()
    out = np.asarray(jax.jit(ROUTES[route])(q, k, v, jnp.asarray(seg)))
    assert out.shape == (B, S, H, D) and np.all(np.isfinite(out))
    real = seg > 0
    np.testing.assert_allclose(out[real], _reference(q, k, v, seg)[real], atol=2e-6, rtol=0)


def test_fully_masked_queries_stay_finite_and_gradients_agree():
    """Queries on padding see no key: finite outputs, finite gradients, and every route's gradient of the
    real queries' outputs is the xla route's."""
    seg = jnp.asarray(_segments(False))
    q, k, v = _qkv(1)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(B, S, H, D)), jnp.float32)

    def loss(route):
        def f(q, k, v):
            out = ROUTES[route](q, k, v, seg)
            return jnp.sum(jnp.where((seg > 0)[:, :, None, None], out * w, 0.0))

        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    ref = loss("xla")(q, k, v)
    for route in ("chunked", "cudnn_route"):
        got = loss(route)(q, k, v)
        for a, b in zip(ref, got):
            assert np.all(np.isfinite(np.asarray(b)))
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    assert float(jnp.abs(ref[1]).max()) > 1e-2  # keys do receive gradient


def test_bf16_routes_agree_with_float32():
    seg = _segments(True)
    q32, k32, v32 = _qkv(3)
    ref = _reference(q32, k32, v32, seg)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q32, k32, v32))
    for route in ("xla", "chunked"):
        out = np.asarray(jax.jit(ROUTES[route])(q, k, v, jnp.asarray(seg)), np.float32)
        assert out.dtype == np.float32 and np.all(np.isfinite(out))
        err = np.abs(out - ref)[seg > 0].max()
        assert 1e-4 < err < 0.1, (route, err)  # bf16 rounding, not a different formula


def test_resolve_impl():
    kw = dict(seq_len=128, head_dim=128, packed=False)
    assert att.resolve_impl("auto", dtype=jnp.bfloat16, backend="gpu", **kw) == "cudnn"
    assert att.resolve_impl("auto", dtype=jnp.float32, backend="gpu", **kw) == "xla"  # cuDNN has no fp32
    assert att.resolve_impl("auto", dtype=jnp.bfloat16, backend="gpu", **{**kw, "packed": True}) == "xla"
    assert att.resolve_impl("auto", dtype=jnp.bfloat16, backend="cpu", **kw) == "xla"
    long = {**kw, "seq_len": att.CHUNKED_MIN_SEQ}
    assert att.resolve_impl("auto", dtype=jnp.float32, backend="cpu", **long) == "chunked"
    assert att.resolve_impl("auto", dtype=jnp.float32, backend="tpu", **long) == "chunked"
    assert att.resolve_impl("xla", dtype=jnp.float32, backend="cpu", **long) == "xla"
    with pytest.raises(ValueError, match=r"'cudnn' needs bf16/fp16 compute.*float32"):
        att.resolve_impl("cudnn", dtype=jnp.float32, backend="gpu", **kw)
    with pytest.raises(ValueError, match=r"packed=True"):
        att.resolve_impl("cudnn", dtype=jnp.bfloat16, backend="gpu", **{**kw, "packed": True})
    with pytest.raises(ValueError, match=r"attention_impl='splash'"):
        att.resolve_impl("splash", dtype=jnp.float32, **kw)


@pytest.mark.parametrize("s", [1, 3])
def test_cached_attention_reads_only_the_filled_prefix(s):
    """Decode queries at slots [index, index+s) equal full attention over the prefix, with NaN written in
    every cache block past the filled length: blocks beyond it are never read."""
    t, block, layers, layer = 32, 8, 2, 1
    index = 13  # filled: slots [0, 16) after this step -> blocks 0 and 1 of 4
    rng = np.random.default_rng(4)
    q = rng.normal(size=(B, s, H, D)).astype(np.float32)
    ck = rng.normal(size=(layers, B, t, HKV, D)).astype(np.float32)
    cv = rng.normal(size=(layers, B, t, HKV, D)).astype(np.float32)
    filled = index + s
    n_read = -(-filled // block) * block
    ck[:, :, n_read:], cv[:, :, n_read:] = np.nan, np.nan
    key_mask = np.zeros((B, t), bool)
    key_mask[:, :filled] = True
    key_mask[1, :5] = False  # a left-padded prompt
    out = jax.jit(att.cached_attention, static_argnames=("block",))(
        jnp.asarray(q), jnp.asarray(ck), jnp.asarray(cv), jnp.asarray(key_mask), jnp.int32(index), jnp.int32(layer),
        block=block)
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    for b in range(B):
        for a in range(s):
            keys = [j for j in range(index + a + 1) if key_mask[b, j]]
            for h in range(H):
                kv = h // (H // HKV)
                sc = ck[layer, b, keys, kv].astype(np.float64) @ q[b, a, h] / np.sqrt(D)
                p = np.exp(sc - sc.max())
                np.testing.assert_allclose(out[b, a, h], (p / p.sum()) @ cv[layer, b, keys, kv], atol=2e-6, rtol=0)
