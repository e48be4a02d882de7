"""From prompts to scored groups: Generate through a `RolloutSession`, rewards, DAPO dynamic sampling, avg@k.

Host-side and engine-agnostic: a loopback server, an external vLLM server on a GPU box and the tests all
go through the same `RolloutSession.generate`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from jaxrl_mismatch.rollout import Completion, SamplingSpec
from jaxrl_mismatch.rollout.session import RolloutSession
from jaxrl_mismatch.train.batch import RolloutBatch, from_completions


# Scalars `collect` reports, in a fixed order (multi-host broadcast relies on it).
STAT_KEYS = (
    "reward/mean", "reward/std", "reward/all_correct_frac", "reward/all_wrong_frac", "rollout/response_length",
    "rollout/truncated_frac", "filter/rounds", "filter/sampled_groups", "filter/informative_frac_of_batch",
    "reward/overlong_penalty",
)


def overlong_penalty(length: int, max_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) times `factor`: 0 up to L_max − L_cache tokens,
    then ((L_max − L_cache) − |y|) / L_cache, reaching −1 at L_max = `max_tokens` (a response cut there), with
    L_cache = `buffer_len` (0: off). Added to the task's reward: long responses are discouraged smoothly instead of
    a cut response scoring like any wrong one."""
    if buffer_len <= 0:
        return 0.0
    expected = max_tokens - buffer_len
    return factor * min(0.0, (expected - length) / buffer_len)


@dataclasses.dataclass
class Group:
    """One prompt and its G sampled completions with their task rewards and any length penalties (≤ 0)."""

    prompt_ids: list[int]
    answer: str
    completions: list[Completion]
    rewards: np.ndarray  # [G] float32: the task's reward (what reward/* and dynamic sampling read)
    penalties: np.ndarray | None = None  # [G] float32 (`overlong_penalty`); None: none

    @property
    def informative(self) -> bool:
        """A group whose task rewards all agree gives every sample zero group-relative advantage (DAPO §3.2); a
        length penalty alone does not make it informative (verl's filter_groups.metric "acc")."""
        return bool(np.ptp(self.rewards) > 0)

    @property
    def shaped(self) -> np.ndarray:
        """The rewards the advantages are computed from: task reward + length penalty."""
        return self.rewards if self.penalties is None else self.rewards + self.penalties


def sample_groups(session: RolloutSession, prompt_ids: Sequence[list[int]], answers: Sequence[str],
                  spec: SamplingSpec, reward_fn: Callable[[list[int], str], float],
                  penalty_fn: Callable[[int], float] | None = None) -> list[Group]:
    """Generate `spec.n` completions for every prompt and score each one (`penalty_fn(response length)`: the
    length penalty, `overlong_penalty`)."""
    outs = session.generate(prompt_ids, spec)
    groups = []
    for p, a, comps in zip(prompt_ids, answers, outs):
        rewards = np.array([reward_fn(c.token_ids, a) for c in comps], np.float32)
        penalties = None if penalty_fn is None else np.array([penalty_fn(len(c.token_ids)) for c in comps],
                                                              np.float32)
        groups.append(Group(list(p), a, comps, rewards, penalties))
    return groups


@dataclasses.dataclass
class Collected:
    groups: list[Group]
    stats: dict[str, float]


def collect(session: RolloutSession, next_prompts: Callable[[], tuple[list[list[int]], list[str]]],
            spec_for_round: Callable[[int], SamplingSpec], reward_fn, *, num_groups: int,
            dynamic_sampling: bool, max_oversample_rounds: int,
            penalty_fn: Callable[[int], float] | None = None) -> Collected:
    """Sample groups until `num_groups` informative ones are in hand (DAPO dynamic sampling).

    Round 0 samples one batch of prompts; each further round (at most `max_oversample_rounds`) samples
    another batch and keeps its informative groups. If the batch is still short, uninformative groups
    fill it: they keep the batch shape, and so the compiled step, fixed, and carry zero advantage (no gradient)
    unless the overlong penalty gives their samples different shaped rewards. `reward/*` and `rollout/*` describe
    round 0 only — an unbiased sample of the current policy, which the kept groups of later rounds are not (the
    trained batch's lengths are `length/*`, `metrics.step`). `filter/informative_frac_of_batch` is the share of
    the batch's groups that are informative, dynamic sampling on or off.
    """
    kept: list[Group] = []
    spare: list[Group] = []
    stats: dict[str, float] = {}
    rounds = 0
    sampled = 0
    for rnd in range(max_oversample_rounds + 1 if dynamic_sampling else 1):
        prompt_ids, answers = next_prompts()
        groups = sample_groups(session, prompt_ids, answers, spec_for_round(rnd), reward_fn, penalty_fn)
        sampled += len(groups)
        rounds = rnd + 1
        if rnd == 0:
            r = np.concatenate([g.rewards for g in groups])
            lengths = np.array([len(c.token_ids) for g in groups for c in g.completions], np.float32)
            stats.update({
                "reward/mean": float(r.mean()), "reward/std": float(r.std()),
                "reward/all_correct_frac": float(np.mean([g.rewards.min() >= 1 for g in groups])),
                "reward/all_wrong_frac": float(np.mean([g.rewards.max() <= 0 for g in groups])),
                "rollout/response_length": float(lengths.mean()),
                "rollout/truncated_frac": float(np.mean([c.finish_reason == "length" for g in groups for c in g.completions])),
                "reward/overlong_penalty": float(np.concatenate([g.shaped - g.rewards for g in groups]).mean()),
            })
        for g in groups:
            (kept if (g.informative or not dynamic_sampling) else spare).append(g)
        if len(kept) >= num_groups:
            break
    informative = sum(g.informative for g in kept)  # without dynamic sampling `kept` holds every group
    if len(kept) < num_groups:
        kept += spare[: num_groups - len(kept)]
    if len(kept) < num_groups:  # not dynamic sampling and not enough prompts: cannot happen by construction
        raise RuntimeError(f"collected {len(kept)} groups < {num_groups}")
    stats.update({
        "filter/rounds": float(rounds),
        "filter/sampled_groups": float(sampled),
        "filter/informative_frac_of_batch": min(informative, num_groups) / num_groups,
    })
    return Collected(kept[:num_groups], stats)


def to_batch(groups: Sequence[Group], advantages_fn: Callable[[np.ndarray, np.ndarray, int], np.ndarray], *,
             pad_id: int, with_routing: bool = False, truncated: bool | None = None) -> RolloutBatch:
    """Rows in group order; `advantages_fn(rewards [B], group_ids [B], num_groups) -> [B]`.

    `truncated` (the request sampled with top-k/top-p): every non-empty completion must carry its kept-set sizes,
    which π is renormalised with; None infers it from the completions.

    `with_routing` (a MoE policy sampled with `SamplingSpec.return_routing`): every completion's
    `Completion.routing` goes into the batch's `routing` field, aligned with `tokens`."""
    prompts, comps, logps, rewards, gids, routing, kept = [], [], [], [], [], [], []
    for gi, g in enumerate(groups):
        for c, r in zip(g.completions, g.shaped):
            prompts.append(g.prompt_ids)
            comps.append(c.token_ids)
            logps.append(c.logprobs)
            rewards.append(r)
            gids.append(gi)
            kept.append(c.kept_counts if c.kept_counts is not None else ([] if not c.token_ids else None))
            if with_routing:
                if c.routing is None:
                    raise ValueError(f"routing: a completion of group {gi} came back without routing "
                                     "(the request asked for return_routing)")
                routing.append(c.routing)
    adv = advantages_fn(np.asarray(rewards, np.float32), np.asarray(gids, np.int32), len(groups))
    if truncated is None:
        truncated = any(k for k in kept)  # top-k/top-p: every non-empty completion carries its kept-set sizes
    if truncated and any(k is None for k in kept):
        raise ValueError("kept_counts: some completions of a truncated (top-k/top-p) request came back without them")
    return from_completions(prompts, comps, logps, adv, pad_id=pad_id, routing=routing if with_routing else None,
                            kept_counts=kept if truncated else None)


def evaluate(session: RolloutSession, prompt_ids: Sequence[list[int]], answers: Sequence[str], reward_fn, *,
             k: int, temperature: float, max_tokens: int, stop_token_ids: tuple[int, ...], seed: int,
             quantize_strength: float = 1.0) -> float:
    """avg@k: the mean reward over k samples of every held-out prompt (k=1, temperature 0: greedy)."""
    spec = SamplingSpec(n=k, max_tokens=max_tokens, temperature=temperature, seed=seed, stop_token_ids=stop_token_ids,
                        quantize_strength=quantize_strength)
    groups = sample_groups(session, prompt_ids, answers, spec, reward_fn)
    return float(np.mean(np.concatenate([g.rewards for g in groups])))
