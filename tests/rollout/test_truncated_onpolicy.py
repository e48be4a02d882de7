"""On-policy top-p / top-k (issue 21, item 3): the engine returns each sampled token's kept-set size, the
trainer renormalises π over the same support (`models.truncation`), so with `rollout.exact` and top-p 0.9
μ = π(θ_old) bit for bit and the update's first ratio is exactly 1; with the normal sampler π and μ compare
the same distribution (only numerical mismatch is left). The option reaches the sampled tokens."""

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
from jaxrl_mismatch.models.scoring import score_tokens

pytestmark = pytest.mark.xla_full_opt  # exact mode: bit-for-bit claims about the programs users compile

PROMPTS = [[3, 4, 5], [7] * 9, list(range(10, 24)), [30, 31, 32, 33, 34, 35]]
MAX_TOKENS = 16
PRESETS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _spec(**kw):
    return SamplingSpec(**{"n": 4, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 5, "stop_token_ids": (5,),
                           "exact": True, "top_p": 0.9, **kw})


def _batch(out):
    p = [PROMPTS[i] for i, g in enumerate(out) for _ in g]
    flat = [c for g in out for c in g]
    return from_completions(p, [c.token_ids for c in flat], [c.logprobs for c in flat], np.zeros(len(p)), pad_id=0,
                            kept_counts=[c.kept_counts for c in flat])


def _graph(ckpt, dtype):
    _, model = load_hf(str(ckpt), policy=precision.policy(PRESETS[dtype], param_dtype="float32"))
    return nnx.split(model, nnx.Param)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_exact_top_p_mu_equals_pi_old_bitwise_and_reaches_the_tokens(tiny_checkpoints, dtype):
    ckpt = tiny_checkpoints["untied"]
    engine = JaxEngine(str(ckpt), dtype=dtype)
    out = engine.generate(PROMPTS, _spec())
    b = _batch(out)
    m = b.response_mask > 0
    vocab = engine.cfg.vocab_size
    assert np.all((b.kept_count[m] >= 1) & (b.kept_count[m] < vocab))  # top-p 0.9 cut every distribution
    graphdef, params = _graph(ckpt, dtype)
    pi = score_exact(graphdef, params, b.tokens, b.attention_mask, b.response_mask, max_tokens=MAX_TOKENS,
                     temperature=1.0, kept=b.kept_count)
    assert np.array_equal(pi[m], b.rollout_logp[m])  # μ = π(θ_old) over the same support, bit for bit
    full = score_exact(graphdef, params, b.tokens, b.attention_mask, b.response_mask, max_tokens=MAX_TOKENS,
                       temperature=1.0)
    assert np.all(full[m] < pi[m])  # the whole-vocabulary π is another distribution (TRL #6789)
    # The option reaches the sampled tokens: same seed, no truncation → other tokens; top-k 3 keeps ≤ 3.
    plain = [c.token_ids for g in engine.generate(PROMPTS, _spec(top_p=1.0)) for c in g]
    assert plain != [c.token_ids for g in out for c in g]
    k3 = _batch(engine.generate(PROMPTS, _spec(top_p=1.0, top_k=3)))
    k3 = k3.kept_count[k3.response_mask > 0]
    if dtype == "float32":
        assert set(np.unique(k3)) <= {1, 2, 3}
    else:  # bf16 / fp16 log-probs tie often; ties at the boundary are all kept (a value threshold)
        assert np.mean(k3 <= 3) >= 0.5 and k3.max() < vocab


def test_normal_sampler_top_k_trainer_renormalises_over_the_same_support(tiny_checkpoints):
    ckpt = tiny_checkpoints["untied"]
    b = _batch(JaxEngine(str(ckpt), dtype="float32").generate(PROMPTS, _spec(exact=False, top_p=1.0, top_k=4)))
    m = b.response_mask > 0
    assert np.all(b.kept_count[m] == 4)
    graphdef, params = _graph(ckpt, "float32")
    renorm, _, _ = score_tokens(graphdef, params, b.tokens, b.attention_mask, chunk_size=8, kept=b.kept_count)
    full, _, _ = score_tokens(graphdef, params, b.tokens, b.attention_mask, chunk_size=8)
    assert np.max(np.abs(np.asarray(renorm)[m] - b.rollout_logp[m])) < 1e-4  # numerical mismatch only
    assert np.min(np.abs(np.asarray(full)[m] - b.rollout_logp[m])) > 1e-3  # the biased comparison


def test_exact_top_p_training_step_ratio_is_one(tiny_checkpoints, tmp_path):
    from jaxrl_mismatch.train.config import base_config
    from jaxrl_mismatch.train.config_checks import validate
    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    ckpt = tiny_checkpoints["untied"]
    c = base_config()
    c.model.path, c.run_dir = str(ckpt), str(tmp_path)
    c.rollout.group_size, c.batch.prompts_per_step, c.trainer.chunk_size = 4, len(PROMPTS), 8
    c.rollout.max_tokens, c.rollout.exact, c.rollout.top_p = MAX_TOKENS, True, 0.9
    c.trainer.precision, c.rollout.dtype = "bf16", "bfloat16"
    validate(c)
    out = JaxEngine(str(ckpt), dtype="bfloat16").generate(PROMPTS, _spec())
    b = _batch(out)
    adv = np.array([len(x.token_ids) for g in out for x in g], np.float32)
    b = b.replace(advantages=((adv - adv.mean())[:, None] * b.response_mask).astype(np.float32))
    learner = Learner(learner_config(c))
    prepared, metrics = learner.prepare(b, seed=0)
    assert metrics["mismatch/rho_std"] == 0.0 and metrics["mismatch/log_ppl_abs_diff"] == 0.0
    stats = learner.optimize(prepared, seed=0)
    assert stats["ppo/ratio_min"] == stats["ppo/ratio_max"] == 1.0 and stats["ppo/clip_frac_high"] == 0.0


def test_config_accepts_top_p_top_k_and_refuses_what_cannot_carry_them():
    from jaxrl_mismatch.train.config import ConfigError, base_config
    from jaxrl_mismatch.train.config_checks import validate

    c = base_config()
    c.model.path, c.rollout.top_p, c.rollout.top_k = "x", 0.9, 20
    validate(c)
    for field, value, needle in (("engine", "vllm", r"rollout\.top_p: needs the jax engine"),
                                 ("top_p", 1.5, r"rollout\.top_p: must be in \(0, 1\]")):
        bad = base_config()
        bad.model.path, bad.rollout.top_p = "x", 0.9
        bad.rollout[field] = value
        with pytest.raises(ConfigError, match=needle):
            validate(bad)
    bad = base_config()
    bad.model.path, bad.rollout.top_k, bad.trainer.packing = "x", 5, True
    with pytest.raises(ConfigError, match=r"trainer\.packing: must be False with rollout\.top_k"):
        validate(bad)


def test_kept_counts_cross_the_wire():
    from jaxrl_mismatch.rollout.engine import Completion
    from jaxrl_mismatch.rollout.protocol import MalformedMessageError, completion_from_proto, completions_to_proto

    comps = [[Completion(token_ids=[4, 5, 6], logprobs=[-0.1, -0.2, -0.3], finish_reason="length", weight_version=2,
                         kept_counts=[3, 1, 7]),
              Completion(token_ids=[4], logprobs=[-0.5], finish_reason="stop", weight_version=2)]]
    pb = completions_to_proto(comps, "srv")
    back = [completion_from_proto(s) for s in pb.prompts[0].samples]
    assert back[0].kept_counts == [3, 1, 7] and back[1].kept_counts is None
    bad = pb.prompts[0].samples[0]
    bad.kept_counts.append(2)  # 4 sizes for 3 tokens: a malformed RPC
    with pytest.raises(MalformedMessageError, match="kept_counts"):
        completion_from_proto(bad)


@pytest.mark.parametrize("exact", [False, True])
def test_injected_noise_moves_mass_only_inside_the_clean_kept_set(tiny_checkpoints, exact):
    """The exact sampler perturbed the logits before truncating, the normal one after: with noise and top-k, exact
    mode sampled outside the clean top-k (70/120 tokens in a review) while reporting its size, and the trainer
    rebuilds π's support as the clean top-k. Both now truncate first: with top_k = 1 the noise cannot change a
    token, so the noisy tokens are the noiseless ones, each with log μ = 0."""
    engine = JaxEngine(str(tiny_checkpoints["untied"]))
    spec = SamplingSpec(n=3, max_tokens=10, temperature=1.0, seed=5, top_k=1, exact=exact)
    clean = engine.generate(PROMPTS[:2], spec)
    noisy = engine.generate(PROMPTS[:2], SamplingSpec(**{**spec.__dict__, "logit_noise_std": 5.0}))
    for g_clean, g_noisy in zip(clean, noisy):
        for a, b in zip(g_clean, g_noisy):
            assert b.token_ids == a.token_ids and set(b.kept_counts) == {1}
            np.testing.assert_array_equal(b.logprobs, np.zeros(len(b.token_ids), np.float32))
