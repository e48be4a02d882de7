"""Weight quantization of the rollout engine: the realistic training–inference mismatch of FlashRL / TIS.

FlashRL (the TIS blog) samples rollouts from an INT8 / FP8 copy of the BF16 policy and trains the BF16
policy on them; the mismatch ρ = π/μ then comes from rounding the weights, not from injected noise. The
built-in engine reproduces that setting by *fake quantization*: each weight is quantized and dequantized
back to the compute dtype (`quantize_params`), so the served function is exactly that of the quantized
model (same values a W8A16 kernel multiplies) while the matmuls stay the engine's own.

Methods (both symmetric, one scale per output channel, i.e. per column of our `[in, out]` kernels, per
expert for stacked `[experts, in, out]` weights; the reduction runs over the `in` axis, -2):
- ``int8``: absmax scaling, s = max|W[:, j]| / 127, q = clip(round(W / s), -127, 127) (round half to
  even), W_q = q·s. Weight-only (activations stay in the compute dtype): |W_q − W| ≤ s/2 for float32 weights;
  dequantized back to a bf16 / fp16 weight dtype, W_q is rounded once more to that dtype, as a kernel that
  dequantizes to the half dtype before its matmul does (Marlin-style W8A16), adding up to half an ulp of W_q
  (2⁻⁸·|W_q| bf16, 2⁻¹¹·|W_q| fp16; near |q| = 127 in bf16 that is up to ~0.5·s, so about s in all).
- ``fp8``: e4m3 (`jnp.float8_e4m3fn`, max 448), s = max|W[:, j]| / 448, q = fp8(clip(W / s, ±448)),
  W_q = q·s: relative error ≤ 2⁻⁴ in the normal range, absolute ≤ 2⁻¹⁰·s among subnormals.

What is quantized: every linear layer of the decoder blocks (attention q/k/v/o, MLP gate/up/down, MoE
experts). Not quantized: the token embedding, the norms, biases, the MoE router and the LM head (tied or
not). That is the split vLLM's fp8 / int8 online quantization and FlashRL's INT8 recipe use (the LM head
and router stay in high precision because their error goes straight into the logits / the routing).

Mid-run onset (`rollout.mismatch_ramp_steps`): `blend` gives W + s·(W_q − W), s ∈ [0, 1], so the
quantization error can be switched on or ramped in per request without a second model copy on the wire.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxrl_mismatch.models.sharding import tree_path

METHODS = ("none", "int8", "fp8")
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")  # MoE stacked expert tensors [E, in, out]


def _scale(w: Float[Array, "... d_in d_out"], qmax: float) -> Float[Array, "... 1 d_out"]:
    """Per-output-channel absmax scale in float32; an all-zero channel gets scale 1 (its codes are 0). A channel
    holding a NaN gets a NaN scale, so its dequantized weights stay NaN as unquantized ones would (scale 1 made the
    NaN a 0 code and rounded the channel's other weights to integers: finite, wrong, and hidden)."""
    absmax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=-2, keepdims=True)
    return jnp.where(absmax == 0, 1.0, absmax / qmax)


def quantize_int8(w: Float[Array, "... d_in d_out"]) -> tuple[Int[Array, "... d_in d_out"], Float[Array, "... 1 d_out"]]:
    """(int8 codes, float32 per-output-channel scales): symmetric absmax, round to nearest (half to even)."""
    s = _scale(w, INT8_MAX)
    q = jnp.clip(jnp.round(w.astype(jnp.float32) / s), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, s


def quantize_fp8(w: Float[Array, "... d_in d_out"]) -> tuple[Array, Float[Array, "... 1 d_out"]]:
    """(float8_e4m3fn codes, float32 per-output-channel scales); the cast rounds to nearest even."""
    s = _scale(w, FP8_MAX)
    q = jnp.clip(w.astype(jnp.float32) / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q, s


def fake_quantize(w: Float[Array, "... d_in d_out"], method: str) -> Float[Array, "... d_in d_out"]:
    """Quantize then dequantize back to `w.dtype`: the weights a quantized engine computes with."""
    if method == "none":
        return w
    if method == "int8":
        q, s = quantize_int8(w)
    elif method == "fp8":
        q, s = quantize_fp8(w)
    else:
        raise ValueError(f"quantize method must be one of {', '.join(METHODS)}, got {method!r}")
    return (q.astype(jnp.float32) * s).astype(w.dtype)


def is_quantized(path) -> bool:
    """Whether the parameter at a `jax.tree_util` key path is a decoder linear weight (module docstring)."""
    names = tree_path(path).split("/")
    return (bool(names) and names[0] == "layers" and "router" not in names
            and names[-1] in ("kernel",) + _EXPERT_WEIGHTS)


def quantize_params(params, method: str):
    """The param tree with every decoder linear weight fake-quantized (`fake_quantize`); other leaves as is."""
    if method == "none":
        return params
    if method not in METHODS:
        raise ValueError(f"quantize method must be one of {', '.join(METHODS)}, got {method!r}")
    return jax.tree_util.tree_map_with_path(
        lambda path, w: fake_quantize(w, method) if is_quantized(path) and w.ndim >= 2 else w, params)


def blend(params, quantized, strength: Float[Array, ""]):
    """W + s·(W_q − W) for the quantized leaves (in float32, cast back): s = 0 → W, s ≥ 1 → W_q exactly."""
    def mix(path, w, wq):
        if not is_quantized(path):
            return w
        w32 = w.astype(jnp.float32)
        return jnp.where(strength >= 1, wq, (w32 + strength * (wq.astype(jnp.float32) - w32)).astype(w.dtype))
    return jax.tree_util.tree_map_with_path(mix, params, quantized)
