"""A Generate whose caller went away (deadline, cancel) stops between batches on the server, and the client does
not retry it: before, each retry started the whole generation over while the abandoned copies ran on, until the
server's threads were all busy and even its health check timed out."""

from __future__ import annotations

import time

import pytest

from jaxrl_mismatch.rollout import RolloutClient, RolloutError, SamplingSpec
from jaxrl_mismatch.rollout.jax_engine import JaxEngine
from jaxrl_mismatch.rollout.server import RolloutServer
from tests.rollout.conftest import TOKEN


def test_a_timed_out_generate_is_not_retried_and_stops_on_the_server(tiny_checkpoints):
    engine = JaxEngine(str(tiny_checkpoints["untied"]), dtype="float32", max_batch_rows=4)
    batches = []
    run_rows = engine._generate_rows
    engine._generate_rows = lambda *a, **kw: batches.append(time.monotonic()) or run_rows(*a, **kw)
    server = RolloutServer(port=0, token=TOKEN)
    server.attach(engine)
    try:
        spec = SamplingSpec(n=4, max_tokens=48, temperature=1.0, seed=1)
        client = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, generate_timeout_s=60)
        client.generate([[3, 4, 5]], spec)  # compiles the 4-row program
        hasty = RolloutClient(f"127.0.0.1:{server.port}", token=TOKEN, generate_timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(RolloutError, match=r"Generate .*DEADLINE_EXCEEDED after 1 attempt\(s\).*not retried"):
            hasty.generate([[3, 4, 5 + i % 80] for i in range(100)], spec)  # 100 batches of 4 rows
        assert time.monotonic() - t0 < 5
        time.sleep(1.0)  # the batch in progress at the deadline finishes; no further one starts
        started = len(batches)
        time.sleep(1.0)
        assert len(batches) == started < 1 + 100, (started, len(batches))
        t1 = time.monotonic()
        assert len(client.generate([[7, 8]], SamplingSpec(n=4, max_tokens=48, seed=2))[0]) == 4
        assert time.monotonic() - t1 < 10  # the server is free at once
    finally:
        server.stop(0)
