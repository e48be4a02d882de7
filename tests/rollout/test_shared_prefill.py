"""The built-in engine prefills each distinct prompt of a batch once and decodes its n samples from copies of
that cache (`JaxEngine(share_prefill=True)`, the default): the same completions as one prefill per row, and
the program really prefills fewer rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxrl_mismatch.rollout import jax_engine
from jaxrl_mismatch.rollout.engine import SamplingSpec
from jaxrl_mismatch.rollout.jax_engine import JaxEngine

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79], [7], [2, 71, 82, 81, 82, 84, 59]]


@pytest.fixture
def prefill_rows(monkeypatch):
    """The rows each call of the sampling program prefills, and its `row_src` (None: one prompt per row)."""
    seen: list[tuple[int, object]] = []
    program = jax_engine._sample_program

    def spy(graphdef, params, rest, prompt_ids, *args, **kwargs):
        seen.append((prompt_ids.shape[0], None if args[-1] is None else np.asarray(args[-1])))
        return program(graphdef, params, rest, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(jax_engine, "_sample_program", spy)
    return seen


@pytest.mark.parametrize("max_batch_rows", [256, 6])  # 6: a prompt's samples split across two programs
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_shared_prefill_samples_what_one_prefill_per_row_samples(tiny_checkpoints, prefill_rows, max_batch_rows, top_p):
    spec = SamplingSpec(n=4, max_tokens=12, temperature=1.0, top_p=top_p, seed=3)
    out = {}
    for share in (True, False):
        engine = JaxEngine(str(tiny_checkpoints["untied"]), max_batch_rows=max_batch_rows, share_prefill=share)
        out[share] = engine.generate(PROMPTS, spec)
    for shared, alone in zip(out[True], out[False], strict=True):
        for a, b in zip(shared, alone, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    # The option reaches the program: shared, 4 prompts x 4 samples prefill 4 rows, not 16.
    calls = len(prefill_rows) // 2
    shared, alone = prefill_rows[:calls], prefill_rows[calls:]
    assert all(src is None for _, src in alone) and sum(rows for rows, _ in alone) >= 16
    if max_batch_rows == 256:
        assert shared[0][0] == 4 and shared[0][1].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    else:  # rows (prompt, sample) in order, 6 per program: prompts {0, 1}, {1, 2}, {3}
        assert [rows for rows, _ in shared] == [2, 2, 1]
        assert [src.tolist()[:6] for _, src in shared] == [[0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0]]


def test_one_sample_per_prompt_prefills_every_row_as_before(tiny_checkpoints, prefill_rows):
    engine = JaxEngine(str(tiny_checkpoints["untied"]))
    engine.generate(PROMPTS, SamplingSpec(n=1, max_tokens=4, seed=0))
    assert prefill_rows == [(4, None)]


def test_distinct_rows_keeps_first_use_order():
    from jaxrl_mismatch.models import distinct_rows

    first, src = distinct_rows([[1, 2], [3], [1, 2], [1], [3], [1, 2, 0]])
    assert first == [0, 1, 3, 5] and src.tolist() == [0, 1, 0, 2, 1, 3]
    first, src = distinct_rows([])
    assert first == [] and src.shape == (0,)


def test_padding_rows_draw_nothing_so_the_loop_ends_with_the_real_rows(tiny_checkpoints, monkeypatch):
    """The rows are bucketed to a power of two; the padding rows had the batch's max_tokens, so each decoded a
    continuation of its own and the loop ran until they stopped too (a review: 73 steps for real rows of ≤ 5
    tokens at max_tokens 1024). They now have a limit of 0: 0 tokens, and the real rows' completions unchanged."""
    program, lengths = jax_engine._sample_program, []

    def spy(*args, **kwargs):
        out = program(*args, **kwargs)
        lengths.append(np.asarray(out[2]))
        return out

    monkeypatch.setattr(jax_engine, "_sample_program", spy)
    engine = JaxEngine(str(tiny_checkpoints["untied"]), share_prefill=False)
    spec = SamplingSpec(n=1, max_tokens=64, temperature=1.0, seed=5, stop_token_ids=(5, 11))
    out = engine.generate(PROMPTS[:3], spec)  # 3 rows in a program of 4
    (got,) = lengths
    assert got.shape == (4,) and got[3] == 0
    assert got[:3].tolist() == [len(g[0].token_ids) for g in out]


def test_the_engine_itself_refuses_an_empty_prompt_and_rows_past_max_model_len(tiny_checkpoints):
    """The server checks these; in-process callers reach the engine directly (a review: a 60-token prompt with
    max_tokens 40 under max_model_len 64 sampled 40 tokens, an empty prompt sampled from a masked prefill). A later
    review: a negative id read the vocabulary's last row, exact mode at greedy was a TypeError, max_tokens -1,
    65 stop ids or top_k 2^31 were numpy errors naming nothing. The engine now runs the server's own checks."""
    engine = JaxEngine(str(tiny_checkpoints["untied"]), max_model_len=64)
    spec = SamplingSpec(n=1, max_tokens=40, temperature=1.0, seed=5)
    with pytest.raises(ValueError, match=r"^max_tokens: longest prompt \(60 tokens\) \+ max_tokens \(40\) exceeds "
                                         r"max_model_len 64$"):
        engine.generate([[3, 4], [7] * 60], spec)
    with pytest.raises(ValueError, match=r"^prompts\[0\]\.token_ids: empty prompt$"):
        engine.generate([[]], spec)
    vocab = engine.info().vocab_size
    for prompts, changes, needle in (
            ([[3, -1]], {}, r"^prompts\[0\]\.token_ids: token id -1 outside \[0, vocab_size="),
            ([[3], [vocab]], {}, rf"^prompts\[1\]\.token_ids: token id {vocab} outside"),
            ([[3]], {"exact": True, "temperature": 0.0}, r"^exact: exact mode samples at temperature > 0"),
            ([[3]], {"max_tokens": -1}, r"^max_tokens: must be >= 1, got -1$"),
            ([[3]], {"stop_token_ids": tuple(range(65))}, r"^stop_token_ids: at most 64 stop tokens, got 65$"),
            ([[3]], {"top_k": 2**31}, r"^top_k: must be in \[0, 2147483647\]"),
            ([[3]], {"top_p": 0.0}, r"^top_p: must be in \(0, 1\], got 0\.0$"),
            ([[3]], {"temperature": -1.0}, r"^temperature: must be finite and >= 0")):
        with pytest.raises(ValueError, match=needle):
            engine.generate(prompts, dataclasses.replace(spec, **changes))
    assert len(engine.generate([[7] * 24], spec)[0][0].token_ids) <= 40  # 24 + 40 = 64 fits
