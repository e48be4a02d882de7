"""RolloutProducer's schedule on its own: the start rule, fixed staleness, resume position, errors, drops.

`make` here records when each batch starts (which push it saw) and advances a counter standing in for the
prompt position; the loop tests (test_async_loop.py) run the producer with the real rollout path.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from jaxrl_mismatch.train.rollout_producer import Produced, RolloutProducer


class Recorder:
    def __init__(self, fail_at: int | None = None, delay: float = 0.0):
        self.position = 0
        self.pushes = 0  # how many pushes the trainer has made
        self.seen: dict[int, int] = {}  # batch index -> pushes seen when it started
        self.fail_at, self.delay = fail_at, delay
        self.lock = threading.Lock()

    def make(self, index: int, data_start: dict) -> Produced:
        with self.lock:
            self.seen[index] = self.pushes
        if index == self.fail_at:
            raise RuntimeError(f"batch {index} failed")
        time.sleep(self.delay)
        self.position += 4
        return Produced(index=index, arrays={"sample_version": np.full((2, 1), self.seen[index])}, stats={},
                        data_start=data_start, generate_s=0.0)

    def state(self) -> dict:
        return {"index": self.position}


def _producer(rec, s, fixed=False, last=9):
    return RolloutProducer(rec.make, max_staleness=s, fixed=fixed, start_index=0, last_index=last,
                           data_state=rec.state)


def _push(rec, p):
    p.before_push()
    with rec.lock:
        rec.pushes += 1
    p.pushed()


def _wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_batch_j_starts_only_after_the_push_of_step_j_minus_s():
    rec = Recorder()
    p = _producer(rec, s=2)
    try:
        time.sleep(0.1)
        assert rec.seen == {}  # nothing before the first push
        _push(rec, p)
        _wait_until(lambda: len(rec.seen) == 3)
        time.sleep(0.1)
        assert sorted(rec.seen) == [0, 1, 2]  # j ≤ taken + s
        for step in range(3):
            item = p.take()
            assert item.index == step
            _push(rec, p)
        _wait_until(lambda: 5 in rec.seen)
        for j, pushes in rec.seen.items():
            assert pushes >= j - 2 + 1  # batch j saw the push of step j − s (push k is the (k+1)-th)
    finally:
        p.close()


def _fixed_lags(s: int, *, drop_at: int | None = None, steps: int = 8) -> list[int]:
    """Each step's lag (trainer's pushes − pushes its batch saw) under fixed staleness s; at step `drop_at` the
    batch taken is dropped and the next one trains instead."""
    rec = Recorder(delay=0.02)
    p = _producer(rec, s=s, fixed=True, last=steps - 1)
    try:
        _push(rec, p)
        lags = []
        for step in range(steps):
            item = p.take()
            if step == drop_at:
                p.drop(item, current_version=99)
                item = p.take()
            lags.append(step + 1 - rec.seen[item.index])
            if step < steps - 1:
                _push(rec, p)
        return lags
    finally:
        p.close()


def test_fixed_staleness_makes_every_batch_exactly_s_behind():
    assert _fixed_lags(2) == [0, 1, 2, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("s", [1, 2])
def test_under_fixed_staleness_a_dropped_batch_leaves_s_plus_1_steps_one_version_fresher(s):
    """What docs/rollout.md states: the batch after a dropped one was allowed by the previous push, as every batch
    is, but it trains a step earlier than it was made for, so it and the next s are s - 1 versions old, not s. (To
    keep s, a batch would have to be made from weights the server no longer serves.)"""
    lags = _fixed_lags(s, drop_at=4)
    assert lags == list(range(s)) + [s] * (4 - s) + [s - 1] * (s + 1) + [s] * (3 - s), lags


def test_resume_state_is_the_oldest_batch_not_trained_on():
    rec = Recorder()
    p = _producer(rec, s=2)
    try:
        _push(rec, p)
        _wait_until(lambda: len(rec.seen) == 3 and rec.position == 12)
        time.sleep(0.05)
        assert p.resume_state() == ({"index": 0}, 0)
        p.take()
        assert p.resume_state() == ({"index": 4}, 1)  # batch 1 is in hand, not trained on: regenerate it
    finally:
        p.close()


def test_an_error_of_the_producer_reaches_the_trainer():
    rec = Recorder(fail_at=1)
    p = _producer(rec, s=1)
    try:
        _push(rec, p)
        assert p.take().index == 0
        with pytest.raises(RuntimeError, match="batch 1 failed"):
            p.take()
    finally:
        p.close()


def test_a_dropped_batch_is_counted_and_replaced():
    rec = Recorder()
    p = _producer(rec, s=1, last=1)
    try:
        _push(rec, p)
        a = p.take()
        p.drop(a, current_version=5)
        _push(rec, p)
        assert p.dropped == 1 and p.last_index == 2
        assert [p.take().index, p.take().index] == [1, 2]  # one more batch made in its place
    finally:
        p.close()


def test_a_drop_under_fixed_staleness_does_not_hold_the_next_push_forever():
    # Taking batch 0, dropping it and taking batch 1 between two pushes: the push must wait only for the
    # batches the previous push allowed (0..s), not for batch 2, which only this push lets start.
    rec = Recorder()
    p = _producer(rec, s=1, fixed=True, last=3)
    try:
        _push(rec, p)
        p.drop(p.take(), current_version=5)
        assert p.take().index == 1
        done = threading.Event()
        threading.Thread(target=lambda: (_push(rec, p), done.set()), daemon=True).start()
        assert done.wait(10.0), "the push after a dropped batch waited forever"
        assert p.take().index == 2 and rec.seen[2] == 2  # made from the new push's weights
    finally:
        p.close()


def test_staleness_zero_is_not_a_producer():
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutProducer(lambda i, d: None, max_staleness=0, fixed=False, start_index=0, last_index=1,
                        data_state=dict)


def test_a_producer_error_at_push_reaches_every_process_through_on_lead(monkeypatch):
    """Multi-process: the producer lives on process 0, and its error (re-raised by `before_push`) was raised
    before `on_lead`, so process 0 went on to its collective checkpoint save while the others waited in the
    push's broadcast (a hang, and no checkpoint). Now it is raised inside the function `on_lead` runs, which
    tells the other processes (`LeadFailure`). The trainer's `_push` is run on the attributes it reads; `on_lead`
    is wrapped to see what its function raises."""
    from types import SimpleNamespace

    from jaxrl_mismatch.rollout.client import RolloutError
    from jaxrl_mismatch.train import distributed
    from jaxrl_mismatch.train.loop import Trainer

    seen = []
    real = distributed.on_lead

    def on_lead(is_lead, fn, keys):
        def watched():
            try:
                return fn()
            except Exception as e:
                seen.append(e)
                raise
        return real(is_lead, watched, keys)

    class FailedProducer:
        def before_push(self):
            raise RolloutError("rollout producer failed (test)")

    monkeypatch.setattr(distributed, "on_lead", on_lead)
    trainer = SimpleNamespace(_pushed_step=None, step=3, is_lead=True, session=None, producer=FailedProducer(),
                              learner=SimpleNamespace(hf_weights=dict))
    with pytest.raises(RolloutError, match="producer failed"):
        Trainer._push(trainer)
    assert [str(e) for e in seen] == ["rollout producer failed (test)"]
