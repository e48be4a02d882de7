"""Server restarts: the client notices them, the session re-pushes and carries on; a launched server
that dies is restarted by its session."""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

from jaxrl_mismatch.rollout.client import RetryPolicy, RolloutClient, ServerRestartedError
from jaxrl_mismatch.rollout.engine import SamplingSpec
from jaxrl_mismatch.rollout.session import RolloutSession

from .conftest import TOKEN, free_port, read_checkpoint, wait_until

SPEC = SamplingSpec(n=2, max_tokens=8, seed=3)
PROMPTS = [[5, 6, 7], [8, 9]]


def _perturbed(ckpt):
    rng = np.random.default_rng(0)
    return {k: (v + rng.normal(0, 0.3, v.shape)).astype(np.float32) for k, v in read_checkpoint(ckpt).items()}


def _attached(server):
    """A client that keeps retrying while the server is down and restarts, and a session over it."""
    client = RolloutClient(server.target, token=TOKEN, wait_ready_s=60,
                           retry=RetryPolicy(max_attempts=60, initial_backoff_s=0.2, max_backoff_s=2.0))
    return client, RolloutSession(client, restart=False)


@pytest.mark.slow
def test_sigkill_restart_reconnect_repush(start_server, tiny_checkpoints):
    ckpt = tiny_checkpoints["untied"]
    port = free_port()
    first = start_server(ckpt, port=port)
    client, session = _attached(first)
    assert session.push(_perturbed(ckpt)) == 1
    before = session.generate(PROMPTS, SPEC)
    assert {c.weight_version for s in before for c in s} == {1}
    old_id = client.server_id

    first.signal(signal.SIGKILL)
    first.wait()
    # Restart on the same port while the client is already retrying its next Generate.
    restarted = {}
    threading.Thread(target=lambda: restarted.setdefault("server", start_server(ckpt, port=port)), daemon=True).start()
    after = session.generate(PROMPTS, SPEC)

    assert client.server_id != old_id and client.restarts_seen == 1 and session.restarts == 1
    assert session.info().weight_version == 1  # weights re-pushed to the new process, same version
    assert after == before  # same weights, same seed: the run continues exactly where it was
    restarted_server = restarted["server"]
    assert restarted_server.port == port

    # SIGTERM is a graceful stop: exit code 0 and the shutdown line.
    restarted_server.signal(signal.SIGTERM)
    assert restarted_server.wait() == 0
    assert wait_until(lambda: "serve: stopping" in restarted_server.lines, 10)
    session.close()


@pytest.mark.slow
def test_client_never_returns_completions_of_a_server_that_lost_the_weights(start_server, tiny_checkpoints):
    """Whichever call notices the restart first, Generate refuses until the weights are pushed again."""
    ckpt = tiny_checkpoints["untied"]
    port = free_port()
    first = start_server(ckpt, port=port)
    client = RolloutClient(first.target, token=TOKEN, wait_ready_s=60)
    client.push_weights(_perturbed(ckpt), version=1)
    first.signal(signal.SIGKILL)
    first.wait()
    second = start_server(ckpt, port=port)
    client.info()  # GetInfo is the first call to see the new process
    with pytest.raises(ServerRestartedError):
        client.generate(PROMPTS, SPEC)
    client.push_weights(_perturbed(ckpt), version=1)
    assert client.generate(PROMPTS, SPEC)[0][0].weight_version == 1
    client.close()
    second.signal(signal.SIGTERM)
    second.wait()


@pytest.mark.slow
def test_launched_server_that_dies_is_restarted_by_the_session(tiny_checkpoints, tmp_path, caplog):
    """The session restarts its dead server at the first failed attempt: no retry budget spent on a
    process that has exited."""
    ckpt = tiny_checkpoints["untied"]
    with RolloutSession.launch(work_dir=str(tmp_path), engine="jax", model=str(ckpt), dtype="float32",
                               ready_timeout_s=120) as session:
        session.push(_perturbed(ckpt))
        before = session.generate(PROMPTS, SPEC)
        port = session.server.port
        session.server.proc.send_signal(signal.SIGKILL)
        session.server.proc.wait()
        with caplog.at_level("WARNING", logger="jaxrl_mismatch.rollout.client"):
            after = session.generate(PROMPTS, SPEC)
        assert after == before and session.restarts == 1 and session.server.port == port
        assert session.server.starts == 2
        assert not [r for r in caplog.records if "retrying in" in r.getMessage()]


@pytest.mark.slow
@pytest.mark.parametrize("noticed_by", ["generate", "push"])
def test_a_server_that_comes_back_serving_something_else_is_refused(start_server, tiny_checkpoints, noticed_by):
    """A server restarted by its own supervisor with other flags (here bfloat16 instead of float32) took the
    re-push (floats are cast to its dtype) and its samples entered the batch. The trainer's check (the same
    served fields as at the start, `train.loop.served_differences`) now runs on every server that comes back,
    before the weights are pushed to it again: the session raises, naming the difference. A restart noticed by
    the next push's GetInfo (not by a Generate) skipped the check and took the new weights."""
    from jaxrl_mismatch.rollout.client import EngineMismatchError
    from jaxrl_mismatch.train.loop import served_differences

    ckpt = tiny_checkpoints["untied"]
    port = free_port()
    first = start_server(ckpt, port=port)
    client, session = _attached(first)
    at_start = session.info()
    checked = []

    def check(c):
        checked.append(c.target)
        if diff := served_differences(at_start, c.info()):
            raise EngineMismatchError("came back serving something else: " + "; ".join(diff))

    session.set_server_check(check)
    session.push(_perturbed(ckpt))
    first.signal(signal.SIGKILL)
    first.wait()
    start_server(ckpt, port=port, dtype="bfloat16")
    with pytest.raises(EngineMismatchError, match=r"dtype: 'float32' → 'bfloat16'"):
        session.generate(PROMPTS, SPEC) if noticed_by == "generate" else session.push(_perturbed(ckpt))
    assert checked == [client.target]
    assert session.info().weight_version == 0  # nothing was pushed to it
    session.close()


@pytest.mark.slow
def test_a_server_back_with_tighter_request_limits_gets_requests_it_takes(start_server, tiny_checkpoints):
    """The session read the server's request limits once: a server restarted with a smaller
    --max-request-completion-tokens refused the next Generate (INVALID_ARGUMENT) instead of receiving chunks it
    takes. Re-read when a restart is noticed (here by the next push); the split does not change the tokens."""
    ckpt = tiny_checkpoints["untied"]
    port = free_port()
    first = start_server(ckpt, port=port)
    client, session = _attached(first)
    weights = _perturbed(ckpt)
    session.push(weights)
    before = session.generate(PROMPTS, SPEC)
    first.signal(signal.SIGKILL)
    first.wait()
    start_server(ckpt, port=port, extra=("--max-request-completion-tokens", "16"))  # one prompt × n=2 × 8 tokens
    session.push(weights)
    assert session.restarts == 1 and session.limits.max_request_completion_tokens == 16
    after = session.generate(PROMPTS, SPEC)
    assert [[c.token_ids for c in s] for s in after] == [[c.token_ids for c in s] for s in before]
    np.testing.assert_allclose([c.logprobs for s in after for c in s], [c.logprobs for s in before for c in s],
                               atol=1e-5)  # (a batch of 1 row instead of 2: float rounding only)
    session.close()
