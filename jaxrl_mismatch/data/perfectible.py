"""The "perfectible" sanity dataset (FP16 paper §4).

The paper keeps the MATH problems whose accuracy under the *initial* policy, over 40 sampled
responses, lies between 20 % and 80 %: every kept problem is solvable by the model (so failure to
reach ~100 % training accuracy is the algorithm's fault, not the model's) and none is trivial (so every
group has reward variance and a gradient). This module measures that accuracy with any sampler and
saves the kept prompts in the ``prompts`` JSONL format that :mod:`math_datasets` builds into TFDS.

The policy is reached only through ``sample_fn(prompts, n) -> completions`` so that the trainer can
pass a rollout-client-backed function (the same engine and sampling settings as the RL run), and tests
can pass a deterministic stand-in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jaxrl_mismatch.data.jsonl import write_jsonl

SampleFn = Callable[[list[str], int], Sequence[Sequence[str]]]
RewardFn = Callable[[str, str], float]


def filter_perfectible(
    prompts: Sequence[str],
    answers: Sequence[str],
    sample_fn: SampleFn,
    reward_fn: RewardFn,
    *,
    k: int = 8,
    lo: float = 0.2,
    hi: float = 0.8,
    batch_size: int = 64,
    extras: Sequence[Mapping] | None = None,
) -> list[dict]:
    """Keep the prompts whose accuracy over ``k`` samples lies in ``[lo, hi]`` (both inclusive).

    Args:
      prompts: prompt strings as the sampler takes them (already templated if the engine needs it).
      answers: gold answers, one per prompt, passed to ``reward_fn``.
      sample_fn: ``sample_fn(prompt_batch, n)`` returns, for each prompt of the batch, ``n`` decoded
        completions (response text only). Called with at most ``batch_size`` prompts at a time.
      reward_fn: ``reward_fn(completion, answer) -> float``; a sample counts as correct when its
        reward is > 0.5 (so a small format bonus never counts as success).
      k: samples per prompt (the paper uses 40; with small k the accuracy estimate is coarse, and
        ``lo``/``hi`` fall on multiples of 1/k — 8 samples give steps of 0.125).
      lo, hi: the kept accuracy band (paper: 0.2, 0.8).
      extras: optional per-prompt dicts merged into the kept records (e.g. source ids).

    Returns:
      Kept records in input order: ``{"prompt_text", "answer", "initial_accuracy", "num_samples", **extra}``.
    """
    if len(prompts) != len(answers):
        raise ValueError(f"filter_perfectible: {len(prompts)} prompts but {len(answers)} answers")
    if extras is not None and len(extras) != len(prompts):
        raise ValueError(f"filter_perfectible: {len(prompts)} prompts but {len(extras)} extras")
    if k < 1 or batch_size < 1:
        raise ValueError(f"filter_perfectible: need k >= 1 and batch_size >= 1, got k={k}, batch_size={batch_size}")
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"filter_perfectible: need 0 <= lo <= hi <= 1, got lo={lo}, hi={hi}")
    eps = 1e-9  # 0.2 == 2/10 and 0.8 == 4/5 must count as inside the band
    kept: list[dict] = []
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start : start + batch_size])
        completions = sample_fn(batch, k)
        if len(completions) != len(batch):
            raise ValueError(f"sample_fn returned completions for {len(completions)} prompts, asked for {len(batch)}")
        for j, samples in enumerate(completions):
            i = start + j
            if len(samples) != k:
                raise ValueError(f"sample_fn returned {len(samples)} completions for prompt {i}, asked for {k}")
            correct = np.array([reward_fn(c, answers[i]) > 0.5 for c in samples], dtype=np.float64)
            acc = float(correct.mean())
            if lo - eps <= acc <= hi + eps:
                rec = {"prompt_text": prompts[i], "answer": str(answers[i]), "initial_accuracy": acc, "num_samples": k}
                if extras is not None:
                    rec.update({key: v for key, v in extras[i].items() if key not in rec})
                kept.append(rec)
    return kept


def save_perfectible(records: Sequence[Mapping], path: str) -> str:
    """Write kept records as ``prompts``-format JSONL (``math_datasets.build("prompts", ...)`` reads it)."""
    for n, r in enumerate(records):
        if "prompt_text" not in r or "answer" not in r:
            raise ValueError(f"record {n} lacks 'prompt_text'/'answer' (keys: {sorted(r)})")
    write_jsonl(records, path)
    return path
