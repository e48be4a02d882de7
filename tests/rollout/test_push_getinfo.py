"""A weight push reads the server's GetInfo once (it read it twice: once for the version, once to sync the
server id and shared-memory host), and still notices a restart and picks the next version. (A client's
first push to a server process also reads the engine's weight specs, once: the pushes counted here follow one.)"""

from __future__ import annotations

import pytest

from jaxrl_mismatch.rollout.client import RolloutClient
from jaxrl_mismatch.rollout.engine import SamplingSpec
from jaxrl_mismatch.rollout.fleet import RolloutFleet
from jaxrl_mismatch.rollout.session import RolloutSession

from .conftest import TOKEN, in_process_servers, read_checkpoint

SPEC = SamplingSpec(n=1, max_tokens=4, seed=1)


@pytest.fixture(scope="module")
def servers(tiny_checkpoints):
    yield from in_process_servers(tiny_checkpoints["untied"], 2)


def _counted(client: RolloutClient) -> dict[str, int]:
    """Count the GetInfo RPCs the client sends (the real stub is still called)."""
    calls = {"GetInfo": 0}
    real = client._stub.GetInfo

    def get_info(*args, **kwargs):
        calls["GetInfo"] += 1
        return real(*args, **kwargs)

    client._stub.GetInfo = get_info
    return calls


@pytest.mark.slow
def test_a_session_push_reads_getinfo_once(servers, tiny_checkpoints):
    server = servers[0]
    weights = read_checkpoint(tiny_checkpoints["untied"])
    session = RolloutSession(RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=30))
    try:
        session.push(weights)  # reads the weight specs (once per server process)
        calls = _counted(session.client)
        first = server.engine.info().weight_version
        for k in range(1, 3):
            assert session.push(weights) == first + k
            assert calls["GetInfo"] == k  # one per push (was two)
            assert server.engine.info().weight_version == first + k
        # Another trainer pushed a higher version: the one GetInfo still finds it, the next push goes above.
        with RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, wait_ready_s=30) as other:
            other.push_weights(weights, first + 10)
        assert session.push(weights) == first + 11 and calls["GetInfo"] == 3
        assert session.generate([[3, 14, 15]], SPEC)[0][0].weight_version == first + 11
        # The GetInfo before the push still notices a restarted server (a new server id), whose weight specs
        # the push then reads again (one more GetInfo, as for any new server process).
        session.client.server_id = "an-earlier-process"
        restarts = session.client.restarts_seen
        session.push(weights)
        assert session.client.restarts_seen == restarts + 1 and calls["GetInfo"] == 5
        # An explicit version (no version to read) syncs inside the push: still one GetInfo.
        session.push(weights, first + 20)
        assert calls["GetInfo"] == 6
    finally:
        session.close()


@pytest.mark.slow
def test_a_fleet_push_reads_getinfo_once_per_server(servers, tiny_checkpoints):
    weights = read_checkpoint(tiny_checkpoints["untied"])
    fleet = RolloutFleet.attach([f"127.0.0.1:{s.port}" for s in servers], token=TOKEN, ready_timeout_s=30)
    try:
        fleet.push(weights)  # reads the weight specs (once per server process)
        counts = [_counted(m.session.client) for m in fleet.members]
        version = fleet.push(weights)
        assert [c["GetInfo"] for c in counts] == [1, 1]  # was two per server
        assert all(s.engine.info().weight_version == version for s in servers)
        out = fleet.generate([[3, 14, 15], [9, 2, 6]], SPEC)
        assert {c.weight_version for g in out for c in g} == {version}
    finally:
        fleet.close()
