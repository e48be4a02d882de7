"""Precision policies: which dtype parameters, activations and the LM head/softmax use, per engine.

The FP16 paper (fp16-defeats-mismatch, §3) shows the mismatch is dominated by rounding in the rollout
and trainer forward passes; FP16's 10 mantissa bits round ~8x finer than BF16's 7. A policy lets the
trainer and the rollout engine be configured separately and compared.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DTypePolicy:
    """Dtypes of one engine's forward pass.

    param_dtype:   storage dtype of the weights (the optimizer keeps fp32 master weights separately).
    compute_dtype: matmul/activation dtype inside the transformer blocks.
    logits_dtype:  dtype of the LM-head matmul output and of the log-softmax; float32 here is the
                   "fp32 LM head" option (MiniMax-M1 / verl's fix for softmax rounding).
    """

    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    logits_dtype: jnp.dtype = jnp.float32

    @property
    def name(self) -> str:
        inv = {v: k for k, v in _DTYPES.items()}
        return inv.get(jnp.dtype(self.compute_dtype).type, str(self.compute_dtype))


PRESETS = ("fp32", "bf16", "fp16")


def policy(name: str, *, fp32_lm_head: bool = False, param_dtype: str | None = None) -> DTypePolicy:
    """Build a preset policy: `fp32`, `bf16` or `fp16` (weights and compute in that dtype).

    fp32_lm_head keeps the LM-head matmul and softmax in float32 while the blocks run in low precision.
    """
    table = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
    if name not in table:
        raise ValueError(f"unknown precision preset {name!r}; valid: {', '.join(PRESETS)}")
    dt = table[name]
    pdt = _DTYPES[param_dtype] if param_dtype is not None else dt
    return DTypePolicy(param_dtype=pdt, compute_dtype=dt, logits_dtype=jnp.float32 if fp32_lm_head else dt)
