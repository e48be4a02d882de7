"""Fast exact sampling: draft with the KV cache, verify with the exact scorer, keep the scorer's bits.

Why: the reference exact sampler (`exact_sampler.sample_exact`) runs a full forward of the row per
sampled token, which made exact mode ~55x slower than the KV-cache sampler. Speculative decoding
(Leviathan et al. 2023; Chen et al. 2023) accepts a cheap draft where the target model agrees; here the
"target" is the batch-invariant exact program (`models.exact`) and the acceptance test is *deterministic*:
both samplers draw token t by Gumbel-max, `jax.random.categorical(fold_in(row_key, t), log p_t)`, with the
same per-position key (Gumbel-max coupling). Given the prefix, token t is therefore a fixed function of
the key and of the distribution; the draft (KV-cache decode) and the exact forward compute nearly the
same distribution, so they pick the same token unless their log-probs differ across a Gumbel decision
boundary.

Algorithm (per row, all rows of a request batched):
  1. Draft the rest of the row but its last token with the KV-cache sampler (batched prefill + decode)
     using the row's own step keys fold_in(row_key, t), from its first unsettled position t0.
  2. Verify: one exact forward of the row (`models.exact.row_hidden` at the row's canonical length, the
     LM head in `EXACT_CHUNK` chunks, exactly the scorer's program) gives, for every unsettled position, the
     token the exact sampler would draw there and its log-prob (the head and the draw skip the chunks of
     the prompt and of settled tokens; the trunk cannot: a position's bits come from the whole row's forward).
  3. Accept the longest draft prefix on which the exact token equals the draft token; at the first
     disagreement keep the exact token (its prefix is settled, so it is the reference sampler's token); if
     the whole draft agrees, also keep the exact token after it (the extra token of speculative decoding,
     Leviathan et al. 2023) — which is why step 1 drafts one token short of the budget.
     Repeat from 1 for rows not yet stopped.

Every returned token and log-prob comes from the exact forward (never from the draft), and causal
attention makes a position's exact forward independent of the tokens after it, so the output equals the
reference sampler's bit for bit (tests/rollout/test_spec_exact.py) and μ = π(θ_old) of the trainer's
exact scorer. Each round settles ≥ 1 token per row, so the loop ends; the draft only decides how many.

Top-k / top-p (issue 21, item 3): both sides truncate the same way, on the distribution's own log-probs
(`sampling.truncate_logprobs`), and the exact forward also returns each position's kept-set size, which the
trainer's exact scorer uses to renormalise π(θ_old) over the same support (`models.truncation`), bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxrl_mismatch.models import kv_cache
from jaxrl_mismatch.models.exact import EXACT_CHUNK, canonical_length, chunk_logprobs, row_hidden
from jaxrl_mismatch.rollout.exact_sampler import perturb
from jaxrl_mismatch.rollout.sampling import row_keys, truncate_logprobs


@dataclasses.dataclass
class SpecStats:
    """Counters of one or more speculative exact generations (benchmarks/exact_engine.py reports them).

    acceptance rate = accepted / verified: of the draft tokens the exact forward checked (each round: the
    accepted prefix plus the first rejected token), the fraction the exact sampler picked identically."""

    rounds: int = 0  # draft+verify rounds (the most any row needed, summed over calls)
    exact_forwards: int = 0  # row forwards of the exact program
    drafted: int = 0  # draft tokens produced
    verified: int = 0  # draft tokens compared with the exact sampler's choice
    accepted: int = 0  # draft tokens equal to the exact sampler's choice
    draft_s: float = 0.0  # wall seconds in the draft program (dispatch to results on the host)
    verify_s: float = 0.0  # wall seconds in the exact verify programs (dispatch to results on the host)
    total_s: float = 0.0  # wall seconds of the whole call; total − draft − verify is host work

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.verified)

    def add(self, other: "SpecStats") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


# The fewest rows a verify program is compiled for. Its padding rows cost nothing (`_verify_program` skips a
# row with n_valid = 0 under `lax.cond`), and the last rounds of a call and the groups of `_verify_parallel`
# have few rows each: without a floor every row count 1, 2, 4, … is a program of its own to compile (~1 s each
# for the test models on a CPU core; 28 → 15 verify compiles in tests/rollout/test_spec_exact.py).
VERIFY_MIN_ROWS = 8


def sample_exact_speculative(graphdef: nnx.GraphDef, params, rest, prompts: list[list[int]],
                             rows: list[tuple[int, int]], *, max_tokens: int, temperature: float,
                             logit_noise_std: float, stop_token_ids: tuple[int, ...], base_key: np.ndarray,
                             stop_slots: int, prompt_offset: int = 0, top_k: int = 0, top_p: float = 1.0,
                             verify_workers: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, SpecStats, np.ndarray | None]:
    """Same contract and same bits as `exact_sampler.sample_exact` (prompt i draws its randomness as prompt
    `prompt_offset + i`, as there), plus the draft/verify counters and, with top-k/top-p, each sampled token's
    kept-set size `[R, max_tokens]` (else None). `verify_workers` > 1 verifies that many groups of rows
    concurrently (`_verify_parallel`); the bits do not depend on it."""
    t_call = time.perf_counter()
    n = len(rows)
    filtering = top_k > 0 or top_p < 1.0
    trunc = dict(top_k=top_k, top_p=top_p, filtering=filtering)
    kept = np.zeros((n, max_tokens), np.int32)
    tokens = np.zeros((n, max_tokens), np.int32)
    logps = np.zeros((n, max_tokens), np.float32)
    settled = np.zeros((n,), np.int32)  # tokens of each row that equal the reference sampler's
    stopped = np.zeros((n,), bool)
    stop = np.full((stop_slots,), -1, np.int32)
    stop[: len(stop_token_ids)] = stop_token_ids
    stop_set = set(int(s) for s in stop_token_ids)
    prompt_of = np.array([i for i, _ in rows], np.int64)
    key_of = prompt_of + prompt_offset  # the prompt index the randomness is drawn for
    sample_of = np.array([j for _, j in rows], np.int64)
    canon = np.array([canonical_length(len(prompts[i]), max_tokens) for i, _ in rows], np.int64)
    stats = SpecStats()
    inject = logit_noise_std > 0
    active = np.arange(n)
    while active.size:
        stats.rounds += 1
        draft, draft_len = _draft(graphdef, params, rest, prompts, tokens, settled, active, prompt_of, key_of, sample_of,
                                  max_tokens=max_tokens, temperature=temperature, sigma=logit_noise_std,
                                  stop=stop, base_key=base_key, inject=inject, stats=stats, **trunc)
        stats.drafted += int(draft_len.sum())
        for length in np.unique(canon[active]):
            members = active[canon[active] == length]
            picks = np.flatnonzero(canon[active] == length)
            exact_tok, exact_lp, exact_kept = _verify_parallel(
                graphdef, params, rest, prompts, tokens, settled, members, prompt_of, key_of, sample_of, draft[picks],
                draft_len[picks], workers=verify_workers, stats=stats, length=int(length), temperature=temperature,
                sigma=logit_noise_std, base_key=base_key, inject=inject, **trunc)
            stats.exact_forwards += len(members)
            for k, r in enumerate(members):
                t0, p = int(settled[r]), len(prompts[prompt_of[r]])
                d = draft[picks[k], : draft_len[picks[k]]]
                # the exact token after each draft prefix: len(d) + 1 of them while the row has room (the
                # last one follows the whole draft: a token no draft proposed, Leviathan et al. 2023, §2.3)
                span = slice(p - 1 + t0, p - 1 + t0 + min(len(d) + 1, max_tokens - t0))
                e, lp = exact_tok[k, span], exact_lp[k, span]
                miss = np.flatnonzero(e[: len(d)] != d)
                keep = len(e) if miss.size == 0 else int(miss[0]) + 1  # through the first disagreement
                stats.verified += min(keep, len(d))
                stats.accepted += min(keep, len(d)) - (0 if miss.size == 0 else 1)
                tokens[r, t0: t0 + keep], logps[r, t0: t0 + keep] = e[:keep], lp[:keep]
                kept[r, t0: t0 + keep] = exact_kept[k, span][:keep]
                settled[r] = t0 + keep
                hit = [q for q in range(keep) if int(e[q]) in stop_set]
                if hit:  # the reference sampler stops at its first stop token
                    settled[r] = t0 + hit[0] + 1
                    stopped[r] = True
        active = active[(~stopped[active]) & (settled[active] < max_tokens)]
    stats.total_s = time.perf_counter() - t_call
    return tokens, logps, settled, stopped, stats, (kept if filtering else None)


def _draft(graphdef, params, rest, prompts, tokens, settled, active, prompt_of, key_of, sample_of, *, max_tokens,
           temperature, sigma, stop, base_key, inject, top_k, top_p, filtering, stats):
    """KV-cache draft of every active row from its first unsettled position (tokens [A, ≤max], lengths [A])."""
    a = len(active)
    if int(max_tokens - settled[active].min()) <= 1:  # every row has one token left: the verify's own
        return np.zeros((a, 0), np.int32), np.zeros((a,), np.int32)
    ctx = [list(prompts[prompt_of[r]]) + tokens[r, : settled[r]].tolist() for r in active]
    n_rows = kv_cache.bucket(a)
    ctx_len = kv_cache.bucket(max(len(c) for c in ctx), 16)
    new_len = kv_cache.bucket(int(max_tokens - settled[active].min() - 1), 16)
    # Rows with the same context (a prompt's samples in the first round) share one prefill; a draft only
    # proposes tokens, so this cannot change what the verify accepts as exact.
    ids, mask, row_src = kv_cache.prefill_inputs(ctx, batch=n_rows, width=ctx_len)
    t0 = np.zeros((n_rows,), np.int32)
    limit = np.zeros((n_rows,), np.int32)  # padding rows draft nothing
    pi = np.zeros((n_rows,), np.int32)
    sj = np.zeros((n_rows,), np.int32)
    for k, r in enumerate(active):
        # one token short of the budget: the verify supplies the row's last token itself
        t0[k], limit[k], pi[k], sj[k] = settled[r], max_tokens - settled[r] - 1, key_of[r], sample_of[r]
    t_start = time.perf_counter()
    out = _draft_program(graphdef, params, rest, jnp.asarray(ids), jnp.asarray(mask), base_key, jnp.asarray(pi),
                         jnp.asarray(sj), jnp.asarray(t0), jnp.asarray(limit), np.float32(temperature),
                         np.float32(sigma), jnp.asarray(stop), np.int32(top_k), np.float32(top_p),
                         None if row_src is None else jnp.asarray(row_src), new_len=new_len,
                         inject=inject, filtering=filtering)
    draft, lengths = jax.device_get(out)
    stats.draft_s += time.perf_counter() - t_start
    return draft[:a], lengths[:a]


@functools.partial(jax.jit, static_argnames=("graphdef", "new_len", "inject", "filtering"))
def _draft_program(graphdef, params, rest, ctx_ids: Int[Array, "prefill ctx"], ctx_mask: Int[Array, "prefill ctx"],
                   base_key, prompt_idx: Int[Array, " rows"], sample_idx: Int[Array, " rows"],
                   t0: Int[Array, " rows"], limit: Int[Array, " rows"], temperature, sigma,
                   stop_ids: Int[Array, " stops"], top_k, top_p, row_src: Int[Array, " rows"] | None = None,
                   *, new_len: int, inject: bool, filtering: bool
                   ) -> tuple[Int[Array, "rows new"], Int[Array, " rows"]]:
    """The KV-cache sampler with per-row step offsets: token s of row r uses key fold_in(row_key, t0_r + s),
    the key the exact sampler uses for response position t0_r + s. Stops at a stop id or `limit_r` tokens.
    `row_src`: the contexts are the distinct ones and row r decodes from a copy of context `row_src[r]`."""
    model = nnx.merge(graphdef, params, rest)
    ctx_len = ctx_ids.shape[1]
    cache = kv_cache.init_cache(model.cfg, ctx_ids.shape[0], ctx_len + new_len, model.policy.compute_dtype)
    logits, cache = kv_cache.prefill(model, ctx_ids, ctx_mask, cache)
    if row_src is not None:
        logits, cache = logits[row_src], kv_cache.select_rows(cache, row_src)
    keys = row_keys(base_key, prompt_idx, sample_idx)

    def pick(s, logits):
        logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
        step_keys = jax.vmap(jax.random.fold_in)(keys, t0 + s)
        if filtering:  # truncate, then perturb: the kept set is the clean distribution's, as the normal sampler's
            logp_all = truncate_logprobs(logp_all, top_k, top_p)[0]
        if inject:
            logp_all = perturb(logp_all, step_keys, sigma, temperature)
        return jax.vmap(jax.random.categorical)(step_keys, logp_all).astype(jnp.int32), {}

    toks, _, lengths, _ = kv_cache.decode_loop(model, logits, cache, pick, new_len=new_len, max_tokens=limit,
                                               stop_ids=stop_ids)
    return toks, lengths


MAX_VERIFY_WORKERS = 8  # threads of the verify pool; more workers than this queue on it
_POOL = ThreadPoolExecutor(max_workers=MAX_VERIFY_WORKERS, thread_name_prefix="exact-verify")


def verify_workers_default() -> int:
    """Concurrent verify programs for this process: its usable cores on a CPU backend (≤ `MAX_VERIFY_WORKERS`), else 1.

    Why: the verify computes each row alone (batch 1, `lax.map`), so its small matmuls leave all but one
    core idle, while the normal sampler's batched matmuls use every core (intra-op parallelism). Running
    groups of rows as separate executions on a thread pool (JAX releases the GIL while a program runs) gives
    the exact path the same cores: measured 0.172 → ~0.085 s per verify on 2 cores
    (benchmarks/exact_engine.py). On an accelerator concurrent executions share one device stream, so 1."""
    if jax.default_backend() != "cpu":
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_VERIFY_WORKERS, cores))


def _verify_parallel(graphdef, params, rest, prompts, tokens, settled, members, prompt_of, key_of, sample_of, draft,
                     draft_len, *, workers, stats, **kw):
    """`_verify` of `members` split into ≤ `workers` contiguous groups run concurrently, results in member order.

    Every row is computed alone by the same per-row program whatever the group's size (`lax.map` over rows),
    so the bits are those of one call over all members (tests/rollout/test_spec_exact.py)."""
    t_start = time.perf_counter()

    def group(g):
        return _verify(graphdef, params, rest, prompts, tokens, settled, members[g], prompt_of, key_of, sample_of,
                       draft[g], draft_len[g], **kw)

    groups = np.array_split(np.arange(len(members)), max(1, min(workers, len(members))))  # none empty
    outs = [group(groups[0])] if len(groups) == 1 else [f.result() for f in [_POOL.submit(group, g) for g in groups]]
    stats.verify_s += time.perf_counter() - t_start
    return tuple(np.concatenate([o[i] for o in outs]) for i in range(3))


def _verify(graphdef, params, rest, prompts, tokens, settled, members, prompt_of, key_of, sample_of, draft, draft_len, *,
            length, temperature, sigma, base_key, inject, top_k, top_p, filtering):
    """The exact sampler's token and log-prob at every position of each member row, given its draft."""
    m = len(members)
    padded = kv_cache.bucket(m, VERIFY_MIN_ROWS)
    ids = np.zeros((padded, length), np.int32)
    n_valid = np.zeros((padded,), np.int32)  # 0: a padding row, skipped
    n_prompt = np.ones((padded,), np.int32)
    first = np.zeros((padded,), np.int32)  # the first position whose next token is not settled yet
    pi = np.zeros((padded,), np.int32)
    sj = np.zeros((padded,), np.int32)
    for k, r in enumerate(members):
        p = prompts[prompt_of[r]]
        row = list(p) + tokens[r, : settled[r]].tolist() + draft[k, : draft_len[k]].tolist()
        ids[k, : len(row)], n_valid[k], n_prompt[k], pi[k], sj[k] = row, len(row), len(p), key_of[r], sample_of[r]
        first[k] = len(p) - 1 + settled[r]
    out = _verify_program(graphdef, params, rest, jnp.asarray(ids), jnp.asarray(n_valid), jnp.asarray(n_prompt),
                          jnp.asarray(first), base_key, jnp.asarray(pi), jnp.asarray(sj), np.float32(temperature),
                          np.float32(sigma),
                          np.int32(top_k), np.float32(top_p), inject=inject, filtering=filtering)
    tok, lp, kept = jax.device_get(out)
    return tok[:m], lp[:m], kept[:m]


@functools.partial(jax.jit, static_argnames=("graphdef", "inject", "filtering"))
def _verify_program(graphdef, params, rest, ids: Int[Array, "rows length"], n_valid: Int[Array, " rows"],
                    n_prompt: Int[Array, " rows"], first: Int[Array, " rows"], base_key, prompt_idx, sample_idx,
                    temperature, sigma, top_k, top_p, *, inject: bool, filtering: bool
                    ) -> tuple[Int[Array, "rows length"], Float[Array, "rows length"], Int[Array, "rows length"]]:
    """Per row (alone, `lax.map`) and per position p in [first, n_valid): the token the exact sampler draws
    after ids[:p+1] — categorical(fold_in(row_key, p + 1 − n_prompt), log π(· | ids[:p+1])) — and its log-prob
    (0 elsewhere). Row `p` of a head chunk is `models.exact.next_token_logprobs` for n_valid = p + 1, bit for bit.

    The trunk runs over the whole row (a position's bits come from the forward of the whole canonical row),
    but the LM head and the draw run only on the `EXACT_CHUNK` chunks that hold a wanted position: the
    prompt's and the settled tokens' chunks are skipped (with a real vocabulary the head is a large part of
    a position's cost)."""
    model = nnx.merge(graphdef, params, rest)
    keys = row_keys(base_key, prompt_idx, sample_idx)
    length = ids.shape[1]

    def one_row(args):
        row, n, p0, lo, row_key = args

        def run(_):
            hidden = row_hidden(model, row, n).reshape(length // EXACT_CHUNK, EXACT_CHUNK, -1)
            starts = jnp.arange(0, length, EXACT_CHUNK)

            def chunk(a):
                h, start = a
                return jax.lax.cond((start + EXACT_CHUNK > lo) & (start < n), head, skip_chunk, h, start)

            def skip_chunk(h, start):
                return (jnp.zeros((EXACT_CHUNK,), jnp.int32), jnp.zeros((EXACT_CHUNK,), jnp.float32),
                        jnp.zeros((EXACT_CHUNK,), jnp.int32))

            def head(h, start):
                logp_all = chunk_logprobs(model, h, temperature)
                t = jnp.maximum(start + jnp.arange(EXACT_CHUNK) + 1 - p0, 0)
                step_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(row_key, t)
                # Truncate, then perturb (as the draft and the normal sampler): the kept set, whose size the trainer
                # rebuilds π's support from, is the clean distribution's; the noise only moves mass inside it.
                kept = jnp.zeros((EXACT_CHUNK,), jnp.int32)
                if filtering:
                    logp_all, kept = truncate_logprobs(logp_all, top_k, top_p)
                if inject:
                    logp_all = jax.lax.map(lambda x: perturb(x[0], x[1], sigma, temperature), (logp_all, step_keys))
                tok = jax.vmap(jax.random.categorical)(step_keys, logp_all).astype(jnp.int32)
                return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0], kept

            tok, lp, kept = jax.lax.map(chunk, (hidden, starts))
            return tok.reshape(length), lp.reshape(length), kept.reshape(length)

        def skip(_):
            return (jnp.zeros((length,), jnp.int32), jnp.zeros((length,), jnp.float32),
                    jnp.zeros((length,), jnp.int32))

        return jax.lax.cond(n > 0, run, skip, None)

    return jax.lax.map(one_row, (ids, n_valid, n_prompt, first, keys))

