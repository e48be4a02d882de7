"""Asynchronous rollouts with bounded staleness (`rollout.max_staleness` = s > 0): a producer thread makes the
next steps' batches while the current step trains.

Batch j (the batch meant for step j; its seeds and prompts are step j's) may start once the trainer has pushed
the weights it had when it had taken j − s batches (AReaL's bound on how far generation runs ahead), so it is
sampled from a version at most s pushes older than the one that trains on it. The trainer checks the bound
again when it takes a batch (a version can jump by more than one per step: an external server that already
held a higher version, a restart) and **drops** a batch whose oldest sample is more than s versions behind:
counted in `rollout/dropped_batches`, logged as a warning; its prompts are not reused, as AReaL does. With
`rollout.fixed_staleness` the trainer's push of step k + 1 waits until batch k + s is made, so every batch
after the first s is exactly s versions old (experiments; the first s batches are 0, 1, …, s − 1 behind, and
a dropped batch leaves the next s + 1 at s − 1: they train a step earlier than they were made for).

The session sits behind one lock (`LockedSession`): a weight push and a Generate call never overlap, so a
push is atomic and versioned and a Generate answers from one version; a push waits at most for the Generate
in progress, never for the trainer. A server restart is recovered inside the call that saw it, under the
lock (`RolloutSession._recovering` pushes the last weights again).

Resume: the checkpoint's data position is the start of the oldest batch not yet trained on, with that batch's
index (`resume_state`): what was in flight is regenerated on resume, never half-used, and after dropped batches
the resumed producer continues their indices (seeds, mismatch onset) and count. Errors of the producer reach
the trainer at its next `take` / `before_push`, so the loop's failure path (checkpoint, resumable message) is
the synchronous one.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Produced:
    """One step's rollout batch, made ahead of time."""

    index: int                    # the step it was made for (seeds, prompt order)
    arrays: dict[str, np.ndarray]  # wire arrays of `Trainer._rollout`, incl. "sample_version" [B]
    stats: dict[str, float]
    data_start: dict              # prompt position before it drew its prompts (resume regenerates from here)
    generate_s: float             # wall time the producer spent making it

    @property
    def oldest_version(self) -> int:
        return int(np.min(self.arrays["sample_version"]))


class LockedSession:
    """A `RolloutSession` whose calls are serialised between the trainer and the producer thread."""

    def __init__(self, session) -> None:
        self.session = session
        self.lock = threading.RLock()

    def push(self, weights) -> int:
        with self.lock:
            return self.session.push(weights)

    def generate(self, prompts, spec):
        with self.lock:
            return self.session.generate(prompts, spec)

    def info(self):
        with self.lock:
            return self.session.info()

    def __getattr__(self, name: str) -> Any:  # describe, close, version, limits, restarts, ...
        return getattr(self.session, name)


class RolloutProducer:
    """Background thread calling `make(index, data_start)` for index = start, start + 1, … within the bound."""

    def __init__(self, make: Callable[[int], Produced], *, max_staleness: int, fixed: bool, start_index: int,
                 last_index: int, data_state: Callable[[], dict], dropped: int = 0) -> None:
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 for the producer, got {max_staleness}")
        self.s, self.fixed = int(max_staleness), bool(fixed)
        self._make, self._data_state = make, data_state
        self._cv = threading.Condition()
        self._ready: collections.deque[Produced] = collections.deque()
        self._next = start_index       # the next index to produce
        self._taken = start_index      # batches handed to the trainer (= the next index it takes)
        self._pushed_at: int | None = None  # `_taken` when the trainer last pushed weights
        self._in_flight: dict | None = None  # data_start of the batch being made
        self.last_index = last_index   # the last batch the run needs (raised by one per dropped batch)
        self.error: BaseException | None = None
        self._stop = False
        self.busy_s = 0.0              # producer time spent making batches (the server side's busy time)
        self.dropped = dropped         # batches dropped so far (a resumed run's count continues)
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    # -- the trainer's side ------------------------------------------------------------------------------
    def pushed(self) -> None:
        """The trainer pushed new weights: batches up to `taken + s` may start."""
        with self._cv:
            self._pushed_at = self._taken
            self._cv.notify_all()

    def before_push(self) -> None:
        """`fixed_staleness`: hold the next push until the batch that must come from the current weights is made."""
        if not self.fixed or self._pushed_at is None:
            return
        # The batches the previous push allowed (up to pushed_at + s): one step after a push that is
        # taken − 1 + s, but after a dropped batch the trainer has taken one more than it pushed for, and
        # waiting for taken − 1 + s would wait for a batch that only this push lets start.
        target = min(self._pushed_at + self.s, self.last_index)
        with self._cv:
            self._wait(lambda: self._next > target)

    def take(self) -> Produced:
        """The next batch in index order (waits for it)."""
        with self._cv:
            self._wait(lambda: bool(self._ready))
            item = self._ready.popleft()
            self._taken = item.index + 1
            self._cv.notify_all()
            return item

    def drop(self, item: Produced, current_version: int) -> None:
        """Count and log a batch beyond the bound; the run needs one more batch in its place."""
        with self._cv:
            self.dropped += 1
            self.last_index += 1
            self._cv.notify_all()
        log.warning("dropped rollout batch %d: its oldest sample has weight version %d, %d behind the current %d "
                    "(rollout.max_staleness = %d)", item.index, item.oldest_version,
                    current_version - item.oldest_version, current_version, self.s)

    def resume_state(self) -> tuple[dict, int]:
        """(the prompt position a checkpoint records: the start of the oldest batch not yet trained on, that
        batch's index). The index runs ahead of the trainer's step by the batches dropped before it."""
        with self._cv:
            if self._ready:
                return dict(self._ready[0].data_start), self._ready[0].index
            if self._in_flight is not None:
                return dict(self._in_flight), self._next
            return dict(self._data_state()), self._next

    def close(self, timeout_s: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout_s)

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Wait under the condition until `ready()`; a producer error is raised here (in the trainer)."""
        while not ready():
            if self.error is not None:
                raise self.error
            if not self._thread.is_alive():
                raise RuntimeError("the rollout producer thread ended")
            self._cv.wait(1.0)

    # -- the producer thread -------------------------------------------------------------------------------
    def _may_start(self, j: int) -> bool:
        return self._stop or (self._pushed_at is not None and self._pushed_at >= j - self.s and j <= self.last_index)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._may_start(self._next):
                        self._cv.wait()
                    if self._stop:
                        return
                    j = self._next
                    self._in_flight = self._data_state()
                t0 = time.perf_counter()
                item = self._make(j, self._in_flight)
                with self._cv:
                    item.generate_s = time.perf_counter() - t0
                    self.busy_s += item.generate_s
                    self._ready.append(item)
                    self._next, self._in_flight = j + 1, None
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the trainer at its next wait
            with self._cv:
                self.error = e
                self._cv.notify_all()
