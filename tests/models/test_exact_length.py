"""The exact programs' canonical lengths (`models.exact.canonical_length`): a geometric ladder of ≤ 1.25×
steps, multiples of the LM-head chunk, with a bounded number of shapes per batch width — pinned so that a
change of the ladder (which changes every exact program's bits and compile count) is deliberate."""

from __future__ import annotations

import math

from jaxrl_mismatch.models.exact import EXACT_CHUNK, LADDER_STEPS, canonical_length
from jaxrl_mismatch.train.exact_forward import candidate_lengths


def test_ladder_values_pinned():
    assert canonical_length(30, 48) == 80  # benchmarks/exact_engine.py's rows (78 tokens; 128 as a power of two)
    assert [canonical_length(0, n) for n in (1, 16, 17, 64, 65, 81, 128, 129, 161, 257, 1025)] == \
        [16, 16, 32, 64, 80, 96, 128, 160, 192, 320, 1280]


def test_ladder_is_a_monotone_idempotent_round_up_with_bounded_padding():
    prev = 0
    for n in range(1, 9000):
        c = canonical_length(n, 0)
        assert c >= n and c % EXACT_CHUNK == 0 and c >= prev
        assert canonical_length(c, 0) == c  # ladder values are fixed points: the smallest ladder value ≥ n
        if n > 64:
            assert c < 1.25 * n, n  # the power-of-two rounding padded up to 2×
        prev = c


def test_a_prompt_bound_compiles_only_the_lengths_its_rows_can_have():
    """The trainer bounds prompts by task.max_prompt_len: the candidates are those of prompts 1 … bound, and the
    branch each such row takes is still its canonical length."""
    # qwen3_4b's prompt bound and response budget, in the 16,384-token bucket such rows are padded to
    assert candidate_lengths(16384, 8192) == (10240, 12288, 14336, 16384, 20480, 24576)
    assert candidate_lengths(16384, 8192, 2048) == (10240,)
    assert candidate_lengths(78, 48, 1000) == candidate_lengths(78, 48)  # a bound over the width changes nothing
    for s, m, bound in [(78, 48, 20), (1072, 48, 300), (8024, 7000, 1024)]:
        lengths = candidate_lengths(s, m, bound)
        assert set(lengths) == {canonical_length(p, m) for p in range(1, bound + 1)}
        assert set(lengths) < set(candidate_lengths(s, m))


def test_shapes_per_batch_width_are_bounded():
    assert candidate_lengths(78, 48) == (64, 80, 96, 112, 128)
    for s, m in [(78, 48), (512, 256), (1024, 1024), (4096, 2048), (8192, 512)]:
        lengths = candidate_lengths(s, m)
        octaves = math.ceil(math.log2((s + m) / (m + 1)))
        assert len(lengths) <= LADDER_STEPS * octaves + 1, (s, m, lengths)
        for p in range(1, s + 1):  # exact_forward's branch choice: the first candidate ≥ prompt + max_tokens
            assert min(c for c in lengths if c >= p + m) == canonical_length(p, m)


def test_prompt_lengths_are_one_rule_on_the_host_and_inside_jit():
    """The scorer and the learner's bound check take numpy; the update's exact forward takes tracers. Each row's
    prompt length: its first response target's index + 1, or its whole length when it has no response."""
    import jax
    import numpy as np

    from jaxrl_mismatch.models.exact import prompt_lengths

    attention = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    response = np.array([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], np.float32)  # targets tokens[:, 1:]
    host = prompt_lengths(attention, response)
    assert isinstance(host, np.ndarray) and host.tolist() == [3, 3, 1]
    traced = jax.jit(prompt_lengths)(attention, response)
    assert isinstance(traced, jax.Array) and np.asarray(traced).tolist() == [3, 3, 1]
