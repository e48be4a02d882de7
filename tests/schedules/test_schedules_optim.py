"""The optimizer factory and host-set hyperparameters: values take effect, and never retrace/recompile."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_mismatch import schedules as S
from jaxrl_mismatch.train.compiles import count_compilations

def _mesh(n_devices: int) -> Mesh:
    devices = np.array(jax.devices()[:n_devices])
    return Mesh(devices.reshape(4, 2) if n_devices == 8 else devices.reshape(1, 1), ("data", "fsdp"))


def _setup(mesh: Mesh, opt: optax.GradientTransformation):
    """Tiny least-squares problem; params sharded over both mesh axes, optimizer scalars replicated."""
    param_sharding, rep = NamedSharding(mesh, P("data", "fsdp")), S.replicated(mesh)
    rng = np.random.default_rng(0)
    params = {"w": jax.device_put(rng.normal(size=(8, 4)).astype(np.float32), param_sharding)}
    batch = jax.device_put(rng.normal(size=(16, 8)).astype(np.float32), NamedSharding(mesh, P("data", None)))
    opt_state = opt.init(params)
    opt_state = jax.tree.map(lambda x: jax.device_put(x, param_sharding if x.ndim == 2 else rep), opt_state)
    traces = {"n": 0}

    def train_step(params, opt_state, batch):
        traces["n"] += 1  # Python side effect: runs once per trace, never on a cached call.

        def loss(p):
            return jnp.mean(jnp.square(batch @ p["w"] - 1.0))

        grads = jax.grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, S.get_lr(opt_state)

    shardings = (jax.tree.map(lambda x: x.sharding, params), jax.tree.map(lambda x: x.sharding, opt_state))
    step = jax.jit(train_step, in_shardings=(*shardings, batch.sharding), out_shardings=(*shardings, rep),
                   donate_argnums=(0, 1))
    return params, opt_state, batch, step, traces, rep


@pytest.mark.parametrize("n_devices", [1, 8])
@pytest.mark.parametrize("mode", ["lr_scale_over_schedule", "learning_rate"])
def test_new_lr_every_step_never_recompiles(n_devices, mode):
    mesh = _mesh(n_devices)
    schedule = S.step_decay_schedule(1e-3, decay_period=7)
    lr0 = schedule if mode == "lr_scale_over_schedule" else 1e-3
    opt = S.make_optimizer("adamw", learning_rate=lr0, max_grad_norm=1.0)
    params, opt_state, batch, step, traces, rep = _setup(mesh, opt)
    values = np.linspace(1.0, 0.05, 24)
    with count_compilations("train_step") as counts:
        for i, value in enumerate(values):
            if mode == "learning_rate":
                opt_state = S.set_learning_rate(opt_state, 1e-3 * value, rep)
                want = 1e-3 * value
            else:
                opt_state = S.set_lr_scale(opt_state, value, rep)
                want = float(schedule(i)) * value
            params, opt_state, lr = step(params, opt_state, batch)
            np.testing.assert_allclose(float(lr), want, rtol=1e-6)
    assert traces["n"] == 1, "a new LR value retraced the update"
    assert counts["compiles"] == 1, "a new LR value recompiled the update"
    hyperparams = optax.tree_utils.tree_get(opt_state, "hyperparams")
    assert all(v.dtype == jnp.float32 and v.sharding.is_fully_replicated for v in hyperparams.values())


def test_counters_do_detect_a_retrace():
    # Proof the counters work: known pitfalls (an LR set as a Python float / unplaced scalar) do retrace.
    mesh = _mesh(8)
    opt = S.make_optimizer("adamw", learning_rate=1e-3)
    params, opt_state, batch, step, traces, rep = _setup(mesh, opt)

    def raw_set(state, value):  # bypasses set_hyperparams' float32 placement
        return optax.tree_utils.tree_set(
            state, lambda path, _: any(getattr(k, "name", None) == "hyperparams" for k in path), lr_scale=value
        )

    with count_compilations("train_step") as counts:
        params, opt_state, _ = step(params, S.set_lr_scale(opt_state, 0.5, rep), batch)
        assert (traces["n"], counts["compiles"]) == (1, 1)
        params, opt_state, _ = step(params, raw_set(opt_state, 0.25), batch)  # Python float: weak-typed
        assert (traces["n"], counts["compiles"]) == (2, 2)
        params, opt_state, _ = step(params, S.set_lr_scale(opt_state, 0.2, rep), batch)  # back: cached
        assert (traces["n"], counts["compiles"]) == (2, 2)
        params, opt_state, _ = step(params, raw_set(opt_state, jnp.float32(0.1)), batch)  # unplaced array
        assert (traces["n"], counts["compiles"]) == (3, 3)


def test_lr_scale_scales_the_whole_update_including_weight_decay():
    params = {"w": jnp.arange(1.0, 7.0).reshape(2, 3)}
    grads = {"w": jnp.full((2, 3), 0.3)}
    opt = S.make_optimizer("adamw", learning_rate=1e-2, weight_decay=0.5, max_grad_norm=None)
    state = opt.init(params)
    full, _ = opt.update(grads, state, params)
    quarter, _ = opt.update(grads, optax.tree_utils.tree_set(state, lr_scale=jnp.float32(0.25)), params)
    np.testing.assert_allclose(quarter["w"], 0.25 * full["w"], rtol=1e-6)
    # Reference: plain optax.adamw with the papers' betas/eps and LR 2.5e-3.
    ref, _ = optax.adamw(2.5e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.5).update(
        grads, optax.adamw(2.5e-3).init(params), params)
    np.testing.assert_allclose(quarter["w"], ref["w"], rtol=1e-5)  # f32 rounding of lr·scale


def test_clipping_and_defaults():
    opt = S.make_optimizer(learning_rate=1.0)  # adamw, clip 1.0, LR-paper/verl AdamW defaults
    state = opt.init({"w": jnp.zeros(3)})
    hyperparams = optax.tree_utils.tree_get(state, "hyperparams")
    want = {"learning_rate": 1.0, "lr_scale": 1.0, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
    assert {k: float(v) for k, v in hyperparams.items()} == {k: float(np.float32(v)) for k, v in want.items()}
    assert all(v.dtype == jnp.float32 for v in hyperparams.values())
    # With bf16 params the hyperparameters still stay float32 (hyperparam_dtype=float32).
    bf16_state = opt.init({"w": jnp.zeros(3, jnp.bfloat16)})
    assert optax.tree_utils.tree_get(bf16_state, "hyperparams")["learning_rate"].dtype == jnp.float32
    sgd = S.make_optimizer("sgd", learning_rate=1.0, max_grad_norm=1.0)
    updates, _ = sgd.update({"w": jnp.array([30.0, 40.0])}, sgd.init({"w": jnp.zeros(2)}))
    np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-6)  # clipped to global norm 1


def test_configured_hyperparameters_carry_a_changed_config_into_a_restored_state():
    """A resume restores the optimizer state of the run that wrote it, hyperparameters included; the Learner sets
    the configured ones again (`configured_hyperparams`), so an accepted `optim.weight_decay` change reaches the
    update. Not lr_scale (the controller's) nor a scheduled LR."""
    params, zero = {"w": jnp.full((3,), 2.0)}, {"w": jnp.zeros(3)}
    saved = S.make_optimizer("adamw", learning_rate=1e-3, weight_decay=0.01, max_grad_norm=None).init(params)
    saved = optax.tree_utils.tree_set(saved, lr_scale=jnp.float32(0.5))  # a controller's decay, kept
    new = S.make_optimizer("adamw", learning_rate=1e-3, weight_decay=0.5, b2=0.95, max_grad_norm=None)
    wanted = S.configured_hyperparams(new.init(params))
    assert wanted == pytest.approx({"learning_rate": 1e-3, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.5})
    restored = S.set_hyperparams(saved, jax.devices()[0], **wanted)
    step, _ = new.update(zero, restored, params)  # zero gradient: the update is the decay alone, −lr·scale·wd·w
    np.testing.assert_allclose(step["w"], -1e-3 * 0.5 * 0.5 * 2.0, rtol=1e-6)
    stale, _ = new.update(zero, saved, params)  # the checkpoint's own hyperparameters: the old decay
    np.testing.assert_allclose(stale["w"], -1e-3 * 0.5 * 0.01 * 2.0, rtol=1e-6)
    assert "learning_rate" not in S.configured_hyperparams(
        S.make_optimizer(learning_rate=S.constant_schedule(1e-3)).init(params))


def test_scheduled_learning_rate_cannot_be_overridden():
    opt = S.make_optimizer(learning_rate=S.constant_schedule(1e-3))
    state = opt.init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match="in-graph schedule.*lr_scale"):
        S.set_learning_rate(state, 1e-4, jax.devices()[0])
    with pytest.raises(KeyError, match=r"no hyperparameter 'momentum'.*available"):
        S.set_hyperparams(state, jax.devices()[0], momentum=0.9)
    with pytest.raises(ValueError, match="lr_scale must be >= 0"):
        S.set_lr_scale(state, float("nan"), jax.devices()[0])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(name="lion", learning_rate=1e-3), ValueError, r"unknown optimizer 'lion'.*\['adam', 'adamw', 'sgd'\]"),
        (dict(name="adamw", learning_rate=1e-3, beta1=0.9), TypeError, r"unknown hyperparameter\(s\) \['beta1'\].*b1"),
        (dict(name="adam", learning_rate=1e-3, weight_decay=0.1), TypeError, "weight_decay"),
        (dict(name="adamw", learning_rate=-1.0), ValueError, "learning_rate"),
        (dict(name="adamw", learning_rate=1e-3, b2=1.0), ValueError, "b2"),
        (dict(name="adamw", learning_rate=1e-3, max_grad_norm=0.0), ValueError, "max_grad_norm"),
    ],
)
def test_make_optimizer_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        S.make_optimizer(**kwargs)
