"""The weight version has one record: the trainer reads the rollout session's counter, so the version the
trainer logs, checkpoints and computes lags against is the one the server serves — after pushes onto a
server that already held a higher version (a previous run's), and after a resume onto a restarted server
that serves a lower one.

A real `jaxrl-mismatch serve` subprocess (jax engine) and the real `Trainer` on the shared tiny warm start.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxrl_mismatch.runlog import read_jsonl
from jaxrl_mismatch.train.config import base_config
from jaxrl_mismatch.train.config_checks import check_paths, validate

PREVIOUS_RUN = 5  # the version the external server serves before the trainer attaches


def _config(model: Path, run_dir: Path, address: str, token_file: str, steps: int):
    c = base_config()
    c.run_dir, c.steps, c.model.path = str(run_dir), steps, str(model)
    c.task.num_train, c.task.num_val = 64, 2
    c.rollout.update(group_size=4, max_tokens=8, address=address, token_file=token_file)
    c.batch.prompts_per_step, c.batch.max_oversample_rounds = 2, 1  # 8 rows: one per fake device
    c.trainer.chunk_size = 16
    c.eval.every, c.eval.k, c.eval.greedy = 0, 1, False
    c.checkpoint.every = 1
    c.log.progress = c.log.tensorboard = c.log.report = False
    validate(c)
    check_paths(c)
    return c


def _assert_one_version(t, served: int, want: int) -> None:
    """Trainer, session, server and the behaviour cache (what lags are scored against) agree."""
    assert t.version == t.session.version == served == t.learner.behaviour.version == want


@pytest.mark.slow
def test_trainer_version_is_the_sessions_after_pushes_and_resume(tiny_base_model, tmp_path):
    from jaxrl_mismatch.rollout.launcher import ManagedServer
    from jaxrl_mismatch.rollout.session import RolloutSession
    from jaxrl_mismatch.train.checkpoint import Checkpointer
    from jaxrl_mismatch.train.loop import Trainer

    server = ManagedServer(str(tmp_path / "srv"), engine="jax", model=str(tiny_base_model), dtype="float32")
    server.start()
    run_dir = tmp_path / "run"
    try:
        with RolloutSession.attach(server.address, token=server.token) as previous:
            weights = {k: np.asarray(v) for k, v in _hf_weights(tiny_base_model).items()}
            assert previous.push(weights, version=PREVIOUS_RUN) == PREVIOUS_RUN

        def served() -> int:
            with RolloutSession.attach(server.address, token=server.token) as probe:
                return probe.info().weight_version

        t = Trainer(_config(tiny_base_model, run_dir, server.address, server.token_file, steps=2))
        try:
            assert t.version == 0  # nothing pushed yet, no session
            with pytest.raises(AttributeError):
                t.version = 3  # read-only: nothing but a push moves it
            t.run()
            # one push per step, above the served version, and one of the last update for the final validation
            _assert_one_version(t, served(), PREVIOUS_RUN + 3)
        finally:
            t.close()
        steps = [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0]
        assert [r["rollout/weight_version"] for r in steps] == [PREVIOUS_RUN + 1, PREVIOUS_RUN + 2]

        # Resume with one more step on a restarted server (it serves version 0 again): the push continues from
        # the checkpoint's version, which only the session's start can have brought.
        server.stop()
        server.start()
        assert served() == 0
        t = Trainer(_config(tiny_base_model, run_dir, server.address, server.token_file, steps=3))
        try:
            t.run()
            assert t.step == 3
            # + 3 (step 2's weights, pushed for the final validation) served again as + 3, then the final push
            _assert_one_version(t, served(), PREVIOUS_RUN + 4)
        finally:
            t.close()
        ckpt = Checkpointer(str(run_dir / "checkpoints"))
        try:
            assert ckpt.read_meta(3)["weight_version"] == PREVIOUS_RUN + 4
        finally:
            ckpt.close()
    finally:
        server.stop()


def _hf_weights(model_dir: Path) -> dict:
    from safetensors.numpy import load_file

    out: dict = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
