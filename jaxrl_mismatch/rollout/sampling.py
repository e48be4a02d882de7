"""Temperature / top-k / top-p processing of logits, shared by the rollout engine and the trainer.

TRL #6789: with top-p or top-k an engine's log-probs are normalised over the kept tokens only, while a
trainer that recomputes log π over the full vocabulary gets a different quantity, so ρ = π/μ is biased
even with identical weights. We make the two sides comparable by construction: the JAX engine samples
from `processed_logprobs` and reports the sampled token's value and its kept-set size; the trainer
renormalises its own π over the same number of most likely tokens (`models.truncation`, inside the jitted
step). `token_logprobs_processed` is the same quantity rebuilt from settings alone — the reference the
tests hold an engine's processed log-probs to (vLLM, which returns no kept sets). With identical logits
the two are bitwise equal (same function, same mask), so any remaining difference is numerical mismatch,
not a definitional one. docs/rollout.md explains the choice.

The masks are defined by *value thresholds*, not by sort positions: top-k keeps every token whose scaled
logit is >= the k-th largest, top-p keeps every token whose scaled logit is >= the smallest logit of the
nucleus. Ties at the boundary are therefore all kept, and the mask is a function of the logit values
alone (independent of sort stability), which is what lets a trainer rebuild it from its own logits.

Order of operations (as vLLM and HF transformers): temperature, then top-k, then top-p on the top-k
renormalised distribution. A temperature below GREEDY_TEMPERATURE (vLLM's threshold, 0 included) means
greedy decoding: top_k = 1 at temperature 1, i.e. μ is the point mass on the arg-max, log-prob 0 (shared
equally by tokens tied exactly for the largest logit: the top-k mask keeps ties, as vLLM's does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxrl_mismatch.models.truncation import renormalise
from jaxrl_mismatch.rollout.validation import GREEDY_TEMPERATURE, is_greedy  # vLLM's _SAMPLING_EPS


def effective_settings(temperature, top_k, top_p):
    """(temperature, top_k, top_p) after mapping greedy temperatures to top_k=1 at temperature 1.

    Works on Python numbers and on traced scalars alike, so engine and trainer apply the same rule.
    """
    greedy = jnp.asarray(temperature, jnp.float32) < GREEDY_TEMPERATURE
    temperature = jnp.where(greedy, jnp.float32(1.0), jnp.asarray(temperature, jnp.float32))
    top_k = jnp.where(greedy, 1, jnp.asarray(top_k, jnp.int32))
    return temperature, top_k, jnp.asarray(top_p, jnp.float32)


def keep_mask(
    logits: Float[Array, "*batch vocab"],
    temperature: float | Float[Array, ""],
    top_k: int | Int[Array, ""],
    top_p: float | Float[Array, ""],
) -> Bool[Array, "*batch vocab"]:
    """Which tokens survive top-k and top-p, for scalar (possibly traced) settings.

    top_k <= 0 disables top-k; top_p >= 1 disables top-p. At least the arg-max token is always kept.
    """
    temperature, top_k, top_p = effective_settings(temperature, top_k, top_p)
    scaled = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1] + (1,)).astype(jnp.int32), axis=-1)
    kept_k_desc = desc >= kth
    probs_desc = jax.nn.softmax(jnp.where(kept_k_desc, desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs_desc, axis=-1) - probs_desc
    # top_p >= 1 must keep everything top-k kept, even where float rounding makes mass_before reach 1.
    kept_desc = kept_k_desc & ((mass_before < top_p) | (top_p >= 1.0))
    # The arg-max always: a top_p that is a float32 subnormal (accepted as "in (0, 1]") flushes to 0 on XLA:CPU,
    # and `0 < 0` kept nothing, so the row's log-probs were all -inf.
    kept_desc = kept_desc | jnp.broadcast_to(jnp.arange(vocab) == 0, kept_desc.shape)
    threshold = jnp.min(jnp.where(kept_desc, desc, jnp.inf), axis=-1, keepdims=True)
    return scaled >= threshold


def processed_logprobs(
    logits: Float[Array, "*batch vocab"],
    temperature: float | Float[Array, ""],
    top_k: int | Int[Array, ""] = 0,
    top_p: float | Float[Array, ""] = 1.0,
) -> Float[Array, "*batch vocab"]:
    """log μ over the vocabulary: log-softmax of logits/temperature renormalised over the kept tokens.

    Removed tokens get -inf. This is the distribution the JAX engine samples from.
    """
    keep = keep_mask(logits, temperature, top_k, top_p)
    scaled = logits.astype(jnp.float32) / effective_settings(temperature, top_k, top_p)[0]
    return renormalise(scaled, keep)


def token_logprobs_processed(
    logits: Float[Array, "*batch vocab"],
    targets: Int[Array, "*batch"],
    temperature: float | Float[Array, ""] = 1.0,
    top_k: int | Int[Array, ""] = 0,
    top_p: float | Float[Array, ""] = 1.0,
) -> Float[Array, "*batch"]:
    """log of `targets` under the processed distribution — the trainer-side twin of the engine's logprob.

    The target token is always counted as kept: the engine sampled it, so it was in the engine's kept
    set; if the trainer's own logits put it just outside its nucleus (a boundary case of numerical
    mismatch), the value stays finite and the difference shows up as mismatch instead of -inf. When the
    target is inside the trainer's kept set (always, for the engine itself) this equals
    `processed_logprobs(...)[targets]` exactly.
    """
    scaled = logits.astype(jnp.float32) / effective_settings(temperature, top_k, top_p)[0]
    is_target = jax.nn.one_hot(targets, scaled.shape[-1], dtype=jnp.bool_)
    keep = keep_mask(logits, temperature, top_k, top_p) | is_target
    logp = jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def truncate_logprobs(logp_all: Float[Array, "*batch vocab"], top_k, top_p
                      ) -> tuple[Float[Array, "*batch vocab"], Int[Array, "*batch"]]:
    """(log p renormalised over what top-k/top-p keep of p = exp(logp_all), kept-set size) — the exact
    sampler's truncation, defined on the distribution's own log-probs (temperature already applied).

    The kept set is always the `kept` most likely tokens (ties at the boundary all kept: a value threshold),
    so the size alone rebuilds it: `truncate_to_count(logp_all, kept)` gives the same bits."""
    keep = keep_mask(logp_all, 1.0, top_k, top_p)
    return renormalise(logp_all, keep), jnp.sum(keep, axis=-1).astype(jnp.int32)


def uses_filtering(top_k: int, top_p: float, temperature: float = 1.0) -> bool:
    """Whether top-k/top-p (or greedy) change anything; the engine compiles a sort-free path otherwise."""
    return top_k > 0 or top_p < 1.0 or is_greedy(temperature)


def row_keys(base_key: Int[Array, " 2"], prompt_idx: Int[Array, " rows"], sample_idx: Int[Array, " rows"]):
    """The PRNG key of each row (prompt i, sample j): fold_in(fold_in(key(base_key), i), j). Every sampler (the
    engine's, the exact one and its speculative draft) derives its randomness here, so all draw the same bits."""
    key = jax.random.wrap_key_data(base_key, impl="threefry2x32")
    return jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(key, i), j))(prompt_idx, sample_idx)
