"""Loss aggregation over ``[B, T]`` token terms with a *global* normaliser.

Every mode is ``Σ (per-sequence or per-token terms) / normaliser``, where the normaliser is computed once
from the mask of the whole batch (``global_normalizer``) and passed in. A microbatch therefore returns its
exact share of the full-batch loss: summing microbatch losses (or ``psum`` across devices) reproduces the
full-batch loss *and gradient* bit-for-bit up to float rounding — pinned by tests for every mode. (Dividing
by a microbatch-local count, as several peers do, changes the gradient with the split.)

Modes (names as in verl's ``loss_agg_mode``; FP16 paper Appendix A.1 for the ``-norm`` variant):

* ``token-mean``              — ``Σ_{i,t} v_it / N_tokens``                      (DAPO)
* ``seq-mean-token-sum``      — ``Σ_i Σ_t v_it / N_seqs``                         (FP16 paper eqs. 5–7 as written)
* ``seq-mean-token-mean``     — ``Σ_i (Σ_t v_it / |y_i|) / N_seqs``              (GRPO, objective-hacking eq. 24)
* ``seq-mean-token-sum-norm`` — ``Σ_i Σ_t v_it / (N_seqs · L)`` with a constant L, e.g. the max response
  length (Dr.GRPO; the FP16 paper's corrected verl mode). L must be given: using the padded width would make
  the loss depend on padding.

``N_seqs`` counts sequences with at least one response token, so all-padding rows change nothing.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl_mismatch.objectives._types import Scalar, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.ratios import as_bool_mask, seq_lengths

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGGREGATIONS)}")


def num_tokens(mask: TokenMask) -> Scalar:
    """Number of response tokens, float32."""
    return jnp.sum(as_bool_mask(mask)).astype(jnp.float32)


def num_seqs(mask: TokenMask) -> Scalar:
    """Number of sequences with at least one response token, float32."""
    return jnp.sum(jnp.any(as_bool_mask(mask), axis=-1)).astype(jnp.float32)


def global_normalizer(mask: TokenMask, mode: str, *, max_len: int | None = None) -> Scalar:
    """The normaliser of ``mode`` for the *whole* batch: call on the full mask, pass it to every microbatch.

    ``max_len`` is the Dr.GRPO constant L and is required by (only) ``seq-mean-token-sum-norm``.
    The result is clamped at 1 so an all-padding batch gives a zero loss, not 0/0.
    """
    _check_mode(mode)
    if mode == "token-mean":
        denom = num_tokens(mask)
    elif mode == "seq-mean-token-sum-norm":
        if max_len is None or max_len <= 0:
            raise ValueError("loss aggregation 'seq-mean-token-sum-norm' needs a positive constant max_len "
                             "(Dr.GRPO's L, e.g. the max response length); got max_len=None")
        denom = num_seqs(mask) * jnp.float32(max_len)
    else:
        denom = num_seqs(mask)
    return jnp.maximum(denom, 1.0)


def aggregate(values: TokenFloat, mask: TokenMask, mode: str, normalizer: Scalar) -> Scalar:
    """Aggregate token terms ``values`` under ``mode`` divided by the caller's global ``normalizer``.

    Padding entries of ``values`` are ignored (selected away, so even inf/NaN there cannot leak).
    """
    _check_mode(mode)
    m = as_bool_mask(mask)
    v = jnp.where(m, values.astype(jnp.float32), 0.0)
    if mode == "seq-mean-token-mean":
        per_seq = jnp.sum(v, axis=-1) / jnp.maximum(seq_lengths(m), 1.0)
        total = jnp.sum(per_seq)
    else:
        total = jnp.sum(v)
    return total / normalizer
