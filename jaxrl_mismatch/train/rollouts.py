"""From prompts to a training batch: Generate over gRPC, rewards, dynamic sampling, advantages.

Host-side and engine-agnostic: everything goes through a `RolloutClient`, so the managed subprocess
server, an external vLLM server on a GPU box and the tests exercise the same path.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from jaxrl_mismatch.data.batching import TrainBatch, make_train_batch
from jaxrl_mismatch.rollout import Completion, RolloutClient, SamplingSpec
from jaxrl_mismatch.rollout.validation import Limits


# Scalars `collect` reports, in a fixed order (multi-host broadcast relies on it).
STAT_KEYS = (
    "reward/mean", "reward/std", "reward/all_correct_frac", "reward/all_wrong_frac", "rollout/response_length",
    "rollout/truncated_frac", "filter/rounds", "filter/sampled_groups", "filter/informative_frac_of_batch",
)
BATCH_KEYS = ("tokens", "attention_mask", "response_mask", "advantages", "rollout_logp")


@dataclasses.dataclass
class Group:
    """One prompt and its G sampled completions with their rewards."""

    prompt_ids: list[int]
    answer: str
    completions: list[Completion]
    rewards: np.ndarray  # [G] float32

    @property
    def informative(self) -> bool:
        """A group whose rewards all agree gives every sample zero group-relative advantage (DAPO §3.2)."""
        return bool(np.ptp(self.rewards) > 0)


def request_chunks(prompt_ids: Sequence[list[int]], spec: SamplingSpec, limits: Limits = Limits()) -> list[slice]:
    """Split prompts into Generate requests within the server's per-request token limits.

    A real run asks for more than one request may carry (64 prompts × 16 samples × 8192 tokens is 8.4M
    completion tokens, over the default 4M and over gRPC's 64 MiB message size), so the trainer sends
    several requests of consecutive prompts.
    """
    per_prompt = spec.n * spec.max_tokens
    if per_prompt > limits.max_request_completion_tokens:
        raise ValueError(f"one prompt asks for n × max_tokens = {per_prompt} completion tokens, over the request "
                         f"limit {limits.max_request_completion_tokens}; lower rollout.group_size or max_tokens")
    chunks, start, completion, prompt = [], 0, 0, 0
    for i, p in enumerate(prompt_ids):
        if i > start and (completion + per_prompt > limits.max_request_completion_tokens
                          or prompt + len(p) > limits.max_request_prompt_tokens):
            chunks.append(slice(start, i))
            start, completion, prompt = i, 0, 0
        completion += per_prompt
        prompt += len(p)
    chunks.append(slice(start, len(prompt_ids)))
    return chunks


def sample_groups(client: RolloutClient, prompt_ids: Sequence[list[int]], answers: Sequence[str],
                  spec: SamplingSpec, reward_fn: Callable[[list[int], str], float],
                  limits: Limits = Limits()) -> list[Group]:
    """Generate for all prompts (in as few requests as the server's `limits` allow); score every completion."""
    outs = []
    for chunk in request_chunks(prompt_ids, spec, limits):
        outs += client.generate(list(prompt_ids[chunk]), spec)
    groups = []
    for p, a, comps in zip(prompt_ids, answers, outs):
        rewards = np.array([reward_fn(c.token_ids, a) for c in comps], np.float32)
        groups.append(Group(list(p), a, comps, rewards))
    return groups


@dataclasses.dataclass
class Collected:
    groups: list[Group]
    stats: dict[str, float]


def collect(client: RolloutClient, next_prompts: Callable[[], tuple[list[list[int]], list[str]]],
            spec_for_round: Callable[[int], SamplingSpec], reward_fn, *, num_groups: int,
            dynamic_sampling: bool, max_oversample_rounds: int, limits: Limits = Limits()) -> Collected:
    """Sample groups until `num_groups` informative ones are in hand (DAPO dynamic sampling).

    Round 0 samples one batch of prompts; each further round (at most `max_oversample_rounds`) samples
    another batch and keeps its informative groups. If the batch is still short, uninformative groups
    fill it: they carry zero advantage (no gradient) but keep the batch shape, and so the compiled step,
    fixed. `reward/*` stats describe round 0 only — an unbiased estimate of the current policy's reward.
    """
    kept: list[Group] = []
    spare: list[Group] = []
    stats: dict[str, float] = {}
    rounds = 0
    sampled = 0
    for rnd in range(max_oversample_rounds + 1 if dynamic_sampling else 1):
        prompt_ids, answers = next_prompts()
        groups = sample_groups(client, prompt_ids, answers, spec_for_round(rnd), reward_fn, limits)
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
            })
        for g in groups:
            (kept if (g.informative or not dynamic_sampling) else spare).append(g)
        if len(kept) >= num_groups:
            break
    informative = len(kept)
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


def to_train_batch(groups: Sequence[Group], *, pad_id: int) -> tuple[TrainBatch, np.ndarray, np.ndarray]:
    """Rows in group order; returns (batch, rewards [B], group_ids [B])."""
    prompts, comps, logps, rewards, gids = [], [], [], [], []
    for gi, g in enumerate(groups):
        for c, r in zip(g.completions, g.rewards):
            prompts.append(g.prompt_ids)
            comps.append(c.token_ids)
            logps.append(c.logprobs)
            rewards.append(r)
            gids.append(gi)
    batch = make_train_batch(prompts, comps, logps, pad_id=pad_id, batch_size=len(prompts))
    return batch, np.asarray(rewards, np.float32), np.asarray(gids, np.int32)


def evaluate(client: RolloutClient, prompt_ids: Sequence[list[int]], answers: Sequence[str], reward_fn, *,
             k: int, temperature: float, max_tokens: int, stop_token_ids: tuple[int, ...], seed: int,
             limits: Limits = Limits()) -> float:
    """avg@k: the mean reward over k samples of every held-out prompt (k=1, temperature 0: greedy)."""
    spec = SamplingSpec(n=k, max_tokens=max_tokens, temperature=temperature, seed=seed, stop_token_ids=stop_token_ids)
    groups = sample_groups(client, prompt_ids, answers, spec, reward_fn, limits)
    return float(np.mean(np.concatenate([g.rewards for g in groups])))
