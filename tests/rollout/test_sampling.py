"""sampling.py: the processed distribution μ that the engine samples from and the trainer rebuilds."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_mismatch.rollout.engine import Completion, NonFiniteLogprobsError, check_finite_logprobs
from jaxrl_mismatch.rollout.sampling import keep_mask, processed_logprobs, token_logprobs_processed


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Straightforward float64 reimplementation: temperature, top-k, then nucleus over what is left."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros_like(z, bool)
    k = len(z) if top_k <= 0 else min(top_k, len(z))
    keep[order[:k]] = True
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    mass = 0.0
    nucleus = np.zeros_like(keep)
    for idx in order[:k]:
        if mass >= top_p and top_p < 1.0:
            break
        nucleus[idx] = True
        mass += p[idx]
    zz = np.where(nucleus, z, -np.inf)
    return np.where(nucleus, zz - np.log(np.sum(np.exp(zz[nucleus] - zz[nucleus].max()))) - zz[nucleus].max(), -np.inf)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 12, 0.6),
                                                         (1.0, 1, 1.0), (1.0, 0, 1e-6)])
def test_matches_reference(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(0, 3, (6, 50)).astype(np.float32)
    got = np.asarray(processed_logprobs(jnp.asarray(logits), temperature, top_k, top_p))
    for row, g in zip(logits, got):
        ref = reference(row, temperature, top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(ref))
        np.testing.assert_allclose(g[np.isfinite(g)], ref[np.isfinite(ref)], atol=2e-6)
        assert np.isclose(np.exp(g[np.isfinite(g)]).sum(), 1.0, atol=1e-5)
    if top_k == 1 or top_p == 1e-6:  # greedy: a point mass, log-prob 0
        assert np.all(np.isfinite(got).sum(-1) == 1) and np.all(got.max(-1) == 0)


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_temperatures_are_a_point_mass_on_the_argmax(temperature):
    logits = jnp.asarray(np.random.default_rng(4).normal(0, 3, (5, 40)).astype(np.float32))
    lp = np.asarray(processed_logprobs(logits, temperature, 0, 1.0))
    assert np.all(np.isfinite(lp).sum(-1) == 1)
    np.testing.assert_array_equal(lp.argmax(-1), np.asarray(jnp.argmax(logits, -1)))
    assert np.all(lp.max(-1) == 0.0)


def test_ties_at_the_boundary_are_all_kept():
    logits = jnp.array([[3.0, 1.0, 1.0, 1.0, 0.0]])
    assert keep_mask(logits, 1.0, 2, 1.0).tolist() == [[True, True, True, True, False]]
    # greedy with an exact tie for the largest logit: both kept, log ½ each (as vLLM's top-k; docs/rollout.md)
    lp = np.asarray(processed_logprobs(jnp.array([[2.0, 3.0, 3.0, 1.0]]), 0.0, 0, 1.0))
    np.testing.assert_allclose(lp[0, 1:3], np.log(0.5), rtol=1e-6)
    assert np.isneginf(lp[0, [0, 3]]).all()


def test_trainer_side_token_logprob():
    logits = jnp.asarray(np.random.default_rng(1).normal(0, 3, (4, 30)).astype(np.float32))
    full = processed_logprobs(logits, 0.8, 6, 0.9)
    kept_target = jnp.argmax(logits, axis=-1)
    got = token_logprobs_processed(logits, kept_target, 0.8, 6, 0.9)
    # bitwise: same function, same mask, whenever the target is in the kept set (always, for the engine)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.take_along_axis(full, kept_target[:, None], -1)[:, 0]))
    # a target just outside the trainer's own nucleus stays finite instead of -inf
    dropped = jnp.argmin(logits, axis=-1)
    assert bool(jnp.all(jnp.isfinite(token_logprobs_processed(logits, dropped, 0.8, 6, 0.9))))
    # jit with traced settings: one trace for many values
    traces = []

    @jax.jit
    def f(lg, t, temp, k, p):
        traces.append(1)
        return token_logprobs_processed(lg, t, temp, k, p)

    for temp, k, p in [(0.5, 3, 0.9), (1.0, 0, 1.0), (1.5, 10, 0.5)]:
        f(logits, kept_target, np.float32(temp), np.int32(k), np.float32(p))
    assert len(traces) == 1


def test_check_finite_logprobs_names_the_position():
    ok = Completion(token_ids=[1, 2], logprobs=[-1.0, -2.0], finish_reason="length", weight_version=4)
    bad = Completion(token_ids=[1, 2, 3], logprobs=[-1.0, -2.0, float("-inf")], finish_reason="length", weight_version=4)
    check_finite_logprobs([[ok, ok]])
    with pytest.raises(NonFiniteLogprobsError, match="prompt 1, sample 0, position 2 .weight version 4"):
        check_finite_logprobs([[ok, ok], [bad, ok]])


def test_seeds_use_all_64_bits():
    from jaxrl_mismatch.rollout.jax_engine import seed_key_data

    assert seed_key_data(3).tolist() == jax.random.key_data(jax.random.PRNGKey(3)).tolist()
    assert seed_key_data(3).tolist() != seed_key_data(2**40 + 3).tolist()
    assert seed_key_data(-1).tolist() == [0xFFFFFFFF, 0xFFFFFFFF]


def test_the_greedy_boundary_is_one_rule_for_the_checks_and_both_engines():
    """1e-5 (the documented least sampling temperature) reaches the server as float32 9.99999975e-06: the
    server's checks (float64) called it greedy and refused exact mode at it, while the JAX sampler (float32)
    sampled. Now one float32 rule (`validation.is_greedy`) decides for the checks, the JAX sampler's settings
    and its sort-free path; just below it is greedy everywhere."""
    from jaxrl_mismatch.rollout import protocol
    from jaxrl_mismatch.rollout.engine import EngineInfo, SamplingSpec
    from jaxrl_mismatch.rollout.sampling import effective_settings, uses_filtering
    from jaxrl_mismatch.rollout.validation import RequestError, is_greedy, parse_generate

    info = EngineInfo(architecture="Qwen3ForCausalLM", vocab_size=97, dtype="float32", engine="jax", weight_version=0,
                      max_model_len=64, options=("exact", "logit_noise_std"))
    below = float(np.nextafter(np.float32(1e-5), np.float32(0)))
    for t, greedy in ((1e-5, False), (float(np.float32(1e-5)), False), (below, True), (0.0, True)):
        _, top_k, _ = effective_settings(t, 0, 1.0)
        assert is_greedy(t) == greedy == (int(top_k) == 1) == uses_filtering(0, 1.0, t), t
        req = protocol.request_to_proto([[1, 2]], SamplingSpec(max_tokens=2, temperature=t, exact=True))
        if greedy:
            with pytest.raises(RequestError, match="^exact: exact mode samples at temperature > 0"):
                parse_generate(req, info, protocol.Limits())
        else:  # sent as float32 over the wire, and accepted
            assert parse_generate(req, info, protocol.Limits())[1].temperature == float(np.float32(1e-5))


def test_the_vllm_engine_refuses_temperatures_vllm_would_raise_to_its_floor():
    """vLLM samples any temperature in (0, 0.01) at 0.01: a server on it refuses them by name (INVALID_ARGUMENT),
    since μ would be sampled at another temperature than the trainer scores π at; greedy (< 1e-5) and >= 0.01 pass,
    and the JAX engine samples every temperature as asked."""
    from jaxrl_mismatch.rollout import protocol
    from jaxrl_mismatch.rollout.engine import EngineInfo, SamplingSpec
    from jaxrl_mismatch.rollout.validation import RequestError, parse_generate

    vllm = EngineInfo(architecture="Qwen3ForCausalLM", vocab_size=97, dtype="float32", engine="vllm",
                      weight_version=0, max_model_len=64)
    jax_info = dataclasses.replace(vllm, engine="jax")
    for t in (0.005, 1e-5):
        req = protocol.request_to_proto([[1, 2]], SamplingSpec(max_tokens=2, temperature=t))
        with pytest.raises(RequestError, match=r"^temperature: the vllm engine samples any temperature in \(0, 0.01\)"):
            parse_generate(req, vllm, protocol.Limits())
        parse_generate(req, jax_info, protocol.Limits())
    for t in (0.0, 0.01, 1.0, 2.0):
        parse_generate(protocol.request_to_proto([[1, 2]], SamplingSpec(max_tokens=2, temperature=t)), vllm,
                       protocol.Limits())
    # Above 2 vLLM's SamplingParams raised inside Generate: an "engine error" (INTERNAL), not the argument named.
    req = protocol.request_to_proto([[1, 2]], SamplingSpec(max_tokens=2, temperature=2.5))
    with pytest.raises(RequestError, match=r"^temperature: the vllm engine samples at most temperature 2 "
                                           r"\(vLLM's bound\), got 2\.5$"):
        parse_generate(req, vllm, protocol.Limits())
    parse_generate(req, jax_info, protocol.Limits())
