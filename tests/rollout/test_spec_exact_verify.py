"""The speculative exact sampler's verify (issue 21, item 1): it computes the LM head and the draw only on the
chunks that hold a wanted position, with the bits the full verify gives there, and each round also takes the
exact token after the whole draft, so the draft stops one token short of the budget."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_mismatch.models.exact import EXACT_CHUNK
from jaxrl_mismatch.rollout import spec_exact
from jaxrl_mismatch.rollout.engine import SamplingSpec
from jaxrl_mismatch.rollout.jax_engine import JaxEngine, seed_key_data

pytestmark = pytest.mark.xla_full_opt  # exact mode: bit-for-bit claims about the programs users compile

PROMPTS = [[3, 4, 5], list(range(10, 24))]


def test_verify_skips_settled_chunks_without_changing_the_wanted_bits(tiny_checkpoints):
    engine = JaxEngine(str(tiny_checkpoints["untied"]), dtype="float32")
    length = 64
    rng = np.random.default_rng(0)
    ids = np.zeros((2, length), np.int32)
    ids[:, :50] = rng.integers(1, 90, size=(2, 50))
    n_valid, n_prompt = np.array([50, 37], np.int32), np.array([20, 5], np.int32)

    def verify(first):
        out = spec_exact._verify_program(
            engine._graphdef, engine._params, engine._rest, jnp.asarray(ids), jnp.asarray(n_valid),
            jnp.asarray(n_prompt), jnp.asarray(first, jnp.int32), seed_key_data(4), jnp.asarray([0, 1]),
            jnp.asarray([2, 3]), np.float32(1.0), np.float32(0.0), np.int32(0), np.float32(1.0), inject=False,
            filtering=False)
        return [np.asarray(x) for x in jax.device_get(out)]

    full = verify([0, 0])
    part = verify([40, 19])  # row 0 wants positions 40..49 (chunks 2, 3), row 1 wants 19..36 (chunks 1, 2)
    for r, (lo, hi) in enumerate([(40, 50), (19, 37)]):
        c0, c1 = lo // EXACT_CHUNK * EXACT_CHUNK, -(-hi // EXACT_CHUNK) * EXACT_CHUNK
        for f, p in zip(full, part):
            assert np.array_equal(p[r, c0:c1].view(np.int32), f[r, c0:c1].view(np.int32))  # bit for bit
            assert not np.any(p[r, :c0]) and not np.any(p[r, c1:])  # skipped chunks: no head, no draw
        assert np.any(full[1][r, :c0])  # (the full verify did compute them)


def test_each_round_takes_the_token_after_the_draft(tiny_checkpoints):
    ckpt = str(tiny_checkpoints["untied"])
    spec = SamplingSpec(n=2, max_tokens=9, temperature=1.0, seed=2, exact=True)
    fast, ref = JaxEngine(ckpt, dtype="float32"), JaxEngine(ckpt, dtype="float32", exact_sampler="reference")
    out = fast.generate(PROMPTS, spec)
    assert [(c.token_ids, c.logprobs) for g in out for c in g] == \
        [(c.token_ids, c.logprobs) for g in ref.generate(PROMPTS, spec) for c in g]
    st = fast.exact_stats
    assert all(len(c.token_ids) == 9 for g in out for c in g)
    # Every round drafts at most budget − 1 tokens per row and settles one more than it accepted.
    assert st.drafted <= 4 * (9 - 1) * st.rounds
    if st.rounds == 1:
        assert st.drafted == 4 * 8 and st.accepted == 4 * 8
