"""The update's log π(θ) valued by the exact scorer's batch-invariant program, with gradients.

Why: in exact mode (`rollout.exact`) μ equals π(θ_old) bit for bit because both come from
`models.exact` (every row alone, at its canonical length, LM head in fixed chunks). The ordinary update
computes π(θ) with the batched (or packed) forward, whose bits depend on the batch's shapes, so at
θ = θ_old the PPO ratio r_t = π(y_t|θ)/π(y_t|θ_old) (PPO, Schulman et al. 2017, eq. 6) was not exactly 1 in
bf16/fp16 and the first minibatch's clipping was already noise. Here the update runs, inside the jitted
step, the very per-row computation `models.exact.row_scores` runs — so at θ = θ_old every r_t is exactly 1
(`ppo/clip_frac` 0, ratio std 0) in fp32, bf16 and fp16.

Gradients: differentiating the per-row program makes XLA compile its forward together with the backward,
and that program's forward no longer has the scorer's bits (measured: 2.6e-6 apart in fp32). So the value
and the gradient are taken apart (`exact_valued`): log π = exact + (batched − stop_gradient(batched)), whose
value is the exact program's bits (x − x = 0 exactly for finite x) and whose gradient is the ordinary
batched forward's — the gradient of the same function of θ, differing only by rounding, at the cost of one
extra forward-only pass of the exact program per update (benchmarks/update_step.py).

A batch `[B, S]` holds rows of different canonical lengths (prompt + max_tokens rounded up on
`models.exact.canonical_length`'s ladder). The lengths a row of this batch can have are a short static list
(`candidate_lengths`: ≤ `LADDER_STEPS` per doubling of prompt + max_tokens, compiled once); each row picks its
own with `lax.switch` inside `lax.map` over rows (batch 1), and is sliced or zero-padded to it exactly as
`models.exact.score_exact` does on the host. Each candidate is one more whole-model forward to compile, so the
trainer bounds the prompt lengths by `task.max_prompt_len` (every prompt is checked against it at start-up):
with 8,192-token responses and prompts of ≤ 2,048 tokens (qwen3_4b's shapes), in the 16,384-token bucket such
rows are padded to, that is 1 candidate instead of 6 (up to 24,576 tokens, for prompts the run cannot have).
A longer row is refused on the host (`check_prompt_lengths`, in `Learner.prepare`); should one reach this
program anyway, its values are NaN rather than another length's bits. Microbatches split rows, which changes
nothing per row; packed rows would put several sequences in one forward and are refused (`train/config.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from jaxrl_mismatch.models.exact import canonical_length, prompt_lengths, row_scores
from jaxrl_mismatch.models.sharding import split_rows


def exact_valued(exact: Float[Array, "b t"], differentiable: Float[Array, "b t"]) -> Float[Array, "b t"]:
    """`exact`'s value (bit for bit) with `differentiable`'s gradient: exact + (d − stop_gradient(d))."""
    return jax.lax.stop_gradient(exact) + (differentiable - jax.lax.stop_gradient(differentiable))


class ExactForward(NamedTuple):
    """The update's exact forward (`trainer.exact_forward`): the scorer's graphdef (no remat), the rollout's
    `max_tokens`, the longest prompt a row can have (`task.max_prompt_len`; None: the batch width), and the
    trainer's mesh (a data-parallel one splits the rows over its devices, `models.sharding.split_rows`)."""
    graphdef: nnx.GraphDef
    max_tokens: int
    max_prompt_len: int | None = None
    mesh: Mesh | None = None


def candidate_lengths(seq_len: int, max_tokens: int, max_prompt_len: int | None = None) -> tuple[int, ...]:
    """Every canonical length a row of a `[B, seq_len]` batch can have (prompt lengths 1 … seq_len, or only up to
    `max_prompt_len` when prompts are known to be no longer)."""
    top = seq_len if max_prompt_len is None else max(1, min(seq_len, int(max_prompt_len)))
    return tuple(sorted({canonical_length(p, max_tokens) for p in range(1, top + 1)}))


def check_prompt_lengths(attention_mask: np.ndarray, response_mask: np.ndarray, max_prompt_len: int | None) -> None:
    """Refuse, on the host, a batch whose row has a longer prompt than `exact_forward_logprobs` was compiled for:
    inside jit such a row gets NaN log-probs (`exact_forward_logprobs`), a step skipped as non-finite instead of
    this error naming the bound."""
    if max_prompt_len is None:
        return
    p = prompt_lengths(attention_mask, response_mask)
    if np.any(p > max_prompt_len):
        r = int(np.argmax(p > max_prompt_len))
        raise ValueError(f"row {r}: its prompt has {int(p[r])} tokens > task.max_prompt_len={max_prompt_len}, the "
                         "longest the update's exact forward (trainer.exact_forward) is compiled for")


def exact_forward_logprobs(graphdef: nnx.GraphDef, params, tokens: Int[Array, "b s"], attention_mask: Int[Array, "b s"],
                           response_mask: Float[Array, "b t"], *, max_tokens: int, temperature: float | Array,
                           kept: Int[Array, "b t"] | None = None, max_prompt_len: int | None = None,
                           mesh: Mesh | None = None) -> tuple[Float[Array, "b t"], Float[Array, "b t"]]:
    """(log π(y_t), entropy) of every target `tokens[:, 1:]`, each row by the exact scorer's program.

    Equal bit for bit to `models.exact.score_exact(...)` on the response tokens (the scorer multiplies by the
    mask; here masked positions are left to the objective), with the same canonical length per row: the
    prompt length is the first response target's index + 1, or the row's length if it has no response.
    `max_prompt_len`: no row's prompt is longer (the caller checks, `check_prompt_lengths`), so only the
    canonical lengths such rows can have are compiled. `mesh`: on a data-parallel mesh each device scores its
    own rows (`jax.shard_map`); under plain jit the per-row loop would gather the batch and every device would
    score every row. A row's bits do not depend on which device computes it."""
    # The scorer and the samplers get T as a traced argument; a constant T here would let XLA turn x / T into
    # x · (1/T), other bits at T ≠ 1 (measured in fp32 at T = 0.7). The barrier keeps it a value like theirs.
    temperature = jax.lax.optimization_barrier(jnp.asarray(temperature, jnp.float32))
    b, s = tokens.shape
    lengths = candidate_lengths(s, max_tokens, max_prompt_len)
    n_valid = jnp.sum(attention_mask, axis=1).astype(jnp.int32)
    # The canonical length is the first candidate ≥ need (all are ≥ EXACT_CHUNK); the scorer's own rule.
    need = prompt_lengths(attention_mask, response_mask) + max_tokens
    branch = jnp.sum(jnp.asarray(lengths)[None, :] < need[:, None], axis=1).astype(jnp.int32)
    branch = jnp.minimum(branch, len(lengths) - 1)

    def rows(params, temperature, tokens, n_valid, branch, kept):
        model = nnx.merge(graphdef, params)

        def at_length(length: int):
            def run(row, n, k):
                ids = row[:length] if length <= s else jnp.pad(row, (0, length - s))
                if k is not None:
                    k = k[: length - 1] if length <= s else jnp.pad(k, (0, length - s))
                logp, ent = row_scores(model, ids, n, temperature, k, entropy=True)

                def fit(x):
                    return x[: s - 1] if length - 1 >= s - 1 else jnp.pad(x, (0, s - length))

                return fit(logp), fit(ent)
            return run

        branches = [at_length(length) for length in lengths]

        def one_row(args):
            row, n, b, k = args
            return jax.lax.switch(b, branches, row, n, k)

        return jax.lax.map(one_row, (tokens, n_valid, branch, kept))

    # each device its own rows, whole weights (a data-parallel mesh replicates them)
    rows = split_rows(rows, mesh, b, (False, False, True, True, True, True))
    logp, entropy = rows(params, temperature, tokens.astype(jnp.int32), n_valid, branch, kept)
    if max_prompt_len is None:  # every row's length is a candidate
        return logp, entropy
    over = (need > lengths[-1])[:, None]  # a row longer than the bound the program was compiled for
    return jnp.where(over, jnp.nan, logp), jnp.where(over, jnp.nan, entropy)
