"""Top-k / top-p truncation rebuilt from the kept-set size an engine returned: the trainer's side of
on-policy truncated sampling (issue 21; TRL #6789).

An engine sampling with top-k/top-p draws from p renormalised over a kept set; a trainer scoring log π over
the whole vocabulary compares another distribution, so ρ = π/μ is biased even with identical weights. The
engine returns, per sampled token, the size of its kept set; because that set is always the `kept` most
likely tokens (value threshold, ties at the boundary all kept: `rollout.sampling.keep_mask`), the size alone
rebuilds it from the trainer's own distribution, and the trainer renormalises π over the same support inside
its jitted step. With identical log-probs (exact mode) the renormalised values are bit for bit the engine's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def renormalise(logp_all: Float[Array, "*batch vocab"], keep: Bool[Array, "*batch vocab"]) -> Float[Array, "*batch vocab"]:
    """log p renormalised over `keep`, −inf elsewhere."""
    return jnp.where(keep, jax.nn.log_softmax(jnp.where(keep, logp_all, -jnp.inf), axis=-1), -jnp.inf)


def truncate_to_count(logp_all: Float[Array, "*batch vocab"], kept: Int[Array, "*batch"],
                      targets: Int[Array, "*batch"] | None = None) -> Float[Array, "*batch vocab"]:
    """log p renormalised over its `kept` largest entries (ties at the boundary kept; kept ≤ 0: no truncation).

    `targets` are always counted as kept (the engine sampled them; if the trainer's own ranking puts one just
    outside, the value stays finite and shows up as mismatch, as `rollout.sampling.token_logprobs_processed`)."""
    vocab = logp_all.shape[-1]
    desc = -jnp.sort(-logp_all, axis=-1)
    k = jnp.where(kept > 0, jnp.minimum(kept, vocab), vocab).astype(jnp.int32)
    kth = jnp.take_along_axis(desc, (k - 1)[..., None], axis=-1)
    keep = logp_all >= kth
    if targets is not None:
        keep = keep | jax.nn.one_hot(targets, vocab, dtype=jnp.bool_)
    return renormalise(logp_all, keep)


def truncated_entropy(logp: Float[Array, "*batch vocab"]) -> Float[Array, "*batch"]:
    """Entropy of a distribution whose removed entries are −inf."""
    return -jnp.sum(jnp.where(jnp.isfinite(logp), jnp.exp(logp) * logp, 0.0), axis=-1)
