"""The sharded pure update step: mesh/microbatch invariance, no recompiles on LR change, FP16 skip, learning."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_mismatch.schedules import get_lr, set_lr_scale
from jaxrl_mismatch.train.compiles import count_compilations
from jaxrl_mismatch.train.step import jit_update, place_batch
from tests.train.tiny_policy import VOCAB, build, full_batch, synthetic_batch


_RUNS: dict = {}


def _run(mesh_axes, devices, steps=2, num_microbatches=1, remat=False):
    """`steps` updates of the tiny policy on the synthetic batch: (params, per-step metrics, final state).

    Memoised for the file: a run is a pure function of its arguments (same seed, same batch, same program), and
    four tests compare against the same 1-device whole-batch run, so each distinct run is compiled and run once.
    The callers only read what it returns."""
    key = (tuple(sorted(mesh_axes.items())), tuple(d.id for d in devices), steps, num_microbatches, remat)
    if key not in _RUNS:
        _RUNS[key] = _compute_run(mesh_axes, devices, steps, num_microbatches, remat)
    return _RUNS[key]


def _compute_run(mesh_axes, devices, steps, num_microbatches, remat):
    mesh, _, state, update_fn, old_lp, _ = build(mesh_axes, devices, num_microbatches=num_microbatches, remat=remat)
    batch = full_batch(mesh, old_lp, state.params, synthetic_batch())
    update = jit_update(update_fn, state, batch, mesh)
    history = []
    for _ in range(steps):
        state, metrics = update(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})  # "kind:name" statistics of the update
    params = jax.tree_util.tree_map(np.asarray, state.params)
    return params, history, state


def _max_diff(a, b):
    return max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


@pytest.mark.slow
def test_eight_device_fsdp_data_equals_one_device():
    p1, h1, _ = _run({"data": 1}, jax.devices()[:1])
    p8, h8, s8 = _run({"data": 2, "fsdp": 4}, jax.devices()[:8])
    assert _max_diff(p1, p8) <= 1e-5
    for m1, m8 in zip(h1, h8):
        for k in m1:
            assert m8[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-5), k
    # The state really is sharded: an FSDP-sharded kernel has 1/4 of its rows per device.
    kernel = s8.params["layers"][0]["mlp"]["gate_proj"]["kernel"][...]
    assert kernel.sharding.spec[0] == "fsdp"
    assert kernel.addressable_shards[0].data.shape[0] == kernel.shape[0] // 4


@pytest.mark.slow
def test_microbatched_equals_whole_batch():
    p_whole, h_whole, _ = _run({"data": 1}, jax.devices()[:1], num_microbatches=1)
    p_micro, h_micro, _ = _run({"data": 1}, jax.devices()[:1], num_microbatches=4)
    # Adam divides by sqrt(v): float-rounding differences of summation order show up at ~1e-6.
    assert _max_diff(p_whole, p_micro) <= 1e-5
    for a, b in zip(h_whole, h_micro):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-5), k


def test_remat_update_equals_plain_update():
    p_plain, h_plain, _ = _run({"data": 1}, jax.devices()[:1])
    p_remat, h_remat, _ = _run({"data": 1}, jax.devices()[:1], remat=True)
    # Recomputation reorders float ops; Adam's 1/sqrt(v) lifts that rounding to ~1e-6 (as for microbatching).
    assert _max_diff(p_plain, p_remat) <= 1e-5
    assert h_remat[-1]["mean:loss/total"] == pytest.approx(h_plain[-1]["mean:loss/total"], abs=1e-6)


def test_new_lr_every_step_never_recompiles():
    mesh, _, state, update_fn, old_lp, _ = build({"data": 2, "fsdp": 4}, jax.devices()[:8])
    batch = full_batch(mesh, old_lp, state.params, synthetic_batch())
    update = jit_update(update_fn, state, batch, mesh)
    seen = []
    with count_compilations("update") as counts:
        for i in range(22):
            scale = 1.0 / (1 + i)
            state = state.replace(opt_state=set_lr_scale(state.opt_state, scale, mesh))
            state, metrics = update(state, batch)
            seen.append(float(get_lr(state.opt_state)))
    assert counts["compiles"] == 1
    assert seen == pytest.approx([1e-2 / (1 + i) for i in range(22)], rel=1e-6)
    assert np.isfinite(float(metrics["mean:grad/norm"]))


def test_fp16_loss_scaling_skips_overflow_and_keeps_params_finite():
    mesh, _, state, update_fn, old_lp, _ = build({"data": 1}, jax.devices()[:1], policy_name="fp16")
    assert float(state.loss_scale.scale) > 1.0  # dynamic scaling is on for fp16 compute
    good = full_batch(mesh, old_lp, state.params, synthetic_batch())
    update = jit_update(update_fn, state, good, mesh)
    state, m = update(state, good)
    assert m["mean:grad/finite"] == 1.0 and int(state.step) == 1
    # Inject an overflow: an advantage of 1e38 makes the scaled fp16 backward overflow to inf.
    bad = place_batch(good.replace(advantages=np.asarray(good.advantages) * np.float32(1e38)), mesh)
    before = jax.tree_util.tree_map(np.asarray, state.params)
    scale_before = float(state.loss_scale.scale)
    state, m = update(state, bad)
    assert m["mean:grad/finite"] == 0.0
    assert int(state.step) == 1 and float(state.loss_scale.skipped_steps) == 1
    assert float(state.loss_scale.scale) == scale_before / 2
    assert _max_diff(before, jax.tree_util.tree_map(np.asarray, state.params)) == 0.0
    state, m = update(state, good)
    assert m["mean:grad/finite"] == 1.0 and int(state.step) == 2
    assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.asarray, state.params)))


def test_step_learns_a_bandit():
    """RL on a 1-token bandit: reward 1 for tokens in a target set; expected reward must rise well above chance.

    Responses are sampled from the policy itself, advantages are GRPO group-normalised rewards, and the
    update is the real jitted step: this is the whole on-policy loop in miniature.
    """
    from jaxrl_mismatch.objectives import grpo_advantages

    mesh, _, state, update_fn, old_lp, _ = build({"data": 1}, jax.devices()[:1], lr=3e-2)
    prompt = np.array([1, 5, 9, 2], np.int32)
    targets = np.arange(8, 16)  # 8 of 64 tokens: chance ~ 1/8
    batch_n = 32
    rng = np.random.default_rng(0)
    update = None

    def expected_reward(params):
        # log π(token | prompt) for every token, via teacher forcing on each candidate.
        cand = np.concatenate([np.tile(prompt, (VOCAB, 1)), np.arange(VOCAB)[:, None]], 1).astype(np.int32)
        lp, _ = old_lp(params, jnp.asarray(cand), jnp.ones_like(cand))
        probs = np.exp(np.asarray(lp)[:, -1])
        return float(probs[targets].sum()), probs / probs.sum()

    r0, probs = expected_reward(state.params)
    for _ in range(25):
        _, probs = expected_reward(state.params)
        actions = rng.choice(VOCAB, size=batch_n, p=probs)
        rewards = np.isin(actions, targets).astype(np.float32)
        adv = np.asarray(grpo_advantages(jnp.asarray(rewards), jnp.zeros(batch_n, jnp.int32), 1))
        tokens = np.concatenate([np.tile(prompt, (batch_n, 1)), actions[:, None]], 1).astype(np.int32)
        resp = np.zeros((batch_n, tokens.shape[1] - 1), np.float32)
        resp[:, -1] = 1.0
        np_batch = {"tokens": tokens, "attention_mask": np.ones_like(tokens), "response_mask": resp,
                    "advantages": resp * adv[:, None]}
        b = full_batch(mesh, old_lp, state.params, np_batch, rollout_noise=0.0)
        if update is None:
            update = jit_update(update_fn, state, b, mesh)
        state, _ = update(state, b)
    r1, _ = expected_reward(state.params)
    assert r0 < 0.3
    assert r1 > r0 + 0.3, (r0, r1)


def test_gradient_noise_estimates_are_unbiased_on_known_gradients():
    """Per-row gradients g_i = G + ε_i, ε ~ N(0, σ² I_d): the estimators recover |G|² and tr Σ = d σ²."""
    from jaxrl_mismatch.train.step import gradient_noise

    rng = np.random.default_rng(0)
    d, rows, micro, sigma = 50, 64, 8, 0.5
    true_g = rng.normal(size=d)
    traces, signals = [], []
    for _ in range(400):
        per_row = true_g + sigma * rng.normal(size=(rows, d))
        g_m = per_row.reshape(micro, rows // micro, d).sum(1) / rows  # each microbatch's share of the mean
        out = gradient_noise(jnp.float32(np.sum(np.square(g_m))), jnp.float32(np.linalg.norm(g_m.sum(0))), micro, rows)
        traces.append(float(out["grad/noise_trace"]))
        signals.append(float(out["grad/signal_sq"]))
    assert np.mean(traces) == pytest.approx(d * sigma**2, rel=0.05)
    assert np.mean(signals) == pytest.approx(float(true_g @ true_g), rel=0.05)


def test_update_logs_gradient_noise_with_microbatches():
    # The first step of the 2-step runs the other tests made (memoised: the same program on the same batch).
    _, h, _ = _run({"data": 1}, jax.devices()[:1], num_microbatches=4)
    assert np.isfinite(h[0]["mean:grad/noise_trace"]) and h[0]["mean:grad/noise_trace"] != 0.0
    _, h1, _ = _run({"data": 1}, jax.devices()[:1], num_microbatches=1)
    assert "mean:grad/noise_trace" not in h1[0]  # needs >= 2 microbatches


@pytest.mark.slow
def test_microbatches_are_spread_over_every_batch_shard():
    """The microbatch split kept the batch's contiguous row blocks on their devices, so each microbatch sat on a
    few devices and XLA gathered it inside the scan: every device computed every microbatch, and per-device
    memory did not fall with more microbatches. Now each microbatch spans all the batch shards."""
    from jaxrl_mismatch.metrics import metrics_config
    from jaxrl_mismatch.objectives import objective_config
    from jaxrl_mismatch.train.objective import PolicyLoss
    from jaxrl_mismatch.train.step import make_update_fn

    p1, h1, _ = _run({"data": 1}, jax.devices()[:1])
    p4, h4, _ = _run({"data": 4}, jax.devices()[:4], num_microbatches=2)
    assert _max_diff(p1, p4) <= 1e-5
    for a, b in zip(h1, h4):
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), k
    mesh, graphdef, state, _, old_lp, opt = build({"data": 4}, jax.devices()[:4])
    batch = full_batch(mesh, old_lp, state.params, synthetic_batch())
    fn = make_update_fn(graphdef, opt, PolicyLoss(cfg=objective_config("grpo"), metrics_cfg=metrics_config(
        objective_config("grpo"))), num_microbatches=2, chunk_size=8, mesh=mesh)
    hlo = jit_update(fn, state, batch, mesh).lower(state, batch).compile().as_text()
    # data parallel only (weights replicated): nothing needs gathering; before, each microbatch's rows were
    assert len(re.findall(r"all-gather(-start)?\(", hlo)) == 0


def test_prepare_scores_in_row_blocks_with_the_same_result_and_a_blocks_memory():
    """`prepare`'s θ_old forward ran the whole step batch at once: its peak grew with the step's rows while the
    microbatched update's stayed flat (a 1,024-row config step needed ~74 GiB per device). With `row_blocks` it
    scores the rows block by block: the same log-probs, the memory of one block."""
    from flax import nnx

    from jaxrl_mismatch import precision
    from jaxrl_mismatch.metrics import metrics_config
    from jaxrl_mismatch.models import Transformer
    from jaxrl_mismatch.models.sharding import make_mesh
    from jaxrl_mismatch.objectives import objective_config
    from jaxrl_mismatch.train.batch import RolloutBatch
    from jaxrl_mismatch.train.objective import PolicyLoss
    from jaxrl_mismatch.train.state import split_model
    from jaxrl_mismatch.train.step import jit_prepare, make_prepare_fn
    from tests.train.tiny_policy import tiny_config

    obj = PolicyLoss(cfg=objective_config("grpo"), metrics_cfg=metrics_config(objective_config("grpo")))
    mesh = make_mesh({"data": 2}, devices=jax.devices()[:2])
    graphdef, params = split_model(Transformer(tiny_config(vocab_size=4096, max_position_embeddings=128),
                                               precision.policy("fp32", param_dtype="float32"), rngs=nnx.Rngs(0)))
    np_batch = synthetic_batch(batch=32, seq=96)
    np_batch["tokens"] = np_batch["tokens"] % 4096
    batch = place_batch(RolloutBatch(**np_batch, rollout_logp=np.zeros_like(np_batch["response_mask"])), mesh)
    key = jax.random.key_data(jax.random.key(0))
    out, temp = {}, {}
    for blocks in (1, 4):
        prep = jit_prepare(make_prepare_fn(graphdef, obj, chunk_size=32, row_blocks=blocks, mesh=mesh), mesh)
        temp[blocks] = prep.lower(params, None, batch, key).compile().memory_analysis().temp_size_in_bytes
        out[blocks] = np.asarray(prep(params, None, batch, key)[0].old_logp)
    np.testing.assert_allclose(out[4], out[1], rtol=0, atol=2e-6)
    assert temp[4] < 0.5 * temp[1], temp
