"""The RL loop on a fleet of 3 managed rollout servers: one SIGKILLed mid-step and the run goes on with the
same samples as a one-server run; all of them killed and the run stops with a resumable checkpoint."""

from __future__ import annotations

import logging
import re
import signal

import pytest

from jaxrl_mismatch.rollout.fleet import RolloutFleet
from jaxrl_mismatch.runlog import read_jsonl

from .test_loop_integration import _run, tiny_config


@pytest.fixture(scope="module")
def base_model(tiny_base_model):
    # The session's shared warm start (tests/conftest.py): the same arguments this file's own warm start used
    # (hidden 32, 2 heads, 40 steps), built once per test session instead of once more here.
    return tiny_base_model


def _kill_in_flight(monkeypatch, run_dir, victims):
    """From step 1 on, the first rollout request sent to each of `victims(fleet)` kills its server first."""
    real_generate = RolloutFleet.generate
    state = {"armed": True}

    def generate(self, prompts, spec):
        started = (run_dir / "metrics.jsonl").exists() and any(
            r["step"] >= 0 for r in read_jsonl(str(run_dir / "metrics.jsonl")))
        if started and state["armed"]:
            state["armed"] = False
            for m in victims(self):
                real = m.session.generate

                def killed(p, s, m=m, real=real):
                    m.session.generate = real  # once
                    m.session.server.proc.send_signal(signal.SIGKILL)
                    return real(p, s)

                m.session.generate = killed
        return real_generate(self, prompts, spec)

    monkeypatch.setattr(RolloutFleet, "generate", generate)


def _steps(run_dir):
    return [r for r in read_jsonl(str(run_dir / "metrics.jsonl")) if r["step"] >= 0]


@pytest.mark.slow
def test_one_server_killed_mid_step_the_run_finishes_with_the_same_samples(base_model, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="jaxrl_mismatch.rollout.fleet")
    reference = tmp_path / "one"
    _run(tiny_config(base_model, reference))
    run_dir = tmp_path / "fleet"
    _kill_in_flight(monkeypatch, run_dir, lambda fleet: [fleet.members[1]])
    summary = _run(tiny_config(base_model, run_dir, num_servers=3))
    assert summary["end_step"] == 3
    assert "died during Generate: re-sending its" in caplog.text
    got, want = _steps(run_dir), _steps(reference)
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):  # complete steps, the same samples as on one server
        for key in ("filter/sampled_groups", "reward/mean", "rollout/response_length", "rollout/weight_version"):
            assert a[key] == b[key], (a["step"], key)


@pytest.mark.slow
def test_all_servers_killed_stops_with_a_checkpoint_and_the_resume_finishes(base_model, tmp_path, monkeypatch):
    from jaxrl_mismatch.train.loop import RolloutFailure

    run_dir = tmp_path / "run"
    c = tiny_config(base_model, run_dir, num_servers=3)
    c.checkpoint.every = 100  # only the failure path and the end write checkpoints
    _kill_in_flight(monkeypatch, run_dir, lambda fleet: fleet.members)
    with pytest.raises(RolloutFailure, match=r"(?s)no rollout server left.*resumable checkpoint of step (\d+).*rerun "
                                             r"the same command") as err:
        _run(c)
    done = int(re.search(r"checkpoint of step (\d+)", str(err.value)).group(1))
    assert done >= 1 and [r["step"] for r in _steps(run_dir)] == list(range(done))
    monkeypatch.undo()
    summary = _run(c)  # the same command: a new fleet, resumed from the checkpoint
    assert (summary["start_step"], summary["end_step"]) == (done, 3)
    assert [r["step"] for r in _steps(run_dir)] == [0, 1, 2]
