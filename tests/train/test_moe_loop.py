"""A tiny Qwen3-MoE policy through the real RL loop (issue 11): `Trainer` with a real rollout-server subprocess
(built-in jax engine, which returns routing), 2 steps each with routing replay off and R3.

The checkpoint is a random MoE `Transformer` saved in HF format with the arithmetic tokenizer, the files the
warm start writes for the dense demo policy. A random policy rarely answers right, so most groups carry zero
advantage; what is checked is the plumbing: routing collected, broadcast, replayed, and every moe/* metric
logged and finite, with fp32 R3 giving π(θ_old) = μ.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.data.tokenizer import build_arithmetic_tokenizer, save_tokenizer
from jaxrl_mismatch.jobs.warmstart import write_generation_config
from jaxrl_mismatch.metrics import moe_metric_names
from jaxrl_mismatch.models import ModelConfig, Transformer, hf_io
from jaxrl_mismatch.runlog import read_jsonl
from tests.train.test_loop_integration import _run, tiny_config


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe_policy") / "ckpt"
    tok = build_arithmetic_tokenizer()
    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1e4, rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
        max_position_embeddings=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        norm_topk_prob=True, mlp_only_layers=(0,),
    )
    hf_io.save_hf(Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(0)), cfg, str(out))
    save_tokenizer(tok, str(out), model_max_length=128)
    write_generation_config(tok, str(out), 16)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("replay,staleness", [("off", 0), ("R3", 0), ("off", 1)], ids=["off", "R3", "async"])
def test_moe_policy_runs_the_loop(moe_policy, tmp_path, replay, staleness):
    c = tiny_config(moe_policy, tmp_path / "run", max_tokens=16)
    c.steps = 2
    c.controller.name, c.controller.kwargs = "none", {}  # tiny_config's controller off (its kwargs would do nothing)
    c.batch.dynamic_sampling = False
    c.eval.every, c.eval.k, c.eval.greedy = 0, 1, False
    c.checkpoint.every = 0
    c.trainer.routing_replay = replay
    c.objective.router_aux_coef = 0.01
    c.rollout.max_staleness, c.rollout.fixed_staleness = staleness, staleness > 0  # fixed: step 1 is at lag 1
    summary = _run(c)
    assert summary["end_step"] == 2
    steps = [r for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl")) if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        keys = moe_metric_names((1,), with_rollout=True, with_lag=staleness > 0)
        for key in keys + ["moe/aux_loss", "grad/norm", "loss/total"]:
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r.get(key))
        assert r["moe/aux_loss"] > 0
        if staleness:  # a lagged row's μ is the engine at its own version: fp32 precision part only
            assert r["staleness/precision_rho_std"] < 1e-4
            # fp32 engine and trainer route alike at the same weights (a near tie may flip a rare token)
            assert r["moe/router_disagree_precision_frac"] <= 0.01
            # per position, disagree(engine, θ_old) ≤ disagree(engine, θ_behav) + disagree(θ_behav, θ_old)
            assert r["moe/router_disagree_frac"] <= (r["moe/router_disagree_precision_frac"]
                                                     + r["moe/router_disagree_staleness_frac"] + 1e-6)
        else:
            assert r["mismatch/rho_std"] < 1e-4  # fp32 engine and trainer
        if replay == "R3":  # the trainer replays the engine's routing: π(θ_old) = μ up to fp32 rounding
            assert r["mismatch/log_ppl_abs_diff"] < 1e-5
    if staleness:  # step 0 is synchronous (nothing stale); step 1's rows were all sampled one version back, and
        # the update between moved the router (aux loss): that disagreement is staleness, not precision
        assert steps[0]["moe/router_disagree_staleness_frac"] == 0 and steps[1]["staleness/version_lag_mean"] == 1
        assert steps[1]["moe/router_disagree_staleness_frac"] > 0.05
