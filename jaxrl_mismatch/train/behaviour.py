"""π_behav: the trainer's own log-probs at the weight version a stale sample was generated with.

Asynchronous rollouts (`rollout.max_staleness` = s) train on samples up to s versions old. To split the
step's mismatch into staleness and precision (`metrics/staleness.py`) the trainer scores each lagged row
with the weights it had at that row's version, so it keeps the parameters of the last s + 1 pushed versions
(s + 1 copies of the policy's parameters besides the live ones, on the devices, sharded like them: the
current version's copy is what its rows will need once the update has moved the live weights on). Rows are
scored by the same forward as π_prox, over the engine's top-k/top-p support when it truncated: the
batch-invariant exact scorer in `rollout.exact` mode (then π_behav equals μ bit for bit, unless the engine
serves quantized weights or injects noise: that difference is the precision part), else the trainer's
teacher-forced forward.

One forward per distinct lag ℓ > 0, over the rows with that lag only (`train/row_scoring.py`): a batch
with lags 0/1/2 in thirds costs two forwards of a third of the batch, not two of the whole batch. Rows with
lag 0 are not scored at all: their sample version is the current one, so π_behav = π_prox, which `prepare`
computes anyway (`metrics/staleness.py` reads π_prox there). These forwards stay outside `prepare`'s jitted
call: each lag has its own weights and the set of lags varies per step, so one program would compile per
combination of lags and packed shapes (docs/rollout.md, "Cost").

A mixture-of-experts policy's forward also returns what its routers chose at the row's version (π_behav's
routing), which splits the `moe/router_disagree_*` metrics the same way (`metrics/moe.py`); exact mode's
scorer returns no routing.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


class BehaviourScorer:
    """Keeps the parameters of recent weight versions and scores lagged rows with them."""

    def __init__(self, max_staleness: int, score: Callable[[Any, Any, np.ndarray], Any]) -> None:
        self.s = int(max_staleness)
        # (params, batch, rows [B] bool) -> [B, S-1] host log-probs of `rows` (masked), or, for a MoE policy,
        # (those log-probs, [B, S-1, L, k] the routers' own top-k over the inputs): 0 in the other rows
        self._score = score
        self._params: dict[int, Any] = {}
        self.version: int | None = None  # the current (latest pushed) version

    def remember(self, version: int, params: Any) -> None:
        """The weights now served as `version` (a copy: the update donates the live state)."""
        self.version = int(version)
        if self.s > 0 and version not in self._params:
            self._params[self.version] = jax.tree.map(jnp.copy, params)
        for v in [v for v in self._params if v < self.version - self.s]:
            del self._params[v]

    def behav_logp(self, batch) -> np.ndarray | None:
        """[B, S-1] log π_behav of the rows with `version_lag` > 0 (0 elsewhere); None when no row is lagged."""
        scored = self.behaviour(batch)
        return None if scored is None else scored[0]

    def behaviour(self, batch) -> tuple[np.ndarray, np.ndarray | None] | None:
        """(log π_behav as `behav_logp`, the routers' top-k at each row's version `[B, S-1, L, k]` or None when
        the scorer returns no routing); None when no row is lagged.

        A lag with no kept version (cannot happen within the bound) raises naming it."""
        lag = None if batch.version_lag is None else np.asarray(batch.version_lag)
        if lag is None or not np.any(lag > 0):
            return None
        logp, routing = np.zeros(np.shape(batch.rollout_logp), np.float32), None
        for ell in np.unique(lag[lag > 0]):
            v = self.version - int(ell)
            if v not in self._params:
                raise ValueError(f"version_lag: rows {ell} versions behind (version {v}) but only versions "
                                 f"{sorted(self._params)} are kept (rollout.max_staleness = {self.s})")
            rows = lag == ell
            got = self._score(self._params[v], batch, rows)
            lp, ids = got if isinstance(got, tuple) else (got, None)
            logp[rows] = np.asarray(lp, np.float32)[rows]
            if ids is not None:
                ids = np.asarray(ids)
                if routing is None:
                    routing = np.zeros(ids.shape, ids.dtype)
                routing[rows] = ids[rows]
        return logp, routing
