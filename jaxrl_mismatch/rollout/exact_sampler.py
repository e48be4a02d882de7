"""Sampling in exact mode and with injected mismatch: the parts of the built-in engine that make μ what
an experiment says it is.

Exact mode (`SamplingSpec.exact`): each row is generated alone at its canonical length
(`models.exact.canonical_length`), and token t is drawn from `models.exact.next_token_logprobs` — the very
computation the trainer's exact scorer runs for that position — so the returned μ equals the trainer's
π(θ_old) bit for bit, and a row's tokens do not depend on the other rows of the request. Each sampled token
costs a full forward of its row (no KV cache); benchmarks/exact_engine.py measures the price.

Injected mismatch (`SamplingSpec.logit_noise_std` = σ): tokens are drawn from
μ = softmax((z + σ·ε) / T), ε ~ N(0, 1) i.i.d. per vocabulary entry and step, and μ's log-prob is returned,
so the tokens themselves come from μ ≠ π (the VeXact review's "mismatch re-introduced at a controlled
scale"). `perturb` is shared by the normal and the exact sampler.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxrl_mismatch.models import kv_cache
from jaxrl_mismatch.models.exact import canonical_length, next_token_logprobs
from jaxrl_mismatch.rollout.sampling import row_keys

_NOISE_TAG = 0x6E6F6973  # folded into a step's key for the noise draw, so the categorical draw is unchanged


def perturb(logp_all: Float[Array, "... vocab"], step_key: jax.Array, sigma, temperature
            ) -> Float[Array, "... vocab"]:
    """log softmax((z + σ·ε) / T) given log softmax(z / T); ε ~ N(0, 1) from `step_key` (one key per row)."""
    def noise(k):
        return jax.random.normal(jax.random.fold_in(k, _NOISE_TAG), logp_all.shape[-1:], jnp.float32)

    eps = noise(step_key) if logp_all.ndim == 1 else jax.vmap(noise)(step_key)
    return jax.nn.log_softmax(logp_all + (sigma / temperature) * eps, axis=-1)


def sample_exact(graphdef: nnx.GraphDef, params, rest, prompts: list[list[int]], rows: list[tuple[int, int]],
                 *, max_tokens: int, temperature: float, logit_noise_std: float, stop_token_ids: tuple[int, ...],
                 base_key: np.ndarray, stop_slots: int, prompt_offset: int = 0
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [R, max_tokens], log μ [R, max_tokens], lengths [R], stopped [R]) of rows (prompt i, sample j).

    Rows are grouped by canonical length; each group runs in one jitted program whose row count is padded
    to a power of two with rows that stop at once.
    """
    n = len(rows)
    tokens = np.zeros((n, max_tokens), np.int32)
    logps = np.zeros((n, max_tokens), np.float32)
    lengths = np.zeros((n,), np.int32)
    stopped = np.zeros((n,), bool)
    stop = np.full((stop_slots,), -1, np.int32)
    stop[: len(stop_token_ids)] = stop_token_ids
    by_length: dict[int, list[int]] = {}
    for r, (i, _) in enumerate(rows):
        by_length.setdefault(canonical_length(len(prompts[i]), max_tokens), []).append(r)
    for length, members in sorted(by_length.items()):
        padded = kv_cache.bucket(len(members))
        ids = np.zeros((padded, length), np.int32)
        n_prompt = np.ones((padded,), np.int32)
        limit = np.zeros((padded,), np.int32)  # padding rows sample nothing
        prompt_idx = np.zeros((padded,), np.int32)
        sample_idx = np.zeros((padded,), np.int32)
        for k, r in enumerate(members):
            i, j = rows[r]
            ids[k, : len(prompts[i])] = prompts[i]
            n_prompt[k], limit[k], prompt_idx[k], sample_idx[k] = len(prompts[i]), max_tokens, prompt_offset + i, j
        out = _exact_program(graphdef, params, rest, jnp.asarray(ids), jnp.asarray(n_prompt), jnp.asarray(limit),
                             base_key, jnp.asarray(prompt_idx), jnp.asarray(sample_idx), np.float32(temperature),
                             np.float32(logit_noise_std), jnp.asarray(stop), new_len=max_tokens,
                             inject=logit_noise_std > 0)
        t, lp, nt, done = jax.device_get(out)
        k = len(members)
        tokens[members], logps[members], lengths[members], stopped[members] = t[:k], lp[:k], nt[:k], done[:k]
    return tokens, logps, lengths, stopped


@functools.partial(jax.jit, static_argnames=("graphdef", "new_len", "inject"))
def _exact_program(graphdef, params, rest, ids: Int[Array, "rows length"], n_prompt: Int[Array, " rows"],
                   limit: Int[Array, " rows"], base_key, prompt_idx, sample_idx, temperature, sigma,
                   stop_ids: Int[Array, " stops"], *, new_len: int, inject: bool):
    model = nnx.merge(graphdef, params, rest)
    keys = row_keys(base_key, prompt_idx, sample_idx)

    def one_row(args):
        row, p, lim, row_key = args

        def cond(c):
            t, _, _, _, _, done = c
            return (t < lim) & ~done

        def body(c):
            t, row, n, toks, lps, done = c
            logp_all = next_token_logprobs(model, row, n, temperature)
            step_key = jax.random.fold_in(row_key, t)
            if inject:
                logp_all = perturb(logp_all, step_key, sigma, temperature)
            tok = jax.random.categorical(step_key, logp_all).astype(jnp.int32)
            row = jax.lax.dynamic_update_index_in_dim(row, tok, n, axis=0)
            toks = toks.at[t].set(tok)
            lps = lps.at[t].set(logp_all[tok])
            return t + 1, row, n + 1, toks, lps, jnp.any(tok == stop_ids)

        init = (jnp.zeros((), jnp.int32), row, p, jnp.zeros((new_len,), jnp.int32),
                jnp.zeros((new_len,), jnp.float32), jnp.zeros((), bool))
        t, _, _, toks, lps, done = jax.lax.while_loop(cond, body, init)
        return toks, lps, t, done

    return jax.lax.map(one_row, (ids, n_prompt, limit, keys))
