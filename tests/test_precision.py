"""Precision presets and FP16 dynamic loss scaling (issue 2: overflow step skipped, scale halves/grows)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_mismatch import precision as prec

# ---------------------------------------------------------------------------------------- presets


@pytest.mark.parametrize(
    "name, dtype",
    [("fp32", jnp.float32), ("bf16", jnp.bfloat16), ("fp16", jnp.float16)],
)
def test_presets(name, dtype):
    pol = prec.policy(name)
    assert (pol.param_dtype, pol.compute_dtype, pol.logits_dtype) == (dtype, dtype, dtype)
    assert pol.name == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[name]
    head = prec.policy(name, fp32_lm_head=True)
    assert head.compute_dtype == dtype and head.logits_dtype == jnp.float32
    master = prec.policy(name, param_dtype="float32")
    assert master.param_dtype == jnp.float32 and master.compute_dtype == dtype


def test_unknown_preset_names_valid_ones():
    with pytest.raises(ValueError, match=r"unknown precision preset 'fp8'.*fp32, bf16, fp16"):
        prec.policy("fp8")


def test_loss_scale_for_policy():
    assert prec.loss_scale_for(prec.policy("fp16")).config.dynamic
    assert prec.loss_scale_for(prec.policy("bf16", param_dtype="float16")).config.dynamic
    for name in ("fp32", "bf16"):
        state = prec.loss_scale_for(prec.policy(name))
        assert not state.config.dynamic and float(state.scale) == 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"period": 0}, "period"),
        ({"factor": 1.0}, "factor"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"init_scale": 0.5, "min_scale": 1.0}, "init_scale"),
        ({"factor": float("nan")}, "factor"),  # passed `factor <= 1`, then made S NaN at the first growth
        ({"max_scale": float("inf")}, "max_scale"),  # S grew to inf, then every step was skipped for good
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prec.LossScaleConfig(**kwargs)


# ----------------------------------------------------------------------------------- loss scaling


def _loss(params, x, y):
    """Tiny linear regression computed in FP16, loss reduced in float32."""
    pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16) + params["b"].astype(jnp.float16)[None, :]
    return jnp.mean(jnp.square(pred.astype(jnp.float32) - y))


def _make_step(opt):
    """The train-step shape the trainer uses: scale, grad, unscale+check, update, select, update scale."""

    @jax.jit
    def step(params, opt_state, ls, x, y, poison):
        def scaled(p):
            # `poison` multiplies the loss by inf, so every gradient is inf/NaN: an injected overflow.
            loss = _loss(p, x, y) * jnp.where(poison, jnp.float32(jnp.inf), jnp.float32(1.0))
            return prec.scale_loss(ls, loss)

        grads = jax.grad(scaled)(params)
        grads, finite = prec.unscale_and_check(ls, grads)
        updates, new_opt_state = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params = prec.select_tree(finite, new_params, params)
        opt_state = prec.select_tree(finite, new_opt_state, opt_state)
        return params, opt_state, prec.update_scale(ls, finite), finite

    return step


def _setup(seed=0):
    kx, kw, ky = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (8, 4), jnp.float32)
    params = {"w": 0.1 * jax.random.normal(kw, (4, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}
    y = jax.random.normal(ky, (8, 3), jnp.float32)
    return params, x, y


def test_a_gradient_that_overflows_only_when_unscaled_is_not_finite():
    """With S < 1 (the config allows min_scale < 1) a finite scaled gradient can be inf once divided by S; the
    check ran on the scaled one and let it through (the clip then made the params NaN)."""
    ls = prec.dynamic_loss_scale(init_scale=2.0**-4, min_scale=2.0**-10)
    grads, finite = prec.unscale_and_check(ls, {"w": jnp.array([3e37], jnp.float32)})
    assert not bool(finite) and not np.isfinite(np.asarray(grads["w"])).all()
    _, finite = prec.unscale_and_check(ls, {"w": jnp.array([3e30], jnp.float32)})
    assert bool(finite)


def test_overflow_step_is_skipped_and_scale_halves():
    params, x, y = _setup()
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)
    step = _make_step(opt)
    ls = prec.dynamic_loss_scale(init_scale=2.0**10, period=100)

    params, opt_state, ls, finite = step(params, opt_state, ls, x, y, False)
    assert bool(finite) and int(ls.good_steps) == 1 and float(ls.scale) == 2.0**10

    before_params, before_opt = params, opt_state
    params, opt_state, ls, finite = step(params, opt_state, ls, x, y, True)
    assert not bool(finite)
    jax.tree.map(np.testing.assert_array_equal, params, before_params)
    jax.tree.map(np.testing.assert_array_equal, opt_state, before_opt)  # Adam moments and count too
    assert float(ls.scale) == 2.0**9
    assert int(ls.good_steps) == 0
    assert int(ls.skipped_steps) == 1

    # A finite step after the skip updates again.
    params, opt_state, ls, finite = step(params, opt_state, ls, x, y, False)
    assert bool(finite) and not np.array_equal(params["w"], before_params["w"])
    assert int(ls.skipped_steps) == 1 and int(ls.good_steps) == 1


def test_scale_grows_after_period_finite_steps():
    ls = prec.dynamic_loss_scale(init_scale=8.0, period=3)
    update = jax.jit(prec.update_scale)
    scales = []
    for _ in range(7):
        ls = update(ls, jnp.asarray(True))
        scales.append(float(ls.scale))
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]
    assert int(ls.good_steps) == 1 and int(ls.skipped_steps) == 0
    # An overflow in the middle of a run restarts the count.
    ls = update(ls, jnp.asarray(False))
    ls = update(ls, jnp.asarray(True))
    ls = update(ls, jnp.asarray(True))
    assert float(ls.scale) == 16.0 and int(ls.good_steps) == 2


def test_scale_never_below_min_nor_above_max():
    ls = prec.dynamic_loss_scale(init_scale=4.0, min_scale=1.0, max_scale=8.0, period=1)
    update = jax.jit(prec.update_scale)
    seen = []
    for _ in range(5):
        ls = update(ls, jnp.asarray(False))
        seen.append(float(ls.scale))
    assert seen == [2.0, 1.0, 1.0, 1.0, 1.0]
    assert int(ls.skipped_steps) == 5
    for _ in range(6):
        ls = update(ls, jnp.asarray(True))
    assert float(ls.scale) == 8.0


def test_unscaled_grads_equal_unscaled_reference():
    params, x, y = _setup(1)
    ls = prec.dynamic_loss_scale(init_scale=2.0**12)

    @jax.jit
    def scaled_grads(params, ls):
        grads = jax.grad(lambda p: prec.scale_loss(ls, _loss(p, x, y)))(params)
        return prec.unscale_and_check(ls, grads)

    # The reference has no scale; float32 inputs keep its FP16 gradients well inside FP16's range.
    reference = jax.jit(jax.grad(lambda p: _loss(p, x, y)))(params)
    grads, finite = scaled_grads(params, ls)
    assert bool(finite)
    for name in ("w", "b"):
        assert grads[name].dtype == jnp.float32
        np.testing.assert_allclose(grads[name], reference[name], rtol=2e-3, atol=1e-6)
        assert np.abs(grads[name]).max() > 1e-3  # the comparison is not between two zero arrays


def test_scaling_rescues_fp16_underflow():
    """Why FP16 needs the scale (FP16 paper §3.2): a gradient of 1e-8 is zero in FP16 unless scaled."""
    w = jnp.full((16,), 0.5, jnp.float16)

    def loss(w):
        return jnp.sum(w * w).astype(jnp.float32) * 1e-8  # true gradient: 1e-8 per element

    unscaled = jax.grad(loss)(w)
    assert not np.any(np.asarray(unscaled, np.float32))  # underflowed to exactly 0

    ls = prec.dynamic_loss_scale(init_scale=2.0**15)
    grads, finite = jax.jit(
        lambda w, ls: prec.unscale_and_check(ls, jax.grad(lambda w: prec.scale_loss(ls, loss(w)))(w))
    )(w, ls)
    assert bool(finite) and grads.dtype == jnp.float32
    np.testing.assert_allclose(grads, np.full((16,), 1e-8), rtol=2e-3)


def test_no_op_scale_single_code_path():
    params, x, y = _setup(2)
    opt = optax.sgd(0.1)
    step = _make_step(opt)
    ls = prec.no_op_loss_scale()
    loss = jnp.asarray(1.5, jnp.bfloat16)
    assert prec.scale_loss(ls, loss) is loss
    grads = {"w": jnp.ones((2,), jnp.bfloat16)}
    out, finite = prec.unscale_and_check(ls, grads)
    assert out["w"].dtype == jnp.bfloat16 and bool(finite)

    new_params, _, ls, _ = step(params, opt.init(params), ls, x, y, False)
    reference = jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(_loss)(params, x, y))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), new_params, reference)
    same, _, ls, finite = step(params, opt.init(params), ls, x, y, True)
    assert not bool(finite)
    jax.tree.map(np.testing.assert_array_equal, same, params)
    assert float(ls.scale) == 1.0 and int(ls.skipped_steps) == 1


def test_create_spellings():
    assert prec.LossScaleState.create().config == prec.LossScaleConfig()
    assert not prec.LossScaleState.create(dynamic=False).config.dynamic
    cfg = prec.LossScaleConfig(period=5)
    assert prec.LossScaleState.create(cfg).config is cfg
    with pytest.raises(TypeError, match="not both"):
        prec.LossScaleState.create(cfg, period=3)


def test_state_is_a_plain_pytree():
    ls = prec.dynamic_loss_scale(period=7)
    leaves, treedef = jax.tree.flatten(ls)
    assert len(leaves) == 3
    assert [x.dtype for x in leaves] == [jnp.float32, jnp.int32, jnp.int32]
    back = jax.tree.unflatten(treedef, [np.float32(4.0), np.int32(1), np.int32(2)])
    assert back.config == ls.config and float(back.scale) == 4.0
    # A new scale value is data, not a static argument: one trace for both.
    traces = []

    @jax.jit
    def f(ls):
        traces.append(None)
        return prec.update_scale(ls, jnp.asarray(True))

    f(ls)
    f(dataclasses.replace(ls, scale=jnp.asarray(2.0, jnp.float32)))
    assert len(traces) == 1


def test_loss_scaling_on_8_device_mesh():
    """State replicated, params and grads sharded over 8 devices; an inf on one shard skips globally."""
    assert len(jax.devices()) == 8
    mesh = Mesh(np.asarray(jax.devices()), ("fsdp",))
    rep = NamedSharding(mesh, P())
    row = NamedSharding(mesh, P("fsdp", None))
    params = {"w": jax.device_put(jnp.ones((8, 4), jnp.float32), row)}
    ls = jax.device_put(prec.dynamic_loss_scale(init_scale=2.0**8, period=2), rep)
    assert ls.scale.sharding == rep

    def step(params, ls, poison_row):
        def scaled(p):
            # The loss sees an inf only through row `poison_row`, i.e. on one device's shard.
            weight = jnp.where(jnp.arange(8)[:, None] == poison_row, jnp.inf, 1.0)
            return prec.scale_loss(ls, jnp.sum(jnp.square(p["w"]) * weight) * 1e-3)

        grads, finite = prec.unscale_and_check(ls, jax.grad(scaled)(params))
        new = jax.tree.map(lambda p, g: p - g, params, grads)
        return prec.select_tree(finite, new, params), prec.update_scale(ls, finite), finite, grads

    shardings = ({"w": row}, rep, rep)
    jstep = jax.jit(step, in_shardings=shardings, out_shardings=(*shardings[:2], rep, {"w": row}))
    poison = jax.device_put(jnp.asarray(8, jnp.int32), rep)  # out of range: no inf anywhere
    new_params, ls, finite, grads = jstep(params, ls, poison)
    assert bool(finite)
    np.testing.assert_allclose(grads["w"], 2e-3 * np.ones((8, 4)), rtol=1e-6)
    assert new_params["w"].sharding.spec == P("fsdp", None) and ls.scale.sharding == rep

    new_params2, ls, finite, _ = jstep(new_params, ls, jax.device_put(jnp.asarray(5, jnp.int32), rep))
    assert not bool(finite)
    jax.tree.map(np.testing.assert_array_equal, new_params2, new_params)
    assert float(ls.scale) == 2.0**7 and int(ls.skipped_steps) == 1 and int(ls.good_steps) == 0


def test_a_bad_param_dtype_is_named_and_an_fp32_lm_head_component_reaches_the_logits():
    """`policy("bf16", param_dtype="fp16")` was a bare KeyError; a DTypePolicy built with "lm_head" among its float32
    components kept a bf16 logits dtype, which is what the LM head computes in."""
    with pytest.raises(ValueError, match=r"unknown param_dtype 'fp16'; valid: float32, bfloat16, float16"):
        prec.policy("bf16", param_dtype="fp16")
    pol = prec.DTypePolicy(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16, logits_dtype=jnp.bfloat16,
                           fp32_components={"lm_head"})
    assert pol.dtype_of("lm_head") == jnp.float32 and pol.dtype_of("mlp") == jnp.bfloat16
