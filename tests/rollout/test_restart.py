"""A rollout server SIGKILLed mid-run: the client reconnects to its restart, re-pushes, carries on."""

from __future__ import annotations

import signal
import threading

import numpy as np

from jaxrl_mismatch.rollout.client import RetryPolicy, RolloutClient
from jaxrl_mismatch.rollout.engine import SamplingSpec

from .conftest import TOKEN, free_port, read_checkpoint, wait_until

SPEC = SamplingSpec(n=2, max_tokens=8, seed=3)
PROMPTS = [[5, 6, 7], [8, 9]]


def test_sigkill_restart_reconnect_repush(start_server, tiny_checkpoints):
    ckpt = tiny_checkpoints["untied"]
    port = free_port()
    first = start_server(ckpt, port=port)
    client = RolloutClient(first.target, token=TOKEN, wait_ready_s=60,
                           retry=RetryPolicy(max_attempts=60, initial_backoff_s=0.2, max_backoff_s=2.0))
    rng = np.random.default_rng(0)
    weights = {k: (v + rng.normal(0, 0.3, v.shape)).astype(np.float32) for k, v in read_checkpoint(ckpt).items()}
    client.push_weights(weights, version=5)
    before = client.generate(PROMPTS, SPEC)
    assert {c.weight_version for s in before for c in s} == {5}
    old_id = client.server_id

    first.signal(signal.SIGKILL)
    first.wait()
    # Restart on the same port while the client is already retrying its next Generate.
    restarted = {}
    threading.Thread(target=lambda: restarted.setdefault("server", start_server(ckpt, port=port)), daemon=True).start()
    after = client.generate(PROMPTS, SPEC)

    assert client.server_id != old_id and client.restarts_seen == 1
    assert client.info().weight_version == 5  # weights re-pushed to the new process
    assert after == before  # same weights, same seed: the run continues exactly where it was
    restarted_server = restarted["server"]
    assert restarted_server.port == port

    # SIGTERM is a graceful stop: exit code 0 and the shutdown line.
    restarted_server.signal(signal.SIGTERM)
    assert restarted_server.wait() == 0
    assert wait_until(lambda: "serve: stopping" in restarted_server.lines, 10)
    client.close()
