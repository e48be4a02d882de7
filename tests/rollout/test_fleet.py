"""A fleet of rollout servers (rollout/fleet.py): requests spread by tokens, the same samples however they are
spread, and a server killed mid-step whose prompts are re-sent to the others (none lost, none duplicated)."""

from __future__ import annotations

import dataclasses
import logging
import signal

import numpy as np
import pytest

from jaxrl_mismatch.rollout.engine import SamplingSpec
from jaxrl_mismatch.rollout.fleet import NoServerLeftError, RolloutFleet, token_pieces
from jaxrl_mismatch.rollout.session import RolloutSession
from jaxrl_mismatch.rollout.protocol import Limits

from .conftest import TOKEN, in_process_servers, read_checkpoint

SPEC = SamplingSpec(n=2, max_tokens=6, seed=11)
PROMPTS = [[3 + i, 14, 15 + (i % 5)] + [9] * (i % 4) for i in range(12)]


def _tokens(completions):
    return [[c.token_ids for c in samples] for samples in completions]


def _perturbed(ckpt, scale=0.3):
    rng = np.random.default_rng(0)
    return {k: (v + rng.normal(0, scale, v.shape)).astype(np.float32) for k, v in read_checkpoint(ckpt).items()}


def test_pieces_are_balanced_by_tokens_and_within_limits():
    spec = SamplingSpec(n=2, max_tokens=10)
    prompts = [[1] * 100] + [[1] * 2] * 20  # one long prompt costs as much as ~5 short ones
    pieces = token_pieces(prompts, spec, Limits(), 3)
    assert [p.start for p in pieces] == [0] + [p.stop for p in pieces[:-1]] and pieces[-1].stop == len(prompts)
    cost = [sum(len(p) + 20 for p in prompts[s]) for s in pieces]
    assert len(pieces) == 3 and max(cost) - min(cost) <= 120  # within one long prompt of each other
    assert pieces[0].stop - pieces[0].start < pieces[-1].stop - pieces[-1].start  # the long prompt's piece is short
    tight = token_pieces(prompts, spec, Limits(max_request_completion_tokens=60), 2)
    assert all(s.stop - s.start <= 3 for s in tight)  # 3 prompts x 20 completion tokens per request at most
    assert token_pieces([], spec, Limits(), 3) == []


@pytest.fixture(scope="module")
def three_servers(tiny_checkpoints):
    yield from in_process_servers(tiny_checkpoints["untied"], 3)


@pytest.mark.slow
def test_samples_do_not_depend_on_how_requests_are_spread(three_servers, tiny_checkpoints):
    weights = _perturbed(tiny_checkpoints["untied"])
    addresses = [f"127.0.0.1:{s.port}" for s in three_servers]
    with RolloutSession.attach(addresses[0], token=TOKEN, ready_timeout_s=30) as one:
        one.push(weights)
        reference = one.generate(PROMPTS, SPEC)
        # Split by the request limits alone: prompt i keeps its place, so its samples do not change.
        one.limits = Limits(max_request_completion_tokens=SPEC.n * SPEC.max_tokens * 5)
        assert _tokens(one.generate(PROMPTS, SPEC)) == _tokens(reference)
        # prompt_offset is what keeps them: prompts 4.. sampled as prompts 0.. would draw other tokens.
        tail = one.generate(PROMPTS[4:], dataclasses.replace(SPEC, prompt_offset=4))
        assert _tokens(tail) == _tokens(reference)[4:]
        assert _tokens(one.generate(PROMPTS[4:], SPEC)) != _tokens(reference)[4:]
    for n in (2, 3):
        with RolloutFleet.attach(addresses[:n], token=TOKEN, ready_timeout_s=30) as fleet:
            version = fleet.push(weights)
            assert all(m.served == version for m in fleet.members)
            got = fleet.generate(PROMPTS, SPEC)
            assert _tokens(got) == _tokens(reference)
            assert {c.weight_version for s in got for c in s} == {version}
    served = [s.engine.info().weight_version for s in three_servers]
    assert served[2] == served[1] and served[1] >= 2  # every push reached every server of the fleet


@pytest.mark.slow
def test_a_server_that_failed_the_push_sits_the_step_out(three_servers, tiny_checkpoints, monkeypatch, caplog):
    weights = _perturbed(tiny_checkpoints["untied"], 0.2)
    addresses = [f"127.0.0.1:{s.port}" for s in three_servers]
    with RolloutFleet.attach(addresses, token=TOKEN, ready_timeout_s=30) as fleet:
        fleet.push(weights)
        lagging = fleet.members[1]
        real = lagging.session.push

        def refuse(*a, **kw):
            from jaxrl_mismatch.rollout.client import RolloutError
            raise RolloutError("UpdateWeights: UNAVAILABLE (test)")

        monkeypatch.setattr(lagging.session, "push", refuse)
        version = fleet.push(weights)
        assert not lagging.up and lagging.served != version
        asked = []
        monkeypatch.setattr(lagging.session, "generate", lambda *a: asked.append(a))
        assert len(fleet.generate(PROMPTS, SPEC)) == len(PROMPTS) and not asked  # never used while behind
        assert "sits this step out" in caplog.text
        # Back at the next push (an attached server is polled, then re-pushed): it rejoins.
        monkeypatch.setattr(lagging.session, "push", real)
        monkeypatch.undo()
        lagging.revival.result(timeout=30)
        version = fleet.push(weights)
        assert lagging.up and lagging.served == version


@pytest.mark.slow
def test_a_server_that_failed_getinfo_is_not_pushed_to(three_servers, tiny_checkpoints, monkeypatch, caplog):
    """A server that died between steps fails the push's GetInfo and is taken down (its client closed); the push
    then went to it anyway, and gRPC's "closed channel" ValueError ended the run with exit 1 and no checkpoint."""
    from jaxrl_mismatch.rollout.client import RolloutError

    weights = _perturbed(tiny_checkpoints["untied"], 0.1)
    addresses = [f"127.0.0.1:{s.port}" for s in three_servers]
    with RolloutFleet.attach(addresses, token=TOKEN, ready_timeout_s=30) as fleet:
        fleet.push(weights)
        dead = fleet.members[2]

        def gone(*a, **kw):
            raise RolloutError("GetInfo: UNAVAILABLE (test)")

        pushed = []
        monkeypatch.setattr(dead.session, "info", gone)
        monkeypatch.setattr(dead.session, "push", lambda *a, **kw: pushed.append(a))
        version = fleet.push(weights)
        assert pushed == [] and not dead.up and dead.served is None
        assert [m.served for m in fleet.members[:2]] == [version, version]
        assert "failed GetInfo" in caplog.text and len(fleet.generate(PROMPTS, SPEC)) == len(PROMPTS)
        dead.revival.result(timeout=30)  # let its background revival finish before the servers are reused


@pytest.mark.slow
def test_sigkill_mid_step_fails_over_and_the_server_rejoins(tmp_path, tiny_checkpoints, caplog):
    ckpt = tiny_checkpoints["untied"]
    weights = _perturbed(ckpt)
    caplog.set_level(logging.WARNING, logger="jaxrl_mismatch.rollout.fleet")
    with RolloutFleet.launch(3, work_dir=str(tmp_path), engine="jax", model=str(ckpt), dtype="float32",
                             ready_timeout_s=180) as fleet:
        version = fleet.push(weights)
        reference = fleet.generate(PROMPTS, SPEC)
        assert len(reference) == len(PROMPTS) and all(len(s) == SPEC.n for s in reference)
        victim = fleet.members[1]
        real = victim.session.generate

        def killed_mid_request(prompts, spec):  # the server dies with this request in flight
            victim.session.server.proc.send_signal(signal.SIGKILL)
            return real(prompts, spec)

        victim.session.generate = killed_mid_request
        got = fleet.generate(PROMPTS, SPEC)
        # Same prompts, same samples, none lost or duplicated: its piece went to the other two.
        assert _tokens(got) == _tokens(reference) and fleet.failovers == 1 and not victim.up
        assert f"rollout server {victim.name} died during Generate: re-sending its" in caplog.text
        victim.session.generate = real
        # Restarted in the background on its port; at the next push it gets the weights and rejoins.
        victim.revival.result(timeout=180)
        version = fleet.push(weights)
        assert victim.up and victim.served == version and victim.session.server.starts == 2
        assert "is back: pushed version" in caplog.text
        assert _tokens(fleet.generate(PROMPTS, SPEC)) == _tokens(reference)
        # All of them killed mid-step: nothing is left to serve the step.
        for m in fleet.members:
            m.session.server.proc.send_signal(signal.SIGKILL)
        with pytest.raises(NoServerLeftError, match="no rollout server left for this step"):
            fleet.generate(PROMPTS, SPEC)


@pytest.mark.slow
def test_a_stalled_server_is_taken_out_and_its_prompts_answered_once(three_servers, tiny_checkpoints, caplog):
    import threading

    weights = _perturbed(tiny_checkpoints["untied"])
    addresses = [f"127.0.0.1:{s.port}" for s in three_servers]
    with RolloutFleet.attach(addresses, token=TOKEN, ready_timeout_s=30) as fleet:
        fleet.push(weights)
        reference = fleet.generate(PROMPTS, SPEC)  # compiles: not under the stall timeout below
        fleet.stall_timeout_s = 8.0
        stalled = fleet.members[0]
        real, release, late = stalled.session.generate, threading.Event(), []

        def hang(prompts, spec):  # answers, but only long after the stall timeout
            release.wait(120)
            late.append(real(prompts, spec))
            return late[-1]

        stalled.session.generate = hang
        got = fleet.generate(PROMPTS, SPEC)
        release.set()
        assert _tokens(got) == _tokens(reference) and not stalled.up and fleet.failovers == 1
        assert "stalled (" in caplog.text and "> stall_timeout_s 8) during Generate" in caplog.text
        stalled.session.generate = real


def test_an_answer_that_came_while_another_server_was_taken_down_is_kept(three_servers, tiny_checkpoints, caplog):
    """The stall check also looked at calls that had finished after the last wait: while one failed server was being
    taken down (up to 11 s stopping a launched one), the others' answers aged past stall_timeout_s, and good answers
    were thrown away and healthy servers taken out as "stalled"."""
    import threading
    import time

    import grpc

    from jaxrl_mismatch.rollout.client import RolloutError

    weights = _perturbed(tiny_checkpoints["untied"])
    addresses = [f"127.0.0.1:{s.port}" for s in three_servers]
    with RolloutFleet.attach(addresses, token=TOKEN, ready_timeout_s=30) as fleet:
        fleet.push(weights)
        reference = fleet.generate(PROMPTS, SPEC)  # compiles: not under the short stall timeout below
        fleet.stall_timeout_s = 2.0
        failing, others = fleet.members[0], fleet.members[1:]
        real_generate, real_close = failing.session.generate, failing.session.client.close
        answered = threading.Semaphore(0)

        def fail(prompts, spec):
            raise RolloutError("Generate failed: UNAVAILABLE", code=grpc.StatusCode.UNAVAILABLE)

        def answering(m):
            def generate(prompts, spec, real=m.session.generate):
                try:
                    return real(prompts, spec)
                finally:
                    answered.release()
            m.session.generate = generate

        def slow_close():  # taking it down outlasts the stall timeout; the others answer meanwhile
            failing.session.client.close = real_close  # only the first close (the take-down) is slow
            for _ in others:
                assert answered.acquire(timeout=120)
            time.sleep(fleet.stall_timeout_s + 1.0)  # their answers are now older than stall_timeout_s
            real_close()

        for m in others:
            answering(m)
        failing.session.generate, failing.session.client.close = fail, slow_close
        got = fleet.generate(PROMPTS, SPEC)
        assert _tokens(got) == _tokens(reference)
        assert not failing.up and all(m.up for m in fleet.members[1:]) and fleet.failovers == 1, caplog.text
        assert "stalled" not in caplog.text
        failing.session.generate = real_generate


def _poisoned(fleet, poison, fail):
    """Every server fails (`fail(prompts, spec)`) the piece holding prompt `poison`, and answers the others."""
    for m in fleet.members:
        real = m.session.generate
        m.session.generate = lambda prompts, spec, real=real: (fail(prompts, spec) if poison in prompts
                                                                else real(prompts, spec))


def test_a_piece_that_fails_on_two_servers_stops_the_step_and_spares_the_third(three_servers, tiny_checkpoints,
                                                                              caplog):
    """A request that crashes the engine (or takes longer than stall_timeout_s) fails on every server it is sent
    to: re-sent each time, it took every server of the fleet down in turn and ended in "no server left", hiding the
    cause. After PIECE_FAILURES servers the step stops, naming the prompts, and the other servers stay up."""
    import threading

    import grpc

    from jaxrl_mismatch.rollout.client import RolloutError
    from jaxrl_mismatch.rollout.fleet import PIECE_FAILURES, PieceFailedError

    assert PIECE_FAILURES == 2
    weights = _perturbed(tiny_checkpoints["untied"])
    addresses = [f"127.0.0.1:{s.port}" for s in three_servers]

    def crash(prompts, spec):
        raise RolloutError("Generate failed: INTERNAL (test: this request crashes the engine)",
                           code=grpc.StatusCode.INTERNAL)

    with RolloutFleet.attach(addresses, token=TOKEN, ready_timeout_s=30) as fleet:
        fleet.push(weights)
        _poisoned(fleet, PROMPTS[5], crash)
        with pytest.raises(PieceFailedError, match=r"failed on 2 rollout servers .*INTERNAL.*the request, not the "
                                                   r"servers, is the likely cause") as e:
            fleet.generate(PROMPTS, SPEC)
        assert "stall_timeout_s" not in str(e.value)
        assert sum(m.up for m in fleet.members) == 1 and fleet.failovers == 1
        assert "down (1 failure(s) so far)" in str(e.value)

    release = threading.Event()

    def hang(prompts, spec):  # a request that legitimately takes longer than the stall timeout, on any server
        release.wait(60)
        raise RolloutError("Generate failed: CANCELLED (test)")

    try:
        with RolloutFleet.attach(addresses, token=TOKEN, ready_timeout_s=30, stall_timeout_s=1.5) as fleet:
            fleet.push(weights)
            _poisoned(fleet, PROMPTS[0], hang)
            with pytest.raises(PieceFailedError, match=r"prompts 0-\d+ of this step failed on 2 rollout servers.*"
                                                       r"stalled.*raise rollout.stall_timeout_s"):
                fleet.generate(PROMPTS, SPEC)
            assert sum(m.up for m in fleet.members) == 1
    finally:
        release.set()


def test_info_asks_the_next_server_when_one_fails(three_servers, tiny_checkpoints):
    """A failed GetInfo of the first live server failed `info()` though two others were up."""
    from jaxrl_mismatch.rollout.client import RolloutError

    addresses = [f"127.0.0.1:{s.port}" for s in three_servers]
    with RolloutFleet.attach(addresses, token=TOKEN, ready_timeout_s=30) as fleet:
        version = fleet.push(_perturbed(tiny_checkpoints["untied"], 0.1))

        def gone(*a, **kw):
            raise RolloutError("GetInfo: UNAVAILABLE (test)")

        failing = fleet.members[0]
        failing.session.info = gone
        assert fleet.info().weight_version == version and not failing.up  # the second server answered
        assert all(m.up for m in fleet.members[1:])
        failing.revival.result(timeout=30)  # its background revival ends before the servers are reused


@pytest.mark.slow
def test_a_revival_that_fails_its_check_stops_the_server_it_started(tmp_path, tiny_checkpoints):
    """The revival restarted a launched server, then its readiness or server check failed, and the process was left
    running: the next revival found it alive and reused it instead of starting it afresh."""
    from jaxrl_mismatch.rollout.client import RolloutError

    ckpt = tiny_checkpoints["untied"]
    with RolloutFleet.launch(1, work_dir=str(tmp_path), engine="jax", model=str(ckpt), dtype="float32",
                             ready_timeout_s=180) as fleet:
        fleet.push(_perturbed(ckpt))
        member = fleet.members[0]

        def refuse(client):
            raise RolloutError("refused (test)")

        fleet.set_server_check(refuse)
        member.session.server.proc.send_signal(signal.SIGKILL)
        with pytest.raises(NoServerLeftError):
            fleet.generate(PROMPTS, SPEC)
        with pytest.raises(RolloutError, match="refused"):
            member.revival.result(timeout=180)
        assert member.session.server.starts == 2 and not member.session.server.alive()


@pytest.mark.slow
def test_close_during_a_revival_stops_the_server_being_started_at_once(tmp_path, tiny_checkpoints):
    """close() waited for a revival in progress to finish its server's start-up and readiness (up to
    rollout.startup_timeout_s, 10 min by default, for a big model), then stopped the server it had just started:
    a trainer stopping after a failed step hung there. Now close() stops that start: the revival ends with the
    server's start error and the process it spawned is gone."""
    import time

    from jaxrl_mismatch.rollout.launcher import ServerStartError

    ckpt = tiny_checkpoints["untied"]
    fleet = RolloutFleet.launch(1, work_dir=str(tmp_path), engine="jax", model=str(ckpt), dtype="float32",
                                ready_timeout_s=180)
    try:
        fleet.push(_perturbed(ckpt))
        member = fleet.members[0]
        server = member.session.server
        first = server.proc
        first.send_signal(signal.SIGKILL)
        with pytest.raises(NoServerLeftError):
            fleet.generate(PROMPTS, SPEC)
        deadline = time.monotonic() + 30
        while server.proc in (None, first) and time.monotonic() < deadline:  # the revival spawned its process
            time.sleep(0.01)
        spawned = server.proc
        assert spawned is not None and spawned is not first and server.starts == 2
    finally:
        fleet.close()
    assert member.revival.done()
    error = member.revival.exception()
    assert isinstance(error, ServerStartError) and "launcher is closed" in str(error), error
    assert spawned.poll() is not None and not server.alive()


@pytest.mark.slow
def test_an_attached_server_back_with_tighter_limits_rejoins_with_them(tiny_checkpoints):
    """A fleet server restarted by its operator with a smaller completion-token limit rejoined with the limits it
    had before: the next step's pieces exceeded the new limit and the step failed (INVALID_ARGUMENT)."""
    from jaxrl_mismatch.rollout.client import RetryPolicy
    from jaxrl_mismatch.rollout.jax_engine import JaxEngine
    from jaxrl_mismatch.rollout.server import RolloutServer

    engine = JaxEngine(str(tiny_checkpoints["untied"]), dtype="float32")
    a, b = (RolloutServer(port=0, token=TOKEN) for _ in range(2))
    a.attach(engine)
    b.attach(engine)
    weights = _perturbed(tiny_checkpoints["untied"])
    try:
        with RolloutFleet.attach([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], token=TOKEN, ready_timeout_s=30,
                                 retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.05)) as fleet:
            fleet.push(weights)
            reference = fleet.generate(PROMPTS, SPEC)
            port = b.port
            b.stop(0)
            assert _tokens(fleet.generate(PROMPTS, SPEC)) == _tokens(reference) and not fleet.members[1].up
            tight = SPEC.n * SPEC.max_tokens * 2  # two prompts a request
            b = RolloutServer(port=port, token=TOKEN, limits=Limits(max_request_completion_tokens=tight))
            b.attach(engine)
            fleet.members[1].revival.result(timeout=30)
            fleet.push(weights)
            assert fleet.members[1].up and fleet.limits.max_request_completion_tokens == tight
            assert fleet.members[1].session.limits.max_request_completion_tokens == tight
            assert _tokens(fleet.generate(PROMPTS, SPEC)) == _tokens(reference)
    finally:
        a.stop(0)
        b.stop(0)
