"""Precision policies (which dtype parameters, activations and the LM head/softmax use, per engine)
and FP16 dynamic loss scaling.

The FP16 paper (fp16-defeats-mismatch, §3) shows the mismatch is dominated by rounding in the rollout
and trainer forward passes; FP16's 10 mantissa bits round ~8x finer than BF16's 7. A policy lets the
trainer and the rollout engine be configured separately and compared.

FP16 buys that precision with range: 5 exponent bits, smallest normal ≈ 6.1e-5, largest ≈ 6.6e4
(FP16 paper Table 1). Gradients of an RL loss are typically far below 6e-5 and underflow to zero in
FP16, so FP16 training needs loss scaling (FP16 paper §3.2, Micikevicius et al. 2017): multiply the
loss by S before the backward pass, divide the gradients by S before the update, and adapt S —
halve it and skip the step when a gradient overflowed, double it after a run of finite steps.
BF16 and FP32 have FP32's exponent range and use the no-op scale (S = 1) through the same code path.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PyTree

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DTypePolicy:
    """Dtypes of one engine's forward pass.

    param_dtype:   storage dtype of the weights (the optimizer keeps fp32 master weights separately).
    compute_dtype: matmul/activation dtype inside the transformer blocks.
    logits_dtype:  dtype of the LM-head matmul output and of the log-softmax; float32 here is the
                   "fp32 LM head" option (MiniMax-M1 / verl's fix for softmax rounding).
    fp32_components: names from `COMPONENTS` computed in float32 while the rest runs in compute_dtype
                   (`analyze attribute`'s ablations; "lm_head" is the same as logits_dtype=float32).
                   Their inputs and outputs are cast at the component's edges; weights are upcast, not re-read.
    """

    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    logits_dtype: jnp.dtype = jnp.float32
    fp32_components: frozenset[str] = frozenset()

    def __post_init__(self):
        unknown = set(self.fp32_components) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"fp32_components: unknown {sorted(unknown)}; valid: {', '.join(COMPONENTS)}")
        object.__setattr__(self, "fp32_components", frozenset(self.fp32_components))
        if "lm_head" in self.fp32_components:  # the same as logits_dtype float32 (`policy` sets both)
            object.__setattr__(self, "logits_dtype", jnp.float32)

    def dtype_of(self, component: str) -> jnp.dtype:
        """The dtype `component` computes in: float32 if it is in `fp32_components`, else compute_dtype."""
        if component == "lm_head":
            return self.logits_dtype
        return jnp.float32 if component in self.fp32_components else self.compute_dtype

    @property
    def name(self) -> str:
        inv = {v: k for k, v in _DTYPES.items()}
        return inv.get(jnp.dtype(self.compute_dtype).type, str(self.compute_dtype))


PRESETS = ("fp32", "bf16", "fp16")
DTYPES = tuple(_DTYPES)  # the dtype names an engine computes in (float32, bfloat16, float16)

# Parts of the forward that can run in float32 on their own (DTypePolicy.fp32_components):
#   lm_head: LM-head matmul + log-softmax; attention: scores Q·Kᵀ, softmax and the weighted sum of V (the
#   q/k/v/o projections stay in compute_dtype; a KV cache is then kept in float32); norm: every RMSNorm's
#   gain multiply (it normalises in float32 already) with one rounding at its output; mlp: the dense SwiGLU
#   MLP or the MoE experts; router: the MoE router's logits.
COMPONENTS = ("lm_head", "attention", "norm", "mlp", "router")


def policy(name: str, *, fp32_lm_head: bool = False, param_dtype: str | None = None,
           fp32_components=()) -> DTypePolicy:
    """Build a preset policy: `fp32`, `bf16` or `fp16` (weights and compute in that dtype).

    fp32_lm_head keeps the LM-head matmul and softmax in float32 while the blocks run in low precision;
    fp32_components (names from `COMPONENTS`) does so per component ("lm_head" there = fp32_lm_head).
    """
    fp32_components = frozenset(fp32_components)
    fp32_lm_head = fp32_lm_head or "lm_head" in fp32_components
    table = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
    if name not in table:
        raise ValueError(f"unknown precision preset {name!r}; valid: {', '.join(PRESETS)}")
    dt = table[name]
    if param_dtype is not None and param_dtype not in _DTYPES:
        raise ValueError(f"unknown param_dtype {param_dtype!r}; valid: {', '.join(_DTYPES)}")
    pdt = _DTYPES[param_dtype] if param_dtype is not None else dt
    return DTypePolicy(param_dtype=pdt, compute_dtype=dt, logits_dtype=jnp.float32 if fp32_lm_head else dt,
                       fp32_components=fp32_components)


# --------------------------------------------------------------------------------------------------
# Dynamic loss scaling (FP16 paper §3.2)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Static settings of the loss scale; part of the jit cache key, not of the traced state.

    dynamic:    False gives the no-op scale (S = 1, never changes) used for fp32/bf16, so the train
                step has one code path for every precision.
    init_scale: first S. 2**15 puts a gradient of 1e-8 at ~3e-4, well inside FP16's normal range.
    period:     consecutive finite steps after which S grows (Megatron's loss_scale_window is 1000;
                RL runs are hundreds of steps, so a shorter window lets S recover within a run).
    factor:     S is multiplied by `factor` on growth and divided by it after an overflow.
    min_scale:  S never drops below this, so a run of bad batches cannot drive S to 0 (which would
                zero every gradient).
    max_scale:  cap on S, so that a long overflow-free run cannot grow S to inf in float32.
    """

    dynamic: bool = True
    init_scale: float = 2.0**15
    period: int = 200
    factor: float = 2.0
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self):
        if self.period < 1:
            raise ValueError(f"LossScaleConfig.period must be >= 1, got {self.period}")
        if not (math.isfinite(self.factor) and self.factor > 1.0):
            raise ValueError(f"LossScaleConfig.factor must be a finite number > 1, got {self.factor}")
        if not (math.isfinite(self.max_scale) and 0.0 < self.min_scale <= self.max_scale):
            raise ValueError(
                f"LossScaleConfig needs 0 < min_scale <= max_scale < inf, got {self.min_scale}, {self.max_scale}"
            )
        if self.dynamic and not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError(
                f"LossScaleConfig.init_scale={self.init_scale} is outside [min_scale, max_scale] = "
                f"[{self.min_scale}, {self.max_scale}]"
            )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("scale", "good_steps", "skipped_steps"),
    meta_fields=("config",),
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaleState:
    """Loss-scale state: a plain pytree of three scalars (checkpointable, replicate it on the mesh).

    scale:         current S, float32 (S itself may exceed FP16's range; it only multiplies the
                   float32 loss).
    good_steps:    consecutive finite steps since the last change of S, int32.
    skipped_steps: total steps skipped because a gradient was non-finite, int32 (a health metric).
    config:        static `LossScaleConfig` (pytree metadata, not a leaf).
    """

    scale: Float[Array, ""]
    good_steps: Int[Array, ""]
    skipped_steps: Int[Array, ""]
    config: LossScaleConfig = LossScaleConfig()

    @classmethod
    def create(cls, config: LossScaleConfig | None = None, **fields) -> LossScaleState:
        """Initial state (S = init_scale, or 1 for the no-op scale).

        Pass a `LossScaleConfig`, or its fields as keywords: `create()` is the default dynamic scale,
        `create(dynamic=False)` the no-op scale.
        """
        if config is not None and fields:
            raise TypeError("LossScaleState.create takes a LossScaleConfig or its fields, not both")
        config = LossScaleConfig(**fields) if config is None else config
        scale = config.init_scale if config.dynamic else 1.0
        return cls(
            scale=jnp.asarray(scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            config=config,
        )


def dynamic_loss_scale(**config) -> LossScaleState:
    """Dynamic loss scale for FP16 training; keyword arguments are `LossScaleConfig` fields."""
    return LossScaleState.create(LossScaleConfig(dynamic=True, **config))


def no_op_loss_scale() -> LossScaleState:
    """Constant S = 1 for fp32/bf16: no scaling, but the finite check and skip counter still work."""
    return LossScaleState.create(LossScaleConfig(dynamic=False))


def loss_scale_for(dtype_policy: DTypePolicy, **config) -> LossScaleState:
    """Dynamic scaling when the policy computes or stores weights in float16, the no-op scale otherwise.

    Only FP16 has the narrow exponent range that makes gradients underflow (FP16 paper Table 1);
    BF16 shares FP32's range, so scaling it would only add work.
    """
    fp16 = jnp.dtype(jnp.float16)
    if jnp.dtype(dtype_policy.compute_dtype) == fp16 or jnp.dtype(dtype_policy.param_dtype) == fp16:
        return dynamic_loss_scale(**config)
    return no_op_loss_scale()


def scale_loss(state: LossScaleState, loss: Float[Array, ""]) -> Float[Array, ""]:
    """Loss × S, to differentiate instead of the loss (FP16 paper §3.2 step 1).

    The product is float32: S = 2**16 alone is already inf in FP16. The gradients of the FP16
    activations and weights are then S times larger, out of FP16's underflow region. The no-op scale
    returns the loss untouched.
    """
    if not state.config.dynamic:
        return loss
    return jnp.asarray(loss, jnp.float32) * state.scale


def all_finite(tree: PyTree) -> Bool[Array, ""]:
    """True iff every floating-point leaf of `tree` is free of inf and NaN.

    Under jit with sharded leaves this reduces over all devices (the global synchronisation the FP16
    paper §3.3 mentions), so every replica agrees on whether to skip.
    """
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return functools.reduce(jnp.logical_and, flags, jnp.asarray(True))


def unscale_and_check(state: LossScaleState, grads: PyTree) -> tuple[PyTree, Bool[Array, ""]]:
    """Divide gradients of the scaled loss by S and report whether they are all finite.

    With dynamic scaling, floating leaves come back in at least float32: dividing in FP16 would put
    small gradients straight back into the underflow region the scale lifted them out of. The
    optimizer keeps float32 master weights, so this is the dtype it wants anyway. With the no-op scale
    the gradients are returned as they are. Non-floating leaves pass through unchanged.
    """
    if not state.config.dynamic:
        return grads, all_finite(grads)

    def unscale(g):
        if not jnp.issubdtype(g.dtype, jnp.inexact):
            return g
        dtype = jnp.promote_types(g.dtype, jnp.float32)
        return g.astype(dtype) / state.scale.astype(dtype)

    # Checked after the division: with S < 1 (a config may allow it) a finite scaled gradient can overflow when
    # unscaled, and an inf scaled one stays inf, so this one check covers both.
    unscaled = jax.tree.map(unscale, grads)
    return unscaled, all_finite(unscaled)


def update_scale(state: LossScaleState, finite: Bool[Array, ""]) -> LossScaleState:
    """Next loss-scale state after a step whose gradients were `finite` (or not).

    Non-finite: S /= factor (not below min_scale), good_steps = 0, skipped_steps += 1 — the caller
    skips the update with `select_tree`. Finite: good_steps += 1, and after `period` consecutive finite
    steps S *= factor (not above max_scale) and good_steps restarts, probing whether a larger S — fewer
    underflowed gradients — is now safe. The no-op scale keeps S = 1 but still counts skipped steps.
    """
    cfg = state.config
    finite = jnp.asarray(finite, jnp.bool_)
    skipped = state.skipped_steps + jnp.where(finite, 0, 1).astype(jnp.int32)
    if not cfg.dynamic:
        good = jnp.where(finite, state.good_steps + 1, 0).astype(jnp.int32)
        return dataclasses.replace(state, good_steps=good, skipped_steps=skipped)
    good = state.good_steps + 1
    grow = finite & (good >= cfg.period)
    grown = jnp.minimum(state.scale * cfg.factor, cfg.max_scale)
    shrunk = jnp.maximum(state.scale / cfg.factor, cfg.min_scale)
    scale = jnp.where(finite, jnp.where(grow, grown, state.scale), shrunk).astype(jnp.float32)
    good = jnp.where(finite & ~grow, good, 0).astype(jnp.int32)
    return dataclasses.replace(state, scale=scale, good_steps=good, skipped_steps=skipped)


def select_tree(finite: Bool[Array, ""], new: PyTree, old: PyTree) -> PyTree:
    """`new` where `finite` else `old`, leaf by leaf: how a step with overflowed gradients is skipped.

    Both branches are computed and selected inside jit (no host round trip, no recompile). Use it on
    the parameters *and* the optimizer state so that a skipped step leaves no trace in Adam's moments.
    """
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
