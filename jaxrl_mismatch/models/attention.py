"""Causal self-attention kernels behind one function, and the KV-cache decode attention.

Attention (Vaswani et al. 2017, eq. 1): softmax(Q Kᵀ / √d) V, grouped-query (Ainslie et al. 2023): query
head h reads key/value head h // (H / H_kv), HF's `repeat_kv` grouping, computed on grouped views so the
repeated keys/values are never materialised.

Which keys a query sees is given by **segment ids** `[B, S]` int: 0 on padding, k ≥ 1 on the tokens of the
k-th sequence of the row. Query slot i sees key slot j iff `seg[i] == seg[j] > 0` and `j <= i`. An ordinary
0/1 attention mask *is* a segment-id array (one sequence per row, left or right padded), packed rows hold
several. Queries on padding see nothing; their outputs are finite and meaningless (callers mask them).

Implementations (`ATTENTION_IMPLS`, chosen by the model's `attention_impl`):

- `"xla"`: `jax.nn.dot_product_attention(implementation="xla")` with the boolean mask. Materialises the
  `[B, H, S, S]` float32 scores: fine for short rows, quadratic memory for long ones.
- `"cudnn"`: `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN flash attention (GPU, bf16/fp16,
  head_dim % 8 == 0). cuDNN's padding mask only knows right padding by per-row length, so rows are rotated
  to start at slot 0 (left padding becomes right padding), attended with `query_seq_lengths` /
  `key_value_seq_lengths` + `is_causal`, and rotated back. One sequence per row only (`packed=False`).
- `"chunked"`: pure JAX, query-chunked (Rabe & Staats 2021, "Self-attention does not need O(n²) memory"):
  `lax.map` over query blocks, each block's `[block, S]` scores under `jax.checkpoint`, so forward *and*
  backward hold one block's scores at a time — compiled temp memory grows linearly in S. Any backend.
- `"auto"`: cuDNN on GPU for bf16/fp16 unpacked rows; otherwise chunked once S ≥ `CHUNKED_MIN_SEQ`,
  else xla. (`jax.nn.dot_product_attention`'s own `implementation=None` means xla even on GPU.)

Decode (`cached_attention`) reads the cache prefix that is filled, block by block, with the online softmax
(Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, Alg. 1): cost grows with the filled length,
not with the allocated one.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "chunked")
CHUNKED_MIN_SEQ = 1024  # "auto" switches from the S×S xla path to the chunked one here (off GPU)
DEFAULT_BLOCK = 512  # query rows per block of the chunked path
_NEG = np.float32(np.finfo(np.float32).min)  # masked score: exp(_NEG - m) is exactly 0 for any real m


def matmul_precision(dtype) -> jax.lax.Precision:
    """HIGHEST for float32 operands, DEFAULT otherwise.

    float32 must mean float32: GPUs/TPUs would otherwise use TF32/bf16 passes for fp32 matmuls, which is
    itself a training–inference mismatch.
    """
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def check_impl(impl: str) -> str:
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r} is not one of {', '.join(map(repr, ATTENTION_IMPLS))}")
    return impl


def resolve_impl(impl: str, *, dtype, seq_len: int, head_dim: int, packed: bool, backend: str | None = None) -> str:
    """The concrete implementation `impl` stands for at these (static) shapes on `backend`.

    Raises:
        ValueError: for an unknown name, or `"cudnn"` where cuDNN cannot run it (float32, packed rows,
            head_dim not a multiple of 8).
    """
    check_impl(impl)
    backend = jax.default_backend() if backend is None else backend
    low_precision = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    cudnn_ok = low_precision and not packed and head_dim % 8 == 0 and head_dim <= 128
    if impl == "auto":
        if backend == "gpu" and cudnn_ok:
            return "cudnn"
        return "chunked" if seq_len >= CHUNKED_MIN_SEQ else "xla"
    if impl == "cudnn" and not cudnn_ok:
        raise ValueError(
            f"attention_impl='cudnn' needs bf16/fp16 compute, unpacked rows and head_dim a multiple of 8 "
            f"(<= 128); got dtype {jnp.dtype(dtype).name}, packed={packed}, head_dim={head_dim}. "
            "Use 'auto', 'xla' or 'chunked'."
        )
    return impl


def visible(
    q_segments: Int[Array, "batch q_len"], k_segments: Int[Array, "batch kv_len"],
    q_slots: Int[Array, "q_len"], k_slots: Int[Array, "kv_len"],
) -> Bool[Array, "batch q_len kv_len"]:
    """Query i sees key j iff same segment, not padding, and j is not after i (causal by slot)."""
    same = (q_segments[:, :, None] == k_segments[:, None, :]) & (k_segments[:, None, :] > 0)
    return same & (k_slots[None, None, :] <= q_slots[None, :, None])


def self_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    segment_ids: Int[Array, "batch seq"],
    *,
    impl: str = "auto",
    packed: bool = False,
    block: int = DEFAULT_BLOCK,
) -> Float[Array, "batch seq heads head_dim"]:
    """Causal, segment-masked grouped-query attention of a full sequence (training, θ_old, prefill).

    `packed=False` promises one contiguous sequence per row (what the cuDNN route needs); `packed=True`
    allows several (segment ids 1, 2, …). The xla and chunked routes are exact for any segment layout.
    """
    b, s, h, d = q.shape
    name = resolve_impl(impl, dtype=q.dtype, seq_len=s, head_dim=d, packed=packed)
    if name == "chunked":
        return _chunked(q, k, v, segment_ids, block=block)
    if name == "cudnn":
        return _right_aligned(q, k, v, segment_ids, implementation="cudnn")
    if q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        # jax's xla kernel asks for an F16×F16→F32 dot algorithm that XLA:CPU rejects at compile time;
        # the same S×S computation as a single block of the chunked kernel.
        return _chunked(q, k, v, segment_ids, block=s)
    return _xla(q, k, v, segment_ids)


def _fp32_exact(dtype):
    # jax.nn.dot_product_attention's einsums take no precision argument; this sets it for float32 operands.
    return jax.default_matmul_precision("highest") if jnp.dtype(dtype) == jnp.float32 else contextlib.nullcontext()


def _xla(q, k, v, segment_ids):
    slots = jnp.arange(q.shape[1], dtype=jnp.int32)
    mask = visible(segment_ids, segment_ids, slots, slots)[:, None, :, :]
    with _fp32_exact(q.dtype):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def _right_aligned(q, k, v, segment_ids, *, implementation: str):
    """Rotate each row so its sequence starts at slot 0, attend by per-row length (cuDNN's padding
    mask), rotate back. Exact for one contiguous sequence per row, left and/or right padded.

    `implementation="xla"` runs the very same route on CPU (how the tests check the rotation)."""
    b, s = segment_ids.shape
    real = segment_ids > 0
    start = jnp.argmax(real, axis=1).astype(jnp.int32)
    # An all-padding row gets length 1 (a finite, discarded output) rather than 0, which cuDNN may refuse.
    length = jnp.maximum(jnp.sum(real, axis=1, dtype=jnp.int32), 1)
    slots = jnp.arange(s, dtype=jnp.int32)[None, :]
    fwd = (slots + start[:, None]) % s
    back = (slots - start[:, None]) % s

    def rotate(x, idx):
        return jnp.take_along_axis(x, idx[:, :, None, None], axis=1)

    with _fp32_exact(q.dtype):
        out = jax.nn.dot_product_attention(
            rotate(q, fwd), rotate(k, fwd), rotate(v, fwd), is_causal=True, query_seq_lengths=length,
            key_value_seq_lengths=length, implementation=implementation,
        )
    return jnp.where(real[:, :, None, None], rotate(out, back), jnp.zeros((), out.dtype))


def _chunked(q, k, v, segment_ids, *, block: int):
    b, s, h, d = q.shape
    kvh = k.shape[2]
    block = max(1, min(block, s))
    n = -(-s // block)
    pad = n * block - s
    q_seg = jnp.pad(segment_ids, ((0, 0), (0, pad)))  # padded query rows are segment 0: discarded
    q_pad = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q_blocks = q_pad.reshape(b, n, block, kvh, h // kvh, d).transpose(1, 0, 2, 3, 4, 5)
    seg_blocks = q_seg.reshape(b, n, block).transpose(1, 0, 2)
    slot_blocks = jnp.arange(n * block, dtype=jnp.int32).reshape(n, block)
    k_slots = jnp.arange(s, dtype=jnp.int32)
    scale = np.float32(1.0 / np.sqrt(d))
    prec = matmul_precision(q.dtype)

    # One block's scores are recomputed in the backward pass instead of stored: peak memory is
    # O(block × S) per layer in both passes (Rabe & Staats 2021, §3).
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one(qb, seg_qb, slot_qb, k, v):
        scores = jnp.einsum("bqkgd,btkd->bkgqt", qb, k, preferred_element_type=jnp.float32, precision=prec) * scale
        mask = visible(seg_qb, segment_ids, slot_qb, k_slots)[:, None, None, :, :]
        probs = jax.nn.softmax(jnp.where(mask, scores, _NEG), axis=-1).astype(v.dtype)
        return jnp.einsum("bkgqt,btkd->bqkgd", probs, v, precision=matmul_precision(v.dtype))

    out = jax.lax.map(lambda xs: one(*xs, k, v), (q_blocks, seg_blocks, slot_blocks))
    out = out.transpose(1, 0, 2, 3, 4, 5).reshape(b, n * block, h, d)[:, :s]
    return out.astype(q.dtype)


def cached_attention(
    q: Float[Array, "batch q_len heads head_dim"],
    cache_k: Float[Array, "layers batch cache_len kv_heads head_dim"],
    cache_v: Float[Array, "layers batch cache_len kv_heads head_dim"],
    key_mask: Bool[Array, "batch cache_len"],
    first_slot: Int[Array, ""],
    layer: int | Int[Array, ""],
    *,
    block: int,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Attention of queries at cache slots [first_slot, first_slot + q_len) over layer `layer` of the cache.

    Only the ⌈(first_slot + q_len) / block⌉ blocks that can hold a visible key are read (a `fori_loop`
    with a traced trip count); each block updates a running max m, normaliser ℓ and output accumulator
    (online softmax, Milakov & Gimelshein 2018 Alg. 3; FlashAttention, Dao et al. 2022, Alg. 1 lines 9–12):
        m' = max(m, max_j s_j),  ℓ' = ℓ·e^{m−m'} + Σ_j e^{s_j−m'},  o' = o·e^{m−m'} + Σ_j e^{s_j−m'} v_j,
    and the result is o / ℓ. Masked scores get weight exactly 0, so a query with no visible key returns 0.
    The cache length must be a multiple of `block` (`kv_cache.init_cache` allocates it so).
    """
    b, s, h, d = q.shape
    t, kvh = cache_k.shape[2], cache_k.shape[3]
    if t % block:
        raise ValueError(f"cache length {t} is not a multiple of the decode block {block} (use kv_cache.init_cache)")
    g = h // kvh
    qg = q.reshape(b, s, kvh, g, d)
    q_slots = first_slot + jnp.arange(s, dtype=jnp.int32)
    scale = np.float32(1.0 / np.sqrt(d))
    prec = matmul_precision(q.dtype)
    n_blocks = (first_slot + s + block - 1) // block

    def body(j, carry):
        m, l, acc = carry
        start = j * block
        kb = jax.lax.dynamic_slice(cache_k, (layer, 0, start, 0, 0), (1, b, block, kvh, d))[0]
        vb = jax.lax.dynamic_slice(cache_v, (layer, 0, start, 0, 0), (1, b, block, kvh, d))[0]
        valid = jax.lax.dynamic_slice_in_dim(key_mask, start, block, axis=1)
        slots = start + jnp.arange(block, dtype=jnp.int32)
        see = (valid[:, None, :] & (slots[None, None, :] <= q_slots[None, :, None]))[:, None, None, :, :]
        scores = jnp.einsum("bskgd,btkd->bkgst", qg, kb, preferred_element_type=jnp.float32, precision=prec) * scale
        scores = jnp.where(see, scores, _NEG)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.where(see, jnp.exp(scores - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgst,btkd->bkgsd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32,
                        precision=matmul_precision(vb.dtype))
        return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

    init = (
        jnp.full((b, kvh, g, s), _NEG, jnp.float32),
        jnp.zeros((b, kvh, g, s), jnp.float32),
        jnp.zeros((b, kvh, g, s, d), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d).astype(q.dtype)
