"""Exact mode and injected mismatch in the built-in engine (issue 13; VeXact review).

Exact mode: the engine's μ equals the trainer's exact π(θ_old) bit for bit, in fp32, bf16 and fp16, for
ragged prompts and mixed response lengths, and a row's tokens and log-probs do not depend on the other rows.
The trainer's exact scorer gives a row the same bits alone, in a batch, in any block split and with any
padding. Injection samples the tokens from the perturbed distribution: ρ's spread grows with σ.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import load_hf
from jaxrl_mismatch.models.exact import score_exact
from jaxrl_mismatch.rollout.engine import SamplingSpec
from jaxrl_mismatch.rollout.jax_engine import JaxEngine
from jaxrl_mismatch.train.batch import from_completions

pytestmark = pytest.mark.xla_full_opt  # exact mode: bit-for-bit claims about the programs users compile

PROMPTS = [[3, 4, 5], [7] * 9, list(range(10, 24)), [30, 31, 32, 33, 34, 35]]  # ragged lengths
STOPS = (5, 11, 17)  # frequent enough in a random model to give mixed response lengths
MAX_TOKENS = 20
PRESETS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def spec(**kw) -> SamplingSpec:
    return SamplingSpec(**{"n": 4, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 7, "stop_token_ids": STOPS,
                           "exact": True, **kw})


def batch_of(prompts, completions):
    p = [prompts[i] for i, group in enumerate(completions) for _ in group]
    return from_completions(p, [c.token_ids for g in completions for c in g], [c.logprobs for g in completions for c in g],
                            np.zeros(len(p)), pad_id=0)


def trainer_scorer(ckpt, dtype):
    """The trainer's view: float32 master weights computed in the engine's precision."""
    _, model = load_hf(str(ckpt), policy=precision.policy(PRESETS[dtype], param_dtype="float32"))
    graphdef, params = nnx.split(model, nnx.Param)
    return lambda b: score_exact(graphdef, params, b.tokens, b.attention_mask, b.response_mask,
                                 max_tokens=MAX_TOKENS, temperature=1.0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_engine_mu_equals_trainer_pi_bitwise(tiny_checkpoints, dtype):
    ckpt = tiny_checkpoints["untied"]
    engine = JaxEngine(str(ckpt), dtype=dtype)
    out = engine.generate(PROMPTS, spec())
    b = batch_of(PROMPTS, out)
    assert len({len(c.token_ids) for g in out for c in g}) >= 3  # mixed response lengths
    pi = trainer_scorer(ckpt, dtype)(b)
    m = b.response_mask > 0
    assert np.array_equal(pi[m], b.rollout_logp[m])  # max |π(θ_old) − μ| == 0
    # The same row alone (prompt 0, sample 0) and inside a batch of 16 prompts: same tokens, same bits.
    alone = engine.generate(PROMPTS[:1], spec(n=1))[0][0]
    crowd = engine.generate(PROMPTS[:1] + [list(range(40, 40 + k)) for k in range(1, 16)], spec(n=1))[0][0]
    assert alone.token_ids == out[0][0].token_ids == crowd.token_ids
    assert alone.logprobs == out[0][0].logprobs == crowd.logprobs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_scorer_is_batch_and_padding_invariant(tiny_checkpoints, dtype):
    ckpt = tiny_checkpoints["untied"]
    b = batch_of(PROMPTS, JaxEngine(str(ckpt), dtype=dtype).generate(PROMPTS, spec()))
    score = trainer_scorer(ckpt, dtype)
    whole = score(b)
    row = 5
    alone = score(b.rows(np.array([row])))
    assert np.array_equal(alone[0], whole[row])
    for split in (np.array([0, 1, 2, 3, 4, 5, 6, 7]), np.array([5, 9, 13]), np.arange(16)[::-1]):
        part = score(b.rows(split))
        assert np.array_equal(part[list(split).index(row)], whole[row])
    # 30 more columns of right padding change nothing.
    pad = lambda x: np.pad(np.asarray(x), ((0, 0), (0, 30)))  # noqa: E731
    padded = b.replace(tokens=pad(b.tokens), attention_mask=pad(b.attention_mask), response_mask=pad(b.response_mask))
    assert np.array_equal(score(padded)[:, : whole.shape[1]], whole)


def test_injected_noise_changes_the_sampled_tokens_and_rho_grows_with_sigma(tiny_checkpoints):
    ckpt = tiny_checkpoints["untied"]
    engine = JaxEngine(str(ckpt), dtype="float32")
    score = trainer_scorer(ckpt, "float32")
    prompts = PROMPTS * 4
    stds = []
    for sigma in (0.0, 0.1, 0.3, 1.0):
        out = engine.generate(prompts, spec(logit_noise_std=sigma))
        b = batch_of(prompts, out)
        m = b.response_mask > 0
        rho = np.exp(score(b)[m] - b.rollout_logp[m])
        stds.append(float(rho.std()))
        if sigma == 0.0:
            zero_tokens = [c.token_ids for g in out for c in g]
            assert np.all(rho == 1.0)
        else:
            assert [c.token_ids for g in out for c in g] != zero_tokens  # the tokens come from μ ≠ π
    assert stds[0] == 0.0 and stds[1] < stds[2] < stds[3], stds
    # Same seed and σ: reproducible.
    a = engine.generate(PROMPTS, spec(logit_noise_std=0.3, exact=False))
    assert a == engine.generate(PROMPTS, spec(logit_noise_std=0.3, exact=False))


def _learner(ckpt, tmp_path, **rollout):
    from jaxrl_mismatch.train.config import base_config
    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    c = base_config()
    c.model.path, c.run_dir = str(ckpt), str(tmp_path)
    c.rollout.group_size, c.batch.prompts_per_step, c.trainer.chunk_size = 4, len(PROMPTS), 8
    c.rollout.max_tokens, c.optim.lr = MAX_TOKENS, 1e-2
    c.rollout.update(rollout)
    return Learner(learner_config(c))


def _rl_batch(engine, sigma):
    """Rollouts with a verifiable reward (1 if token 9 appears), GRPO advantages per prompt."""
    from jaxrl_mismatch.objectives import grpo_advantages

    out = engine.generate(PROMPTS, spec(logit_noise_std=sigma))
    b = batch_of(PROMPTS, out)
    rewards = np.array([float(9 in c.token_ids) for g in out for c in g], np.float32)
    adv = np.asarray(grpo_advantages(rewards, np.repeat(np.arange(len(PROMPTS)), 4), len(PROMPTS)))
    return b.replace(advantages=(adv[:, None] * b.response_mask).astype(np.float32))


@pytest.mark.slow
def test_training_step_metrics_are_exactly_zero_in_exact_mode_and_noise_reaches_the_gradient(tiny_checkpoints, tmp_path):
    import jax

    ckpt = tiny_checkpoints["untied"]
    engine = JaxEngine(str(ckpt), dtype="float32")
    updates = {}
    for sigma in (0.0, 0.5):
        learner = _learner(ckpt, tmp_path / str(sigma), exact=True, logit_noise_std=sigma)
        before = jax.tree.map(np.asarray, learner.state.params)
        batch, metrics = learner.prepare(_rl_batch(engine, sigma), seed=0)
        if sigma == 0.0:
            mismatch = {k: v for k, v in metrics.items() if k.startswith("mismatch/")}
            assert mismatch["mismatch/log_ppl_abs_diff"] == 0.0 and mismatch["mismatch/rho_std"] == 0.0
            for k in ("kl_k1", "kl_k2", "kl_k3", "chi2_token", "chi2_seq", "prob_abs_diff_max", "log_ppl_diff_max"):
                assert mismatch[f"mismatch/{k}"] == 0.0, k
            assert mismatch["mismatch/rho_min"] == mismatch["mismatch/rho_max"] == 1.0
        else:
            assert metrics["mismatch/rho_std"] > 0.05
        learner.optimize(batch, seed=0)
        updates[sigma] = jax.tree.map(lambda a, b: np.asarray(a) - b, learner.state.params, before)
    # The injected mismatch reaches the gradient (GRPO, no correction: only the sampled tokens differ).
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(updates[0.0]), jax.tree.leaves(updates[0.5])))
    assert diff > 1e-4


def test_exact_mode_config_is_checked(tiny_checkpoints, tmp_path):
    from jaxrl_mismatch.train.config import ConfigError, base_config
    from jaxrl_mismatch.train.config_checks import validate

    c = base_config()
    c.model.path = "x"
    c.rollout.exact = True
    validate(c)
    for field, value, needle in [("rollout.dtype", "bfloat16", "rollout.dtype = 'float32'"),
                                 ("rollout.engine", "vllm", "jax engine"),
                                 ("trainer.fp32_lm_head", True, "fp32_lm_head"),
                                 ("trainer.mesh", {"data": 1, "fsdp": 2, "tensor": 1}, "data-parallel")]:
        bad = base_config()
        bad.model.path, bad.rollout.exact = "x", True
        node, key = (bad.trainer, "mesh") if field == "trainer.mesh" else (bad[field.split(".")[0]], field.split(".")[1])
        node[key] = value
        with pytest.raises(ConfigError, match=needle):
            validate(bad)
