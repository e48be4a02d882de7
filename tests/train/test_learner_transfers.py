"""What crosses between host and device in a learner step (issue 23 item 2).

- The prepared batch stays on the device: a whole `Learner.step` (prepare, 2 PPO epochs × 2 minibatches ×
  2 microbatches, packing and a KL term on) fetches once, scalars only (the step's metrics), reads no
  array's host value outside that fetch (no per-minibatch sync), and uploads after `prepare` only integer
  arrays (row indices, packed layouts): no prepared (float) field goes back up; every minibatch reaches the
  update as device arrays.
- The step's metrics are those of `prepare` + `optimize` (same θ, same batch), bit for bit.
- The device gather of a minibatch equals the host's `RolloutBatch.rows`, on the batch sharding.
- The multi-host broadcast carries 1- to 4-d arrays as they are (2 real processes, gloo): `to_wire`'s
  flattening of the MoE routing, which ran on one host too, is gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl_mismatch.models.sharding import batch_sharding, make_mesh
from jaxrl_mismatch.train.batch import RolloutBatch
from jaxrl_mismatch.train.config import base_config
from jaxrl_mismatch.train.minibatches import jit_take_rows, place_rows
from jaxrl_mismatch.train.step import place_batch
from tests.train.tiny_policy import synthetic_batch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    from tests.rollout.conftest import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("transfers") / "base", tied=False)


def _learner(base_ckpt, run_dir):
    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    c = base_config()
    c.model.path, c.run_dir = str(base_ckpt), str(run_dir)
    c.rollout.group_size, c.batch.prompts_per_step, c.trainer.chunk_size = 4, 4, 8
    c.batch.minibatches, c.batch.microbatches, c.batch.ppo_epochs = 2, 2, 2
    c.objective.kl_coef = 0.05  # a reference forward in prepare too
    c.trainer.packing = True
    return Learner(learner_config(c))


def _host_batch(seed: int) -> RolloutBatch:
    b = synthetic_batch(batch=16, seq=30, prompt_len=4, seed=seed)
    noise = np.random.default_rng(seed).normal(scale=0.1, size=b["response_mask"].shape).astype(np.float32)
    return RolloutBatch(**b, rollout_logp=(noise - 2.0) * b["response_mask"])


def test_a_step_keeps_its_batch_on_the_device_and_fetches_metrics_once(base_ckpt, tmp_path, monkeypatch):
    """On CPU the transfer guard sees nothing (device memory is host memory), so the crossings are counted
    where they happen: `jax.device_get`, any read of an array's host value (`ArrayImpl._value`: `float`,
    `.tolist()`, `device_get`), and the uploads (`jax.make_array_from_callback`, `jax.device_put`)."""
    from jax._src.array import ArrayImpl

    from jaxrl_mismatch.train import learner as learner_mod

    learner = _learner(base_ckpt, tmp_path / "run")
    fetches, reads, uploads, minibatches = [], [], [], []
    device_get, from_callback, device_put, value = (jax.device_get, jax.make_array_from_callback, jax.device_put,
                                                    ArrayImpl._value)

    def counting_get(x):
        fetches.append([np.shape(leaf) for leaf in jax.tree.leaves(x)])
        in_fetch[0] = True
        try:
            return device_get(x)
        finally:
            in_fetch[0] = False

    def counting_from_callback(shape, sharding, cb, *a, **k):
        out = from_callback(shape, sharding, cb, *a, **k)
        uploads.append((phase[0], out.dtype))
        return out

    def counting_put(x, *a, **k):
        uploads.extend((phase[0], np.asarray(leaf).dtype) for leaf in jax.tree.leaves(x))
        return device_put(x, *a, **k)

    def reading(self):
        reads.append((in_fetch[0], self.shape))
        return value.fget(self)

    phase, in_fetch = ["before prepare"], [False]
    prepare = learner._prepare

    def marking_prepare(*args):
        phase[0] = "after prepare"
        return prepare(*args)

    def spying_jit_update(*args):
        update = jit_update(*args)

        def run(state, mb):
            minibatches.append({type(leaf) for leaf in jax.tree.leaves(mb)})
            return update(state, mb)

        return run

    jit_update = learner_mod.jit_update
    monkeypatch.setattr(learner_mod, "jit_update", spying_jit_update)
    monkeypatch.setattr(jax, "device_get", counting_get)
    monkeypatch.setattr(jax, "make_array_from_callback", counting_from_callback)
    monkeypatch.setattr(jax, "device_put", counting_put)
    monkeypatch.setattr(ArrayImpl, "_value", property(reading))
    learner._prepare = marking_prepare
    for step in range(2):  # the first step compiles, the second runs the compiled programs
        fetches.clear(), reads.clear(), uploads.clear(), minibatches.clear()
        phase[0] = "before prepare"
        with jax.transfer_guard_device_to_host("disallow"):  # effective on accelerators
            metrics = learner.step(_host_batch(step), seed=step, minibatch_seed=step)
        assert len(fetches) == 1 and all(shape == () for shape in fetches[0]), fetches  # the metrics, once
        assert reads and all(r == (True, ()) for r in reads), reads  # no other sync, nothing bigger came back
        assert len(minibatches) == 4 and all(types <= {ArrayImpl} for types in minibatches), minibatches
        after = [dtype for when, dtype in uploads if when == "after prepare"]
        assert after and not any(np.issubdtype(d, np.floating) for d in after), after  # indices, layouts only
        assert any(np.issubdtype(d, np.floating) for when, d in uploads if when == "before prepare")
        assert np.isfinite(metrics["loss/total"]) and np.isfinite(metrics["mismatch/log_ppl_abs_diff"])


def test_step_equals_prepare_then_optimize(base_ckpt, tmp_path):
    """`step` is `prepare` + `optimize` with the fetch moved: the same metrics and policy, bit for bit."""
    a, b = _learner(base_ckpt, tmp_path / "a"), _learner(base_ckpt, tmp_path / "b")
    host = _host_batch(5)
    together = a.step(host, seed=3, minibatch_seed=4)
    prepared, metrics = b.prepare(host, seed=3)
    assert isinstance(prepared.old_logp, jax.Array) and isinstance(prepared.ref_logp, jax.Array)  # on the device
    metrics.update(b.optimize(prepared, seed=4))  # the tokens for packing fetched from the device batch
    assert together.keys() == metrics.keys()
    for k in together:
        assert together[k] == metrics[k] or (np.isnan(together[k]) and np.isnan(metrics[k])), k
    for x, y in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert together["grad/norm"] > 0


def test_a_batch_of_another_size_is_refused_before_any_update(base_ckpt, tmp_path):
    """A step is 2 minibatches of 8 rows: 20 rows would train on 16 of them, 12 on a short last minibatch.
    Both are refused, by `step` and by `optimize`, and θ is untouched."""
    learner = _learner(base_ckpt, tmp_path / "run")
    before = [np.asarray(x) for x in jax.tree.leaves(learner.state.params)]
    for rows in (20, 12):
        b = synthetic_batch(batch=rows, seq=30, prompt_len=4, seed=0)
        host = RolloutBatch(**b, rollout_logp=-2.0 * b["response_mask"])
        with pytest.raises(ValueError, match=f"the batch has {rows} rows, but a step takes 16 "
                                             r"\(2 minibatches of 8 rows"):
            learner.step(host, seed=0, minibatch_seed=0)
        with pytest.raises(ValueError, match=f"the batch has {rows} rows"):
            learner.optimize(host, seed=0)
    for x, y in zip(before, jax.tree.leaves(learner.state.params)):
        np.testing.assert_array_equal(x, np.asarray(y))
    assert np.isfinite(learner.step(_host_batch(0), seed=0, minibatch_seed=0)["loss/total"])  # 16 rows train


def test_device_minibatch_equals_host_rows():
    mesh = make_mesh({"data": 4, "fsdp": 2}, devices=jax.devices()[:8])
    b = synthetic_batch(batch=16, seq=12, prompt_len=4, seed=1)
    rng = np.random.default_rng(0)
    host = RolloutBatch(**b, rollout_logp=rng.normal(size=b["response_mask"].shape).astype(np.float32),
                        replay_routing=rng.integers(0, 8, (16, 12, 3, 2)).astype(np.int32),
                        version_lag=rng.integers(0, 3, 16).astype(np.int32))
    rows = rng.permutation(16)[:8]
    got = jit_take_rows(mesh)(place_batch(host, mesh), place_rows(rows, mesh))
    want = host.rows(rows)
    for name, x in got.arrays().items():
        np.testing.assert_array_equal(np.asarray(x), want.arrays()[name], err_msg=name)
        assert x.sharding.is_equivalent_to(batch_sharding(mesh, x.ndim), x.ndim), name
    with pytest.raises(ValueError, match="packed layout"):
        from jaxrl_mismatch.train.packing import pack_batch

        jit_take_rows(mesh)(place_batch(pack_batch(host, num_groups=1), mesh), place_rows(rows, mesh))


_BROADCAST = textwrap.dedent("""
    import sys
    import numpy as np
    from jaxrl_mismatch.train import distributed

    distributed.initialize("always")
    import jax

    lead = jax.process_index() == 0
    rng = np.random.default_rng(0)  # the same draws on both; only the lead's reach the output
    want = {"tokens": rng.integers(0, 9, (6, 5)).astype(np.int32),
            "routing": rng.integers(0, 9, (6, 5, 3, 2)).astype(np.int32),
            "sample_version": rng.integers(0, 9, 6).astype(np.int32),
            "rollout_logp": rng.normal(size=(6, 4)).astype(np.float32)}
    arrays, stats = distributed.lead_computes(lead, lambda: (want, {"a": 1.5}), tuple(want), ("a",))
    assert stats == {"a": 1.5}, stats
    for k, v in want.items():
        assert arrays[k].dtype == v.dtype and arrays[k].shape == v.shape, (k, arrays[k].shape)
        np.testing.assert_array_equal(arrays[k], v)

    import time

    def build():  # the lead's build is finished before any other process starts its own
        if lead:
            time.sleep(1.0)
            open(sys.argv[1], "w").write("built")
        else:
            assert open(sys.argv[1]).read() == "built"
        return jax.process_index()

    assert distributed.lead_first(lead, build) == jax.process_index()

    def broken():
        assert lead, "ran on a process other than the lead after the lead failed"
        raise ValueError("the lead's build failed")

    try:
        distributed.lead_first(lead, broken)
        raise AssertionError("lead_first returned after the lead failed")
    except (ValueError if lead else distributed.LeadFailure):
        pass
    # An array the broadcast cannot carry (float64) fails on the lead after its fn returned: the check raised on
    # process 0 only, and the others waited in the header's broadcast until process 0 exited.
    try:
        distributed.lead_computes(lead, lambda: ({"x": np.zeros((2, 3))}, {}), ("x",), ())
        raise AssertionError("lead_computes returned a float64 array")
    except (ValueError if lead else distributed.LeadFailure):
        pass
    # on_lead: every process gets the lead's scalars as the same floats (0.1 is float32's on all of them; the lead
    # kept its float64 and a controller could decide otherwise at a threshold), a NaN the lead returned stays a
    # NaN elsewhere (it was dropped there), and a key it did not return is absent everywhere.
    got = distributed.on_lead(lead, lambda: {"a": 0.1, "b": float("nan")}, ("a", "b", "c"))
    assert sorted(got) == ["a", "b"] and got["a"] == float(np.float32(0.1)) and np.isnan(got["b"]), got
    # A stop that reached one process only is every process's stop (Trainer.run's loop), and no stop is none.
    assert distributed.any_process(not lead) and distributed.any_process(lead)
    assert not distributed.any_process(False)
    print("ok", jax.process_index(), flush=True)
""")


@pytest.mark.slow
def test_broadcast_carries_nd_arrays_across_processes_and_the_lead_goes_first(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "broadcast.py"
    script.write_text(_BROADCAST)
    procs = []
    for i in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
                   PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path / "built")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"ok {i}" in out, out[-3000:]
