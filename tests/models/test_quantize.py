"""Weight quantization numerics (models/quantize.py): error bounds, per-output-channel scales, idempotence,
which parameters are quantized, and the strength blend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import Transformer
from jaxrl_mismatch.models import quantize as q
from tests.train.tiny_policy import tiny_config


def _weights(shape=(48, 24), seed=0):
    rng = np.random.default_rng(seed)
    # Columns of very different magnitude: a per-tensor scale would crush the small ones.
    return jnp.asarray(rng.normal(size=shape) * np.logspace(-3, 1, shape[-1]), jnp.float32)


def test_int8_per_channel_scales_and_error_bound():
    w = _weights()
    codes, s = q.quantize_int8(w)
    assert codes.dtype == jnp.int8 and s.shape == (1, w.shape[1])
    np.testing.assert_allclose(s[0], np.abs(np.asarray(w)).max(axis=0) / 127, rtol=1e-6)
    assert int(jnp.max(jnp.abs(codes))) == 127  # each channel's absmax maps to ±127
    assert np.all(np.abs(np.asarray(codes)).max(axis=0) == 127)
    err = np.abs(np.asarray(q.fake_quantize(w, "int8") - w))
    assert np.all(err <= np.asarray(s) / 2 * (1 + 1e-6))  # round to nearest: at most half a step
    assert err.max() > 0  # it does change the weights
    # Small columns keep their relative precision (per-channel, not per-tensor).
    rel = err.max(axis=0) / np.abs(np.asarray(w)).max(axis=0)
    assert rel.max() < 0.5 / 127 + 1e-6


@pytest.mark.parametrize("dtype, half_ulp", [("bfloat16", 2.0**-8), ("float16", 2.0**-11)])
def test_int8_error_bound_in_a_half_weight_dtype_adds_one_rounding(dtype, half_ulp):
    """Dequantized to bf16 / fp16, W_q is rounded once more: s/2 alone (the float32 bound) is broken (bf16 reached
    0.93·s), s/2 plus half an ulp of W_q holds."""
    w = jnp.asarray(np.random.default_rng(3).normal(size=(256, 64)) * 0.05, dtype)
    _, s = q.quantize_int8(w)
    wq = q.fake_quantize(w, "int8")
    assert wq.dtype == w.dtype
    err = np.abs(np.asarray(wq, np.float64) - np.asarray(w, np.float64))
    s = np.asarray(s, np.float64)
    assert np.any(err > s / 2 * (1 + 1e-6))  # the extra rounding is real
    assert np.all(err <= (s / 2 + half_ulp * np.abs(np.asarray(wq, np.float64))) * (1 + 1e-6))


def test_fp8_e4m3_error_bound_and_range():
    w = _weights(seed=1)
    codes, s = q.quantize_fp8(w)
    assert codes.dtype == jnp.float8_e4m3fn
    assert float(jnp.max(jnp.abs(codes.astype(jnp.float32)))) == 448.0
    np.testing.assert_allclose(s[0], np.abs(np.asarray(w)).max(axis=0) / 448, rtol=1e-6)
    wq = np.asarray(q.fake_quantize(w, "fp8"))
    err = np.abs(wq - np.asarray(w))
    bound = np.maximum(np.abs(np.asarray(w)) * 2.0**-4, np.asarray(s) * 2.0**-10) * (1 + 1e-5)
    assert np.all(err <= bound)
    assert np.isfinite(wq).all()
    # fp8 keeps 3 mantissa bits: coarser than int8 near each channel's absmax, finer near zero.
    assert err.max() > np.abs(np.asarray(q.fake_quantize(w, "int8") - w)).max()


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_idempotent_and_dtype_preserving(method, dtype):
    w = _weights(seed=2).astype(dtype)
    once = q.fake_quantize(w, method)
    assert once.dtype == dtype
    twice = q.fake_quantize(once, method)
    # Re-quantizing a quantized tensor gives the same codes; the values agree to float rounding of s.
    codes = q.quantize_int8 if method == "int8" else q.quantize_fp8
    np.testing.assert_array_equal(np.asarray(codes(once)[0]).astype(np.float32),
                                  np.asarray(codes(twice)[0]).astype(np.float32))
    np.testing.assert_allclose(np.asarray(twice, np.float32), np.asarray(once, np.float32), rtol=2e-6 if dtype == jnp.float32 else 1e-2)


def test_zero_channel_and_stacked_experts():
    w = _weights((3, 16, 8), seed=3).at[1, :, 2].set(0.0)  # [experts, in, out]
    _, s = q.quantize_int8(w)
    assert s.shape == (3, 1, 8) and float(s[1, 0, 2]) == 1.0
    wq = q.fake_quantize(w, "int8")
    assert np.all(np.asarray(wq[1, :, 2]) == 0) and np.isfinite(np.asarray(wq)).all()
    # Per expert: each expert's channels have their own scale.
    absmax = np.abs(np.asarray(w)).max(axis=1)
    np.testing.assert_allclose(np.asarray(s[:, 0]), np.where(absmax > 0, absmax / 127, 1.0), rtol=1e-6)


def test_params_quantized_are_the_decoder_linears():
    model = Transformer(tiny_config(), precision.policy("fp32"), rngs=nnx.Rngs(0))
    params = nnx.split(model, nnx.Param)[1]
    out = q.quantize_params(params, "int8")
    changed = {jax.tree_util.keystr(p) for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                                                             jax.tree.leaves(out)) if not np.array_equal(a, b)}
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    linears = {n for n in names if "['layers']" in n and "['kernel']" in n}
    assert changed == linears and len(linears) == 14  # 2 layers × (q, k, v, o, gate, up, down)
    assert all("embed" not in n and "lm_head" not in n and "norm" not in n for n in changed)
    assert q.quantize_params(params, "none") is params
    with pytest.raises(ValueError, match="int4"):
        q.quantize_params(params, "int4")


def test_blend_endpoints_and_midpoint():
    model = Transformer(tiny_config(), precision.policy("fp32"), rngs=nnx.Rngs(0))
    params = nnx.split(model, nnx.Param)[1]
    wq = q.quantize_params(params, "fp8")
    leaves = lambda t: jax.tree.leaves(t)  # noqa: E731
    for s, want in ((0.0, params), (1.0, wq)):
        for a, b in zip(leaves(q.blend(params, wq, jnp.float32(s))), leaves(want)):
            np.testing.assert_array_equal(a, b)
    for a, w, b in zip(leaves(q.blend(params, wq, jnp.float32(0.25))), leaves(params), leaves(wq)):
        np.testing.assert_allclose(a, w + 0.25 * (b - w), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_nan_weight_stays_nan_in_its_channel(method):
    """int8 gave a NaN channel scale 1: the NaN became code 0 and the channel's other weights were rounded to integers
    (0.01 and 0.3 served as 0): a damaged checkpoint served as finite, wrong weights. Other channels are untouched."""
    w = jnp.asarray([[0.01, 0.5], [jnp.nan, -0.25], [0.3, 0.125]], jnp.float32)
    out = np.asarray(q.fake_quantize(w, method))
    assert np.isnan(out[:, 0]).all()
    np.testing.assert_allclose(out[:, 1], np.asarray(w[:, 1]), atol=0.5 / 127)
