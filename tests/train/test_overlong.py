"""DAPO's soft overlong punishment (`task.overlong_buffer_len`, Yu et al. 2025, eq. 13): its values, that it reaches
the advantages (so the gradient) while dynamic sampling and reward/* keep reading the task's reward, and the config
checks."""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxrl_mismatch.objectives.advantages import compute_advantages
from jaxrl_mismatch.rollout import Completion
from jaxrl_mismatch.train.collect import collect, overlong_penalty, to_batch
from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_checks import validate
from jaxrl_mismatch.train.loop import Trainer


def test_the_penalty_is_eq_13():
    """L_max 10, L_cache 4: nothing up to 6 tokens, then −1/4 per token, −1 at 10; the factor scales it."""
    got = [overlong_penalty(n, max_tokens=10, buffer_len=4, factor=1.0) for n in range(0, 11)]
    assert got == [0.0] * 7 + [-0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(9, max_tokens=10, buffer_len=4, factor=0.5) == -0.375
    assert overlong_penalty(10, max_tokens=10, buffer_len=0, factor=1.0) == 0.0  # off


class _Session:
    """Serves fixed completions: prompt i's sample j has `lengths[i][j]` tokens, all of id 7 + j."""

    def __init__(self, lengths: list[list[int]]):
        self.lengths = lengths

    def generate(self, prompts, spec):
        return [[Completion(token_ids=[7 + j] * n, logprobs=[-1.0] * n, finish_reason="length" if n == 10 else "stop",
                            weight_version=0) for j, n in enumerate(self.lengths[p[0]])] for p in prompts]


def test_it_reaches_the_advantages_and_not_the_filter_or_the_reported_reward():
    """Prompt 0: both samples right, 4 and 10 tokens; prompt 1: one right, one wrong, both short. With the penalty
    (L_max 10, L_cache 4) prompt 0 is still uninformative for dynamic sampling (its task rewards agree) and
    reward/mean is the task's, but its long sample now gets a lower advantage than its short one."""
    session = _Session([[4, 10], [3, 3]])

    def reward(ids, answer):  # prompt 0 ("a"): always right; prompt 1: sample 0 (token 7) right
        return 1.0 if answer == "a" or ids[0] == 7 else 0.0

    def run(penalty_fn):
        return collect(session, lambda: ([[0], [1]], ["a", "b"]), lambda rnd: None, reward, num_groups=2,
                       dynamic_sampling=False, max_oversample_rounds=0, penalty_fn=penalty_fn)

    plain = run(None)
    shaped = run(lambda n: overlong_penalty(n, max_tokens=10, buffer_len=4, factor=1.0))
    assert [g.informative for g in shaped.groups] == [g.informative for g in plain.groups] == [False, True]
    assert shaped.stats["reward/mean"] == plain.stats["reward/mean"] == 0.75
    assert plain.stats["reward/overlong_penalty"] == 0.0 and shaped.stats["reward/overlong_penalty"] == -0.25

    def adv(rewards, gids, n):
        return np.asarray(compute_advantages("grpo", rewards, gids, n))

    a_plain, a_shaped = (to_batch(r.groups, adv, pad_id=0).advantages for r in (plain, shaped))
    assert np.all(a_plain[:2] == 0)  # without the penalty the all-right group gives no gradient
    short_row, long_row = a_shaped[0], a_shaped[1]
    assert long_row[long_row != 0].max() < 0 < short_row[short_row != 0].min()
    np.testing.assert_array_equal(a_shaped[2:], a_plain[2:])  # the short group: no penalty, same advantages
    # One of the two groups is informative, dynamic sampling off: the share was len(kept) / num_groups, always 1.0
    assert plain.stats["filter/informative_frac_of_batch"] == 0.5


def test_rollout_stats_describe_round_0_and_the_informative_share_counts_informative_groups():
    """Round 0: the all-right prompt 0 (3 tokens each, stopped) is set aside; round 1's prompt 1 (10 tokens, cut
    at the budget) is informative and trained on. `rollout/*` report round 0, as `reward/*` (documented now)."""
    session = _Session([[3, 3], [10, 10]])
    prompts = iter([([[0]], ["a"]), ([[1]], ["b"])])

    def reward(ids, answer):
        return 1.0 if answer == "a" or ids[0] == 7 else 0.0

    got = collect(session, lambda: next(prompts), lambda rnd: None, reward, num_groups=1, dynamic_sampling=True,
                  max_oversample_rounds=1)
    assert [g.prompt_ids for g in got.groups] == [[1]]
    assert got.stats["rollout/response_length"] == 3.0 and got.stats["rollout/truncated_frac"] == 0.0
    assert got.stats["filter/rounds"] == 2.0 and got.stats["filter/informative_frac_of_batch"] == 1.0


def test_the_config_checks_and_the_trainer_wiring():
    c = base_config()
    c.model.path = "/some/model"
    validate(c)
    assert Trainer._penalty_fn(types.SimpleNamespace(c=c)) is None  # off by default
    c.task.overlong_buffer_len, c.task.overlong_penalty_factor = 16, 0.5
    validate(c)
    fn = Trainer._penalty_fn(types.SimpleNamespace(c=c))
    assert fn(c.rollout.max_tokens) == -0.5 and fn(c.rollout.max_tokens - 16) == 0.0
    for field, value, needle in (("overlong_buffer_len", c.rollout.max_tokens + 1, r"in \[0, rollout\.max_tokens"),
                                 ("overlong_penalty_factor", -1.0, "must be a number >= 0")):
        bad = base_config()
        bad.model.path = "/some/model"
        bad.task[field] = value
        with pytest.raises(ConfigError, match=rf"^config\.task\.{field}: .*{needle}"):
            validate(bad)
