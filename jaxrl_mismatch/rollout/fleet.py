"""`RolloutFleet`: several rollout servers behind the session surface (push, generate, info, close).

At scale generation is spread over many engine servers and a run survives losing one (verl, slime, SkyRL,
prime-rl put a router in front of several engines). The fleet is that router, inside the trainer:

- **Pushes go to every server**, in parallel, under one fleet-wide version; a server is used for a step
  only once it serves that step's version (a server whose push failed sits the step out).
- **Requests are spread by tokens.** A step's prompts are cut into contiguous pieces of about equal cost
  (prompt tokens + n × max_tokens per prompt), at most one per server and within the servers' request
  limits; servers pull pieces from one queue, so a faster server takes more.
- **A dead or stalled server's unfinished piece is re-sent** to the others: death is seen as a failed call
  (or, for a server the fleet launched, its process exiting), a stall as a call running longer than
  `stall_timeout_s`. Each piece is answered exactly once (a late answer of an abandoned call is dropped),
  so the step completes with the same prompts and samples, none duplicated.
- **Reproducible however requests are spread**: every piece carries its prompts' place in the step's
  batch (`SamplingSpec.prompt_offset`), and the engines key their randomness by (seed, that place, sample),
  so 1, 2 or 3 servers and any failover sample the same completions.
- **Rejoin.** A down server is brought back in the background (a launched one is restarted on its port; an
  attached one is polled) and, at the next push, gets the current weights and rejoins.
- **Stop only when none is left**: `NoServerLeftError` (a `RolloutError`, so the trainer checkpoints and
  prints its resume message) once no server can serve the step — or `PieceFailedError` once one piece has
  failed on `PIECE_FAILURES` servers: then the request, not the servers, is the likely cause (a prompt that
  crashes the engine, a request longer than `stall_timeout_s`), and re-sending it would take every server down.
- `info()` asks the next server when one fails; a revival never leaves a server it started running when its
  readiness or server check fails, or when the fleet closed meanwhile.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import grpc
import numpy as np

from jaxrl_mismatch.rollout.client import RetryPolicy, RolloutClient, RolloutError
from jaxrl_mismatch.rollout.engine import Completion, EngineInfo, SamplingSpec
from jaxrl_mismatch.rollout.session import RolloutSession, request_chunks
from jaxrl_mismatch.rollout.protocol import Limits

log = logging.getLogger(__name__)


class NoServerLeftError(RolloutError):
    """No rollout server of the fleet can serve the step (all dead, stalled or behind)."""


class PieceFailedError(RolloutError):
    """One piece of a step failed on `PIECE_FAILURES` different servers: the request is the likely cause."""


# Two servers failing the same piece (and no other) point at the request: a third try would most likely take a
# third server down, and so on until NoServerLeftError hid the cause behind "no server left".
PIECE_FAILURES = 2


def token_pieces(prompts: Sequence[Sequence[int]], spec: SamplingSpec, limits: Limits, parts: int) -> list[slice]:
    """Contiguous prompt ranges of about equal token cost, about `parts` of them, each within `limits`.

    Cost of a prompt: its tokens plus the n × max_tokens it asks for (what a server spends on it).
    """
    if not prompts:
        return []
    cost = np.array([len(p) + spec.n * spec.max_tokens for p in prompts], np.float64)
    bounds = np.cumsum(cost)
    pieces, start = [], 0
    for k in range(1, max(1, parts) + 1):
        # the prompt at which the cumulative cost first reaches k/parts of the total ends piece k
        end = len(prompts) if k == parts else int(np.searchsorted(bounds, bounds[-1] * k / parts, side="left")) + 1
        end = min(max(end, start + 1), len(prompts))
        if end > start:
            pieces += [slice(start + c.start, start + c.stop) for c in request_chunks(prompts[start:end], spec, limits)]
            start = end
    return pieces


@dataclasses.dataclass(eq=False)
class _Member:
    session: RolloutSession
    make_client: Callable[[], RolloutClient]
    up: bool = True
    served: int | None = None  # the fleet version this server serves
    revival: cf.Future | None = None  # a background restart / reconnect in progress
    reviving: RolloutClient | None = None  # that revival's new client while it waits for the server
    failures: int = 0

    @property
    def name(self) -> str:
        return self.session.client.target


def _exited(m: _Member) -> bool:
    """A server the fleet launched whose process has exited (an attached one is never known to have)."""
    return m.session.server is not None and not m.session.server.alive()


class RolloutFleet:
    """See the module docstring. Build with `launch` (N managed servers) or `attach` (addresses)."""

    def __init__(self, members: list[_Member], *, start_version: int = 0, stall_timeout_s: float = 600.0,
                 ready_timeout_s: float = 600.0, restart: bool = True) -> None:
        self.members = members
        self.version = int(start_version)
        self.stall_timeout_s, self.ready_timeout_s, self.restart = stall_timeout_s, ready_timeout_s, restart
        self._weights: Mapping[str, np.ndarray] | None = None
        self._pool = cf.ThreadPoolExecutor(max_workers=4 * len(members), thread_name_prefix="fleet")
        self.failovers = 0  # pieces re-sent to another server
        self._closed = False
        self.limits = self._limits()
        self.server_check: Callable[[RolloutClient], None] | None = None

    @classmethod
    def launch(cls, num_servers: int, *, work_dir: str, timeout_s: float = 600.0, generate_timeout_s: float = 1800.0,
               ready_timeout_s: float = 600.0, restart: bool = True, start_version: int = 0,
               weight_transport: str = "auto", stall_timeout_s: float = 600.0, retry: RetryPolicy = RetryPolicy(),
               **server_options) -> RolloutFleet:
        """Start `num_servers` loopback servers in parallel (log and token of each in work_dir/rollout_server_k)."""
        def one(k: int) -> _Member:
            session = RolloutSession.launch(work_dir=os.path.join(work_dir, f"rollout_server_{k}"), timeout_s=timeout_s,
                                            generate_timeout_s=generate_timeout_s, ready_timeout_s=ready_timeout_s,
                                            restart=False, start_version=start_version,
                                            weight_transport=weight_transport, retry=retry, **server_options)
            server = session.server
            return _Member(session, lambda: RolloutClient(server.address, token=server.token, timeout_s=timeout_s,
                                                          generate_timeout_s=generate_timeout_s, wait_ready_s=None,
                                                          weight_transport=weight_transport, alive=server.alive,
                                                          retry=retry))
        with cf.ThreadPoolExecutor(num_servers) as pool:
            futures = [pool.submit(one, k) for k in range(num_servers)]
            members = []
            try:
                members = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    if f.exception() is None:
                        f.result().session.close()
                raise
        return cls(members, start_version=start_version, stall_timeout_s=stall_timeout_s,
                   ready_timeout_s=ready_timeout_s, restart=restart)

    @classmethod
    def attach(cls, addresses: Sequence[str], *, token: str | None, timeout_s: float = 600.0,
               generate_timeout_s: float = 1800.0, ready_timeout_s: float = 600.0, start_version: int = 0,
               weight_transport: str = "auto", stall_timeout_s: float = 600.0,
               retry: RetryPolicy = RetryPolicy()) -> RolloutFleet:
        """Use running servers (one shared token); each must be ready within `ready_timeout_s`."""
        members = []
        try:
            for address in addresses:
                session = RolloutSession.attach(address, token=token, timeout_s=timeout_s,
                                                generate_timeout_s=generate_timeout_s, ready_timeout_s=ready_timeout_s,
                                                start_version=start_version, weight_transport=weight_transport,
                                                retry=retry)
                members.append(_Member(session, lambda a=address: RolloutClient(
                    a, token=token, timeout_s=timeout_s, generate_timeout_s=generate_timeout_s, wait_ready_s=None,
                    weight_transport=weight_transport, retry=retry)))
        except BaseException:
            for m in members:
                m.session.close()
            raise
        return cls(members, start_version=start_version, stall_timeout_s=stall_timeout_s,
                   ready_timeout_s=ready_timeout_s)

    # -- the session surface ---------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        """What the first live server that answers serves (one that fails is taken down, the next is asked)."""
        while True:
            m = self._any_up()
            got = self._parallel([m], lambda m: m.session.info())[0]
            if got is not None:
                return got

    def infos(self) -> list[EngineInfo]:
        """What every live server serves (the trainer checks them all at start-up: a mixed fleet would mix μ). A
        failure is raised, not failed over: a server taken down here would be revived before the trainer has set
        its server check, and could rejoin unchecked."""
        return [m.session.info() for m in self.members if m.up] or [self._any_up().session.info()]

    def set_server_check(self, check: Callable[[RolloutClient], None] | None) -> None:
        """Run `check(client)` on every server that comes back (restarted, rejoining, or restarted by someone
        else) before it gets weights; one it refuses stays out of the fleet (tried again at the next push)."""
        self.server_check = check
        for m in self.members:
            m.session.set_server_check(check)

    def check_compatible(self, *, architecture: str, vocab_size: int, tokenizer_vocab_size: int | None = None) -> None:
        """Every server must serve the trainer's model (EngineMismatchError names the first that does not)."""
        for m in self.members:
            if m.up:
                m.session.check_compatible(architecture=architecture, vocab_size=vocab_size,
                                           tokenizer_vocab_size=tokenizer_vocab_size)

    def push(self, weights: Mapping[str, np.ndarray]) -> int:
        """Push `weights` to every server that is up or has come back, as the next fleet version; returns it."""
        self._weights = weights
        if not any(m.up for m in self.members) and self.restart:
            self._wait_revivals()  # nobody to push to yet: give restarts their chance first
        candidates = [m for m in self.members if m.up or self._revived(m)]
        if not candidates:
            raise NoServerLeftError(f"no rollout server left to push weights to ({self.describe()})")
        infos = self._parallel(candidates, lambda m: m.session.info().weight_version)
        # A member that failed GetInfo is down now (its client closed): it sits this push out and rejoins later.
        candidates = [m for m, v in zip(candidates, infos) if v is not None]
        if not candidates:
            raise NoServerLeftError(f"no rollout server answered before the push ({self.describe()})")
        version = max([self.version, *(v for v in infos if v is not None)]) + 1
        results = self._parallel(candidates, lambda m: m.session.push(weights, version, synced=True),
                                 what="UpdateWeights")
        ok = [m for m, r in zip(candidates, results) if r is not None]
        if not ok:
            raise NoServerLeftError(f"every rollout server failed the push of version {version} ({self.describe()})")
        for m in ok:
            if not m.up:
                log.warning("rollout server %s is back: pushed version %d, it rejoins the fleet", m.name, version)
            m.up, m.served, m.revival = True, version, None
        self.version = version
        self.limits = self._limits()
        return version

    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """`spec.n` completions per prompt, spread over the servers that serve the current version."""
        live = [m for m in self.members if m.up and m.served == self.version]
        if not live:
            raise NoServerLeftError(f"no rollout server serves weight version {self.version} ({self.describe()})")
        pieces = token_pieces(prompts, spec, self.limits, len(live))
        pending: deque[int] = deque(range(len(pieces)))
        results: dict[int, list[list[Completion]]] = {}
        inflight: dict[cf.Future, tuple[_Member, int, float]] = {}
        failed: dict[int, list[str]] = {}  # piece -> "server why" for each server it failed on
        idle = list(live)
        while len(results) < len(pieces):
            while pending and idle:
                m, i = idle.pop(0), pending.popleft()
                part = [list(p) for p in prompts[pieces[i]]]
                sub = dataclasses.replace(spec, prompt_offset=spec.prompt_offset + pieces[i].start)
                inflight[self._pool.submit(m.session.generate, part, sub)] = (m, i, time.monotonic())
            if not inflight:
                raise NoServerLeftError(
                    f"no rollout server left for this step: {len(pieces) - len(results)} of {len(pieces)} requests "
                    f"unanswered ({self.describe()})")
            done, _ = cf.wait(inflight, timeout=0.25, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                m, i, _ = inflight.pop(fut)
                try:
                    results[i] = fut.result()
                    idle.append(m)
                except RolloutError as e:
                    if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                        raise  # the request itself is bad: every server would refuse it
                    # a launched server's exit fails its call at once (the client's `alive`), before the poll below
                    self._fail(m, "died" if _exited(m) else f"failed ({e})", pieces[i], pending, i,
                               len(idle) + len(inflight), failed)
            now = time.monotonic()
            for fut, (m, i, t0) in list(inflight.items()):
                if fut.done():  # it finished after the wait (while a failure above was handled): the next wait has it
                    continue
                dead = _exited(m)
                if dead or now - t0 > self.stall_timeout_s:
                    del inflight[fut]  # its late answer, if any, is dropped
                    why = "died" if dead else f"stalled ({now - t0:.0f} s > stall_timeout_s {self.stall_timeout_s:g})"
                    self._fail(m, why, pieces[i], pending, i, len(idle) + len(inflight), failed)
        out: list[list[Completion]] = []
        for i in range(len(pieces)):
            out += results[i]
        return out

    def describe(self) -> str:
        """Each server's address and state, with its log for launched ones (for error messages)."""
        parts = []
        for m in self.members:
            where = f"log {m.session.server.log_path}" if m.session.server is not None else "external"
            state = ("up" if m.up else "down") + (f" ({m.failures} failure(s) so far)" if m.failures else "")
            parts.append(f"{m.name} {state}, {where}")
        return "rollout servers: " + "; ".join(parts)

    @property
    def restarts(self) -> int:
        return sum(m.session.restarts for m in self.members)

    def close(self) -> None:
        """Stop launched servers for good and close the clients, then wait for the revivals in progress: each ends
        at once instead of waiting out its server's start-up or readiness (`ManagedServer.close` stops a start in
        progress and refuses later ones; the revival's own client is closed, which ends its wait)."""
        self._closed = True
        for m in self.members:
            m.session.close()
            if m.reviving is not None:
                m.reviving.close()
        cf.wait([m.revival for m in self.members if m.revival is not None])
        self._pool.shutdown(wait=False, cancel_futures=True)
        for m in self.members:  # a revival that finished just before close() handed its session a new client
            m.session.client.close()

    def __enter__(self) -> RolloutFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- failure and recovery --------------------------------------------------------------------------
    def _fail(self, m: _Member, why: str, piece: slice, pending: deque, i: int, others: int,
              failed: dict[int, list[str]]) -> None:
        """Take `m` out of the fleet and start its revival; put its piece back at the head of the queue, or raise
        PieceFailedError if that piece has now failed on PIECE_FAILURES servers."""
        failed.setdefault(i, []).append(f"{m.name} {why}")
        self._take_down(m)
        if len(failed[i]) >= PIECE_FAILURES:
            hint = ("; if a request of this size can take that long, raise rollout.stall_timeout_s"
                    if all("stalled (" in w for w in failed[i]) else "")
            raise PieceFailedError(
                f"prompts {piece.start}-{piece.stop - 1} of this step failed on {len(failed[i])} rollout servers "
                f"({'; '.join(failed[i])}): the request, not the servers, is the likely cause, so it is not sent to "
                f"another{hint} ({self.describe()})")
        log.warning("rollout server %s %s during Generate: re-sending its %d unfinished prompt(s) %d-%d to the "
                    "%d other server(s)", m.name, why, piece.stop - piece.start, piece.start, piece.stop - 1, others)
        pending.appendleft(i)
        self.failovers += 1

    def _take_down(self, m: _Member) -> None:
        if not m.up:
            return
        m.up, m.served, m.failures = False, None, m.failures + 1
        m.session.client.close()  # an abandoned call on it fails now instead of at its deadline
        if m.session.server is not None and m.session.server.alive():
            m.session.server.stop(grace_s=1.0)  # stalled: it cannot be trusted to finish or to stop by itself
        if self.restart or m.session.server is None:
            m.revival = self._pool.submit(self._revive, m)

    def _revive(self, m: _Member) -> None:
        """Restart a launched server (or wait for an attached one), with a fresh client; raises if it stays down."""
        server = m.session.server
        if self._closed:
            raise RolloutError("the fleet is closed")
        if server is not None:
            server.start()  # raises at once if close() stops it meanwhile
        client = m.reviving = m.make_client()
        try:
            if self._closed:  # closed before `reviving` was set: close() did not see this client
                raise RolloutError("the fleet is closed")
            client.wait_until_ready(self.ready_timeout_s if server is not None else 5.0)
            client.info()
            if self.server_check is not None:
                self.server_check(client)
        except BaseException as e:
            client.close()
            if server is not None:  # not ready, or refused: the next revival starts it afresh, not reuses it
                server.stop(grace_s=1.0)
            if self._closed and not isinstance(e, RolloutError):  # its client closed under it (ValueError)
                raise RolloutError("the fleet is closed") from e
            raise
        finally:
            m.reviving = None
        m.session.client = client
        m.session.limits = client.current_limits()  # an attached server may come back with other limits

    def _revived(self, m: _Member) -> bool:
        if m.revival is None:
            if self.restart or m.session.server is None:
                m.revival = self._pool.submit(self._revive, m)
            return False
        if not m.revival.done():
            return False
        if m.revival.exception() is not None:
            log.warning("rollout server %s is still down: %s", m.name, m.revival.exception())
            m.revival = None  # try again at the next push
            return False
        return True

    def _wait_revivals(self) -> None:
        for m in self.members:
            if not m.up and m.revival is None:
                self._revived(m)
        pending = [m.revival for m in self.members if m.revival is not None]
        cf.wait(pending, timeout=self.ready_timeout_s)

    def _parallel(self, members: list[_Member], call: Callable[[_Member], object], what: str = "GetInfo") -> list:
        """call(m) for each member in parallel; a member whose call fails is taken down (result None). Not bounded
        here: a push also casts, may fall back from shared memory to the stream or re-push after a server restart,
        each with its own deadline, so a fleet-wide limit would take down servers a lone session keeps."""
        futures = [self._pool.submit(call, m) for m in members]
        out = []
        for m, f in zip(members, futures):
            try:
                out.append(f.result())
            except Exception as e:  # noqa: BLE001 - any failure of one member's call (gRPC raises ValueError on a
                # closed channel) is that member's: it sits the step out, the fleet goes on without it
                why = str(e) if isinstance(e, RolloutError) else f"{type(e).__name__}: {e}"
                log.warning("rollout server %s failed %s (%s); it sits this step out", m.name, what, why)
                m.up = True  # so that _take_down applies
                self._take_down(m)
                out.append(None)
        return out

    def _any_up(self) -> _Member:
        for m in self.members:
            if m.up:
                return m
        raise NoServerLeftError(f"no rollout server is up ({self.describe()})")

    def _limits(self) -> Limits:
        """The strictest request limits of the servers (a piece must fit whichever server takes it)."""
        limits = [m.session.limits for m in self.members]
        return Limits(max_request_prompt_tokens=min(x.max_request_prompt_tokens for x in limits),
                      max_request_completion_tokens=min(x.max_request_completion_tokens for x in limits),
                      routing_bytes_per_token=max(x.routing_bytes_per_token for x in limits))
