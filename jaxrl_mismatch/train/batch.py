"""`RolloutBatch`: the one batch type from rollouts to the jitted step.

Layout (leading dim B = prompts × group size, sharded over ("data", "fsdp"); S = bucketed length):

    tokens          int32 [B, S]    prompt + response, right padded (`data.batching.pad_rows`)
    attention_mask  int32 [B, S]    1 on real tokens
    response_mask   f32   [B, S-1]  1 where targets = tokens[:, 1:] is a response token
    advantages      f32   [B, S-1]  per-token advantage (the sequence advantage broadcast over its tokens)
    rollout_logp    f32   [B, S-1]  log μ(y_t | θ_old), from the rollout engine
    old_logp        f32   [B, S-1]  log π(y_t | θ_old): filled by `Learner.prepare` (the θ_old forward)
    ref_logp        f32   [B, S-1]  reference policy, only with a KL penalty
    token_weight    f32   [B, S-1]  objective-hacking diagnostics φ (eq. 18) × ξ (eq. 21), only when on

The optional fields are None when absent; a pytree with None fields has no leaves there, so jit sees a
fixed structure per run. The fields without a default are what the rollout produces: multi-host
broadcast sends exactly those (`ROLLOUT_FIELDS`), every process then computes the rest itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.struct
import jax
import numpy as np
from jaxtyping import Array, Float, Int

from jaxrl_mismatch.data.batching import pad_rows

Rows = Any  # numpy index / slice of rows


@flax.struct.dataclass
class RolloutBatch:
    tokens: Int[Array, "b s"]
    attention_mask: Int[Array, "b s"]
    response_mask: Float[Array, "b t"]
    advantages: Float[Array, "b t"]
    rollout_logp: Float[Array, "b t"]
    old_logp: Float[Array, "b t"] | None = None
    ref_logp: Float[Array, "b t"] | None = None
    token_weight: Float[Array, "b t"] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def rows(self, idx: Rows) -> RolloutBatch:
        """The batch restricted to rows `idx` (host arrays)."""
        return jax.tree.map(lambda x: x[idx], self)

    def arrays(self) -> dict[str, Any]:
        """The present fields by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


ROLLOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RolloutBatch)
                                        if f.default is dataclasses.MISSING)


def from_completions(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                     rollout_logp: Sequence[Sequence[float]], seq_advantages: np.ndarray, *,
                     pad_id: int) -> RolloutBatch:
    """Host batch of one row per completion; `seq_advantages[i]` is broadcast over row i's response tokens."""
    rows = pad_rows(prompt_ids, completion_ids, rollout_logp, pad_id=pad_id)
    adv = np.asarray(seq_advantages, np.float32)[:, None] * rows.response_mask
    return RolloutBatch(tokens=rows.tokens, attention_mask=rows.attention_mask, response_mask=rows.response_mask,
                        advantages=adv.astype(np.float32), rollout_logp=rows.rollout_logp)
