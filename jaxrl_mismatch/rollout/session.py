"""`RolloutSession`: the trainer's one handle on rollouts — server, client, token, weight versions, recovery.

A session either launches a loopback server (`launch`) or attaches to a running one (`attach`); after
that its caller sees only `generate(prompts, spec)`, `push(weights) -> version`, `limits` and `close()`.
The one recovery policy lives here:

- the client retries transient transport errors (UNAVAILABLE, DEADLINE_EXCEEDED) itself;
- a server that restarted (by its supervisor, or by us) lost the pushed weights: the session pushes the
  last weights again, under the same version, and repeats the call;
- a launched server that died is restarted once per failed call on the same port (if `restart`), then
  as above; an attached server that stays down raises `RolloutError` to the caller.

Weight versions are counted here only: each push takes one above both the last pushed version and the
version the server serves (a reused external server may hold a previous run's weights at a higher one).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import grpc
import numpy as np

from jaxrl_mismatch.rollout.client import RetryPolicy, RolloutClient, RolloutError, ServerRestartedError
from jaxrl_mismatch.rollout.engine import Completion, EngineInfo, SamplingSpec
from jaxrl_mismatch.rollout.launcher import ManagedServer
from jaxrl_mismatch.rollout.protocol import MAX_MESSAGE_BYTES, RESPONSE_OVERHEAD_BYTES, Limits, prompt_response_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")


def request_chunks(prompt_ids: Sequence[Sequence[int]], spec: SamplingSpec, limits: Limits) -> list[slice]:
    """Consecutive prompt ranges whose Generate requests stay within the server's per-request limits.

    A real run asks for more than one request may carry (64 prompts × 16 samples × 8192 tokens is 8.4M
    completion tokens, over the default 4M and over gRPC's 64 MiB message size; with a MoE engine's routing,
    the response outgrows 64 MiB long before the token limits: `protocol.response_bytes_bound`).
    """
    per_prompt = spec.n * spec.max_tokens
    if per_prompt > limits.max_request_completion_tokens:
        raise ValueError(f"one prompt asks for n × max_tokens = {per_prompt} completion tokens, over the request "
                         f"limit {limits.max_request_completion_tokens}; lower rollout.group_size or max_tokens")
    # The response must fit the transport too (`protocol.response_bytes_bound`; a MoE engine's routing repeats
    # each prompt's expert ids in all n samples).
    budget = MAX_MESSAGE_BYTES - RESPONSE_OVERHEAD_BYTES
    chunks, start, completion, prompt, size = [], 0, 0, 0, 0
    for i, p in enumerate(prompt_ids):
        grow = prompt_response_bytes(len(p), spec, limits.routing_bytes_per_token)
        if grow > budget:
            raise ValueError(f"prompt {i}: its n = {spec.n} samples' response could reach {grow} bytes, over the "
                             f"{MAX_MESSAGE_BYTES}-byte message limit; lower rollout.group_size or max_tokens")
        if i > start and (completion + per_prompt > limits.max_request_completion_tokens
                          or prompt + len(p) > limits.max_request_prompt_tokens or size + grow > budget):
            chunks.append(slice(start, i))
            start, completion, prompt, size = i, 0, 0, 0
        completion += per_prompt
        prompt += len(p)
        size += grow
    chunks.append(slice(start, len(prompt_ids)))
    return chunks


class RolloutSession:
    """See the module docstring. Build with `launch` or `attach`; close with `close()` (or `with`)."""

    def __init__(self, client: RolloutClient, *, server: ManagedServer | None = None, restart: bool = True,
                 ready_timeout_s: float = 600.0, start_version: int = 0) -> None:
        self.client, self.server = client, server
        self.restart, self.ready_timeout_s = restart, ready_timeout_s
        self.version = int(start_version)  # the last version pushed (or restored from a checkpoint)
        self._weights: Mapping[str, np.ndarray] | None = None
        self.limits: Limits = client.request_limits()
        self.restarts = 0  # server restarts this session has recovered from
        # Called with the client of a server that restarted (or was restarted) before the weights are pushed to
        # it again: the checks the trainer made at the start (model, quantization, ...), so a process that came
        # back serving something else is refused instead of fed into the batch (`set_server_check`).
        self.server_check: Callable[[RolloutClient], None] | None = None

    @classmethod
    def launch(cls, *, work_dir: str, engine: str, model: str, dtype: str, max_model_len: int = 0, quantize: str = "none",
               timeout_s: float = 600.0, generate_timeout_s: float = 1800.0, ready_timeout_s: float = 600.0,
               restart: bool = True, start_version: int = 0, weight_transport: str = "auto",
               retry: RetryPolicy = RetryPolicy()) -> RolloutSession:
        """Start `jaxrl-mismatch serve` on a free loopback port (log and token in `work_dir`)."""
        server = ManagedServer(work_dir, startup_timeout_s=ready_timeout_s, engine=engine, model=model, dtype=dtype,
                               max_model_len=max_model_len or None, quantize=quantize)
        target = server.start()
        client = None
        try:
            client = RolloutClient(target, token=server.token, timeout_s=timeout_s, generate_timeout_s=generate_timeout_s,
                                   wait_ready_s=ready_timeout_s, weight_transport=weight_transport,
                                   alive=server.alive, retry=retry)
            return cls(client, server=server, restart=restart, ready_timeout_s=ready_timeout_s,
                       start_version=start_version)
        except BaseException:
            if client is not None:
                client.close()
            server.stop()
            raise

    @classmethod
    def attach(cls, address: str, *, token: str | None, timeout_s: float = 600.0, generate_timeout_s: float = 1800.0,
               ready_timeout_s: float = 600.0, start_version: int = 0, weight_transport: str = "auto",
               retry: RetryPolicy = RetryPolicy()) -> RolloutSession:
        """Use a running server at `address` (pushes need its shared `token`)."""
        client = RolloutClient(address, token=token, timeout_s=timeout_s, generate_timeout_s=generate_timeout_s,
                               wait_ready_s=ready_timeout_s, weight_transport=weight_transport, retry=retry)
        try:
            return cls(client, restart=False, ready_timeout_s=ready_timeout_s, start_version=start_version)
        except BaseException:
            client.close()
            raise

    # -- the surface ---------------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        return self._recovering("GetInfo", self.client.info)

    def check_compatible(self, *, architecture: str, vocab_size: int, tokenizer_vocab_size: int | None = None) -> None:
        """EngineMismatchError naming both values if the engine serves another model than the trainer's."""
        self.client.check_compatible(architecture=architecture, vocab_size=vocab_size,
                                     tokenizer_vocab_size=tokenizer_vocab_size)

    def push(self, weights: Mapping[str, np.ndarray], version: int | None = None, *, synced: bool = False) -> int:
        """Push HF-named tensors as the next weight version (or as `version`, a fleet's); returns it. The
        session keeps a reference to `weights` to re-push them after a server restart. One GetInfo per push:
        the one that reads the server's version also serves the push's sync (`synced`: the caller's `info()`
        just did)."""
        if version is None:
            version = max(self.version, self.info().weight_version) + 1
        elif not synced:
            self.client.info()
        if self.client.weights_lost:  # this GetInfo found a restarted server: checked before it gets weights
            log.warning("UpdateWeights: the rollout server %s restarted; checking it before the push",
                        self.client.target)
            self._returned()
        self._recovering("UpdateWeights", lambda: self.client.push_weights(weights, version, synced=True))
        self.version, self._weights = version, weights
        return version

    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """`spec.n` completions per prompt, in as few requests as the server's limits allow."""
        out: list[list[Completion]] = []
        for chunk in request_chunks(prompts, spec, self.limits):
            part = [list(p) for p in prompts[chunk]]
            # Each prompt keeps its place in the batch, so the split does not change what is sampled.
            sub = dataclasses.replace(spec, prompt_offset=spec.prompt_offset + chunk.start)
            out += self._recovering("Generate", lambda part=part, sub=sub: self._generate_within_limits(part, sub))
        return out

    def _generate_within_limits(self, prompts: list[list[int]], spec: SamplingSpec) -> list[list[Completion]]:
        """One request cut under the limits in force when it was cut, split again if they have since tightened (a
        server restarted with other limits, noticed by `_recovering`: its retry resent the oversized request)."""
        out: list[list[Completion]] = []
        for piece in request_chunks(prompts, spec, self.limits):
            sub = dataclasses.replace(spec, prompt_offset=spec.prompt_offset + piece.start)
            out += self.client.generate(prompts[piece], sub)
        return out

    def _restarted_unseen(self, e: RolloutError) -> bool:
        """Whether a refused call (INVALID_ARGUMENT) came from a server process this session has not seen yet: a
        restarted server refuses a request over its new limits before any Generate could report its new id, so
        without this GetInfo every later Generate was refused until the next push."""
        if e.code != grpc.StatusCode.INVALID_ARGUMENT:
            return False
        seen = self.client.server_id
        try:
            self.client.info()
        except RolloutError:
            return False
        return seen is not None and self.client.server_id != seen  # None: no id read yet (the first call)

    def set_server_check(self, check: Callable[[RolloutClient], None] | None) -> None:
        """Run `check(client)` on every server process that comes back (it raises a RolloutError to refuse it)."""
        self.server_check = check

    def describe(self) -> str:
        """Where to look when the server fails (for error messages)."""
        return f"server log {self.server.log_path}" if self.server is not None else f"server at {self.client.target}"

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.close()  # for good: a restart in progress elsewhere stops too

    def __enter__(self) -> RolloutSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- recovery ------------------------------------------------------------------------------------
    def _returned(self) -> None:
        """A server process that came back (restarted): counted, checked (`set_server_check`), and its request
        limits read again (a server restarted with tighter ones refused the next Generate's chunks)."""
        self.restarts += 1
        if self.server_check is not None:
            self.server_check(self.client)
        self.limits = self.client.current_limits()

    def _recovering(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, recovering once from a server restart or (launched server only) a server death."""
        try:
            return call()
        except ServerRestartedError:
            log.warning("%s: the rollout server restarted; pushing weights version %d again", what, self.version)
        except RolloutError as e:
            if self._restarted_unseen(e):
                log.warning("%s: refused by a restarted rollout server (%s); pushing weights version %d again",
                            what, e, self.version)
            elif self.server is None or not self.restart or self.server.alive():
                raise
            else:
                log.warning("rollout server died during %s (%s); restarting it on port %d", what, e, self.server.port)
                self.server.start()
                self.client.wait_until_ready(self.ready_timeout_s)
                self.client.info()  # notice the new server id now
        self._returned()
        if self._weights is not None:
            self.client.push_weights(self._weights, self.version)
        return call()
