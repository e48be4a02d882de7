"""MoE config fields (issue 11): `trainer.routing_replay`, `objective.router_aux_coef`, the `expert` mesh axis —
bad values and impossible combinations fail with one line naming the field — and the Qwen3-30B-A3B config
mirrors the objective-level hacking paper's setup (§4.1)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_checks import check_model, validate
from jaxrl_mismatch.train.config_overrides import apply_override
from jaxrl_mismatch.train.config_resume import config_changes
from tests.train.tiny_policy import tiny_config

REPO = Path(__file__).resolve().parents[2]


def _valid():
    c = base_config()
    c.model.path = "checkpoints/some-model"
    return c


def _error(c) -> str:
    with pytest.raises(ConfigError) as e:
        validate(c)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_routing_replay_and_aux_coef_fields_are_validated():
    c = _valid()
    validate(c)
    assert (c.trainer.routing_replay, c.objective.router_aux_coef) == ("off", 0.0)
    c.trainer.routing_replay = "R4"
    assert _error(c).startswith("config.trainer.routing_replay: 'R4' is not one of ['off', 'R2', 'R3']")
    c = _valid()
    c.objective.router_aux_coef = -0.1
    assert _error(c).startswith("config.objective.router_aux_coef: must be a number >= 0")
    with pytest.raises(ConfigError, match=r"config\.objective\.router_aux_coef: expected a number"):
        apply_override(_valid(), "objective.router_aux_coef", "lots")


def test_r3_needs_an_engine_that_returns_routing():
    c = _valid()
    c.trainer.routing_replay = "R3"
    validate(c)  # jax engine
    c.rollout.engine = "vllm"
    msg = _error(c)
    assert msg.startswith("config.trainer.routing_replay: 'R3'") and "vllm engine does not return them" in msg
    c.trainer.routing_replay = "R2"
    validate(c)  # R2 replays the trainer's own routing: any engine
    c = _valid()
    c.trainer.routing_replay, c.rollout.exact = "R3", True
    assert "exact mode returns no routing" in _error(c)
    # stale rows' behaviour forward routes freely: the staleness/precision split would be wrong (a review's repro)
    c = _valid()
    c.trainer.routing_replay, c.rollout.max_staleness = "R3", 1
    assert "'R3' with asynchronous rollouts" in _error(c)
    c.trainer.routing_replay = "R2"
    validate(c)


def test_expert_mesh_axis_is_accepted_and_unknown_axes_are_not():
    c = _valid()
    c.trainer.mesh = {"data": -1, "expert": 1}
    validate(c)
    c.trainer.mesh = {"data": -1, "experts": 2}
    assert _error(c).startswith("config.trainer.mesh: unknown axis 'experts'; valid: data, fsdp, expert, tensor")


def test_replay_and_aux_coef_on_a_dense_model_are_refused():
    dense = tiny_config()
    moe = tiny_config(architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=8)
    c = _valid()
    c.rollout.max_tokens = dense.max_position_embeddings  # no room left for a prompt
    with pytest.raises(ConfigError, match=rf"^config\.rollout\.max_tokens: {c.rollout.max_tokens} response tokens "
                                          r"do not fit .*max_position_embeddings"):
        check_model(c, dense)
    c.rollout.max_tokens = 16
    check_model(c, dense)  # defaults: nothing MoE-only is on
    c.trainer.routing_replay = "R2"
    check_model(c, moe)
    with pytest.raises(ConfigError, match=r"^config\.trainer\.routing_replay: 'R2' replays expert routing, but "
                                          r"checkpoints/some-model is a dense Qwen3ForCausalLM"):
        check_model(c, dense)
    c = _valid()
    c.rollout.max_tokens = 16
    c.objective.router_aux_coef = 0.001
    check_model(c, moe)
    with pytest.raises(ConfigError, match=r"^config\.objective\.router_aux_coef: 0\.001 weights the MoE"):
        check_model(c, dense)


def test_an_expert_axis_on_a_dense_model_or_not_dividing_the_experts_is_refused():
    """Both were accepted: on a dense model the axis was one more data-parallel axis; with 4 not dividing 6 experts
    the expert split was dropped and every device held every expert (no expert parallelism, no warning)."""
    moe = tiny_config(architecture="Qwen3MoeForCausalLM", num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=8)
    c = _valid()
    c.rollout.max_tokens = 16
    c.trainer.mesh = {"data": 1, "expert": 4}
    with pytest.raises(ConfigError, match=r"^config\.trainer\.mesh\.expert: 4 does not divide the 6 experts of "):
        check_model(c, moe)
    with pytest.raises(ConfigError, match=r"^config\.trainer\.mesh\.expert: 4 splits experts, but .* is a dense "):
        check_model(c, tiny_config())
    c.trainer.mesh = {"data": 1, "expert": 3}
    check_model(c, moe)
    c.trainer.mesh = {"data": -1, "expert": 1}
    check_model(c, tiny_config())


def test_cudnn_attention_that_cannot_run_is_refused_before_the_run():
    """It passed every check and failed inside the first jitted forward, after the warm start and a rollout."""
    import jax

    c = _valid()
    c.rollout.max_tokens = 16
    c.trainer.attention_impl = "cudnn"
    why = "needs a GPU" if jax.default_backend() != "gpu" else "needs bf16/fp16 compute"
    with pytest.raises(ConfigError, match=rf"^config\.trainer\.attention_impl: 'cudnn' cannot run: it {why}"):
        check_model(c, tiny_config())
    c.trainer.attention_impl = "auto"
    check_model(c, tiny_config())


def test_qwen3_30b_a3b_config_mirrors_the_paper():
    path = REPO / "configs" / "qwen3_30b_a3b_grpo_tis.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    validate(c)
    # §4.1: 128 problems × 16 responses, 4 updates per step, 8K responses, token clip 0.2/0.2, TIS (Fig. 2).
    assert (c.batch.prompts_per_step, c.rollout.group_size, c.batch.minibatches) == (128, 16, 4)
    assert c.rollout.max_tokens == 8192 and c.task.name == "dapo"
    assert (c.rollout.engine, c.rollout.dtype, c.trainer.precision) == ("vllm", "bfloat16", "bf16")
    from jaxrl_mismatch.train.learner_config import build_policy_loss

    obj = build_policy_loss(c)
    assert (obj.cfg.eps_low, obj.cfg.eps_high, obj.cfg.correction, obj.cfg.advantages) == (0.2, 0.2, "token_tis", "grpo")
    # OLH eqs. 2 and 16: 1/G Σ_i 1/|o_i| Σ_t for the GRPO arms and the GSPO arm alike (the preset's is token-mean).
    assert obj.cfg.agg == "seq-mean-token-mean"
    apply_override(c, "objective.preset", "gspo")
    assert build_policy_loss(c).cfg.agg == "seq-mean-token-mean"
    apply_override(c, "objective.preset", "grpo")
    assert c.trainer.mesh["expert"] > 1 and c.trainer.routing_replay == "off"
    # Its documented R3 switch is valid only together with the jax engine.
    apply_override(c, "trainer.routing_replay", "R3")
    assert "vllm engine does not return them" in _error(c)
    apply_override(c, "rollout.engine", "jax")
    validate(c)


def test_runs_saved_before_the_moe_fields_resume_unless_they_are_turned_on():
    saved = base_config().to_dict()
    del saved["trainer"]["routing_replay"], saved["objective"]["router_aux_coef"]
    assert config_changes(saved, base_config().to_dict()) == []
    c = base_config()
    c.trainer.routing_replay = "R2"
    assert config_changes(saved, c.to_dict()) == ["trainer.routing_replay: '<unset>' → 'R2'"]
