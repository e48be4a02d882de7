"""Resume: a run stopped after 3 steps and resumed from its checkpoint continues exactly as if never stopped.

A "run" here has every piece of state a real one carries across a restart: the train state (params,
AdamW moments, injected LR hyperparameters, loss scale, step, rng), a `LengthTriggeredDecay` controller
whose state evolves (it sees a response-length surge and starts halving the LR, so a lost controller
state would change the LR after the restart), and the data position (batches are derived from the step
index, so a lost position would replay the wrong data). All three go through `train.checkpoint`:
the state as orbax arrays, controller + position as the JSON meta.

Same mesh → bitwise: on CPU with the same mesh, the resumed process compiles the same program and
reads back the exact bytes, so metrics and params must be identical, not merely close. Another mesh →
the checkpoint restores exactly but the continued steps reduce in another order, so they agree to
float32 rounding only (as in test_update_step's mesh-invariance test).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import Transformer
from jaxrl_mismatch.models.sharding import make_mesh
from jaxrl_mismatch.schedules import LengthTriggeredDecay, get_lr, make_optimizer, set_lr_scale
from jaxrl_mismatch.train.checkpoint import Checkpointer, CheckpointMismatchError
from jaxrl_mismatch.train.state import abstract_state_of, init_state, split_model
from jaxrl_mismatch.train.step import jit_update, place_state
from tests.train.tiny_policy import build, full_batch, synthetic_batch, tiny_config

# orbax may report a tensorstore callback landing on an already-closed asyncio loop as an unraisable
# exception in whichever test is running; it never affects a result (see test_checkpoint.py).
pytestmark = pytest.mark.filterwarnings("ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")

LR = 1e-2
N_STEPS = 6
SAVE_AT = 3  # steps taken before the checkpoint; the resumed process runs steps 4..6
# Mean response length per step: a 4x surge from step 1 on. With baseline_window=1 and window=3 the
# controller's 3-step average reaches 3x the baseline at step 2 (onset: step 1), so decay_period =
# round(1.8 * 1) = 2 and the LR halves at steps 2 and 4: scales 1, 1, 0.5, 0.5, 0.25, 0.25.
LENGTH_TRACE = (100.0, 400.0, 410.0, 395.0, 420.0, 405.0)
EXPECTED_SCALES = (1.0, 1.0, 0.5, 0.5, 0.25, 0.25)
ONE_DEVICE = ({"data": 1}, slice(0, 1))
DATA2_FSDP4 = ({"data": 2, "fsdp": 4}, slice(0, 8))


def _host(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x).copy(), tree)


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _assert_bitwise(got, want, what):
    for (path, a), b in zip(_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), f"{what}{jax.tree_util.keystr(path)}"


def _max_abs_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                             jax.tree_util.tree_leaves(b), strict=True))


class _Run:
    """One training process: tiny policy state + jitted update, LR controller, and data position.

    `seed` only sets the freshly initialised weights; a resumed process uses a different seed than the
    original so that anything `restore` fails to overwrite shows up as a difference.
    """

    def __init__(self, mesh_layout, *, seed: int = 0):
        axes, devices = mesh_layout
        self.mesh, _, self.state, update_fn, self.old_logprobs, _ = build(
            axes, jax.devices()[devices], lr=LR, seed=seed)
        self.update = jit_update(update_fn, self.state, self._batch(0), self.mesh)
        self.controller = LengthTriggeredDecay(baseline_window=1, window=3)
        self.position = 0  # index of the next batch (the data-iterator position)

    def _batch(self, position: int):
        # On-policy: old_logp is a forward at the current params, the rollout noise is seeded by position.
        return full_batch(self.mesh, self.old_logprobs, self.state.params, synthetic_batch(seed=position),
                          seed=1000 + position)

    def step(self) -> dict[str, np.ndarray]:
        batch = self._batch(self.position)
        scale = self.controller.update(self.position, {self.controller.metric: LENGTH_TRACE[self.position]})
        self.state = self.state.replace(opt_state=set_lr_scale(self.state.opt_state, scale, self.mesh))
        self.state, metrics = self.update(self.state, batch)
        self.position += 1
        return {**_host(metrics), "lr": np.asarray(get_lr(self.state.opt_state)).copy()}

    def save(self, ckpt: Checkpointer) -> None:
        meta = {"controller": self.controller.state_dict(), "step": int(self.state.step),
                "data": {"position": self.position}}
        assert ckpt.save(self.position, self.state, meta)

    def restore(self, ckpt: Checkpointer) -> dict:
        self.state, meta = ckpt.restore(abstract_state=abstract_state_of(self.state))
        self.controller.load_state_dict(meta["controller"])
        self.position = meta["data"]["position"]
        return meta


@pytest.fixture(scope="module")
def uninterrupted():
    """(metrics per step, final state on the host) of a 6-step run that is never stopped."""
    run = _Run(ONE_DEVICE)
    history = [run.step() for _ in range(N_STEPS)]
    return history, _host(run.state)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run on one device that saves after 3 steps, takes one more step (donating the state whose
    async save may still be writing) and then dies. Returns (checkpoint dir, its metrics, state at save)."""
    directory = tmp_path_factory.mktemp("resume")
    run = _Run(ONE_DEVICE)
    history = [run.step() for _ in range(SAVE_AT)]
    with Checkpointer(directory, async_save=True) as ckpt:
        saved = _host(run.state)
        run.save(ckpt)
        run.step()  # lost work: never checkpointed
    return directory, history, saved


def test_controller_trace_really_decays_the_lr(uninterrupted):
    """Guards the premise of the resume tests: the controller's state matters after the restart."""
    history, _ = uninterrupted
    assert [float(m["lr"]) for m in history] == pytest.approx([LR * s for s in EXPECTED_SCALES], rel=1e-6)


@pytest.mark.slow
def test_resume_on_the_same_mesh_is_bitwise_identical(uninterrupted, stopped_run):
    history, final = uninterrupted
    directory, before_stop, saved = stopped_run
    for got, want in zip(before_stop, history[:SAVE_AT], strict=True):
        _assert_bitwise(got, want, "metrics before the stop ")

    run = _Run(ONE_DEVICE, seed=7)  # a new process: fresh objects, other initial weights
    with Checkpointer(directory) as ckpt:
        assert ckpt.all_steps() == [SAVE_AT]
        meta = run.restore(ckpt)
    assert meta["step"] == SAVE_AT and run.position == SAVE_AT and int(run.state.step) == SAVE_AT
    _assert_bitwise(_host(run.state), saved, "restored state ")

    resumed = [run.step() for _ in range(N_STEPS - SAVE_AT)]
    for i, (got, want) in enumerate(zip(resumed, history[SAVE_AT:], strict=True)):
        assert sorted(got) == sorted(want)
        for key in want:
            assert np.array_equal(got[key], want[key], equal_nan=True), (SAVE_AT + i + 1, key, got[key], want[key])
    end = _host(run.state)
    _assert_bitwise(end.params, final.params, "final params ")
    _assert_bitwise(end.opt_state, final.opt_state, "final optimizer state ")
    assert int(end.step) == N_STEPS
    assert run.controller.state_dict() == _controller_after_trace().state_dict()


def _controller_after_trace() -> LengthTriggeredDecay:
    controller = LengthTriggeredDecay(baseline_window=1, window=3)
    for step, length in enumerate(LENGTH_TRACE):
        controller.update(step, {controller.metric: length})
    return controller


@pytest.mark.slow
def test_resume_onto_another_mesh(uninterrupted, stopped_run):
    """Saved on 1 device, resumed on data=2 × fsdp=4: exact restore, then the same trajectory to fp32 rounding."""
    history, final = uninterrupted
    directory, _, saved = stopped_run
    run = _Run(DATA2_FSDP4, seed=7)
    with Checkpointer(directory) as ckpt:
        run.restore(ckpt)
    _assert_bitwise(_host(run.state), saved, "restored state ")  # a data read: exact on any mesh
    kernel = run.state.params["layers"][0]["mlp"]["gate_proj"]["kernel"][...]
    assert kernel.sharding.spec[0] == "fsdp" and kernel.addressable_shards[0].data.shape[0] == kernel.shape[0] // 4
    assert run.position == SAVE_AT

    resumed = [run.step() for _ in range(N_STEPS - SAVE_AT)]
    for got, want in zip(resumed, history[SAVE_AT:], strict=True):
        assert float(got["lr"]) == float(want["lr"])
        for key in ("mean:loss/total", "mean:grad/norm", "mean:grad/update_norm", "mean:grad/param_norm"):
            assert float(got[key]) == pytest.approx(float(want[key]), rel=1e-5, abs=1e-7), key
    # Measured: 6e-8 (summation order of the sharded reductions); 1e-6 still catches any real divergence.
    assert _max_abs_diff(_host(run.state.params), final.params) <= 1e-6
    assert int(run.state.step) == N_STEPS


def _state_of_width(hidden: int, mesh):
    """A fresh train state of the tiny policy with another hidden size (everything else equal)."""
    pol = precision.policy("fp32", param_dtype="float32")
    _, params = split_model(Transformer(tiny_config(hidden_size=hidden), pol, rngs=nnx.Rngs(0)))
    opt = make_optimizer("adamw", learning_rate=LR)
    return place_state(init_state(params, opt, precision.loss_scale_for(pol)), mesh)


def test_checkpoint_of_another_model_shape_names_the_tensor(tmp_path):
    """Resuming with a config of another hidden size must fail before any array is read, saying which
    tensors differ and how; the checkpoint stays usable by a correctly configured run."""
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    narrow, wide = _state_of_width(32, mesh), _state_of_width(48, mesh)
    expected = _host(narrow)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, narrow, {"step": 1})
        ckpt.wait()
        with pytest.raises(CheckpointMismatchError) as err:
            ckpt.restore(abstract_state=abstract_state_of(wide))
        msg = str(err.value)
        assert ("params/embed/embedding/value: checkpoint has shape (64, 32) float32, "
                "requested shape (64, 48) float32") in msg
        assert "params/final_norm/scale/value" in msg
        # Every resized parameter is reported with its two Adam moments (mu, nu): 3 differences each.
        resized = sum(a.shape != b.shape for a, b in zip(jax.tree_util.tree_leaves(narrow.params),
                                                         jax.tree_util.tree_leaves(wide.params), strict=True))
        assert resized > 0 and f"({3 * resized} difference(s);" in msg
        restored, _ = ckpt.restore(abstract_state=abstract_state_of(narrow))
    _assert_bitwise(_host(restored), expected, "state after a refused restore ")
