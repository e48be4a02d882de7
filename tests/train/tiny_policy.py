"""A tiny Qwen3-style policy, its optimizer/objective, and a synthetic RL batch, for train-step tests."""

from __future__ import annotations

import numpy as np
from flax import nnx

from jaxrl_mismatch import precision
from jaxrl_mismatch.models import ModelConfig, Transformer
from jaxrl_mismatch.models.sharding import make_mesh
from jaxrl_mismatch.metrics import metrics_config
from jaxrl_mismatch.objectives import objective_config
from jaxrl_mismatch.schedules import make_optimizer
from jaxrl_mismatch.train.batch import RolloutBatch
from jaxrl_mismatch.train.objective import PolicyLoss
from jaxrl_mismatch.train.state import init_state, split_model
from jaxrl_mismatch.models.scoring import make_scorer
from jaxrl_mismatch.train.step import make_update_fn, jit_update, place_batch, place_state

VOCAB = 64


def tiny_config(**overrides) -> ModelConfig:
    kw = dict(
        architecture="Qwen3ForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=1e4, rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
        max_position_embeddings=64,
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def synthetic_batch(batch: int = 8, seq: int = 16, prompt_len: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
    """Random prompt+response token rows with right padding and a per-sequence advantage."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(batch, seq)).astype(np.int32)
    lengths = rng.integers(prompt_len + 2, seq + 1, size=batch)
    attention_mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    tokens = tokens * attention_mask
    t = np.arange(seq - 1)[None, :]  # target index t predicts tokens[:, t + 1]
    response_mask = ((t + 1 >= prompt_len) & (t + 1 < lengths[:, None])).astype(np.float32)
    adv = rng.normal(size=(batch, 1)).astype(np.float32)
    return {
        "tokens": tokens,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "advantages": np.broadcast_to(adv, (batch, seq - 1)) * response_mask,
    }


def build(mesh_axes=None, devices=None, *, policy_name="fp32", num_microbatches=1, lr=1e-2, seed=0,
          objective=None, max_grad_norm=1.0, remat=False, optimizer="adamw"):
    """(mesh, graphdef, state, update, old_logprobs) on the requested mesh."""
    import jax

    devices = devices if devices is not None else jax.devices()[:1]
    mesh = make_mesh(mesh_axes or {"data": -1}, devices=devices)
    pol = precision.policy(policy_name, param_dtype="float32")
    model = Transformer(tiny_config(), pol, rngs=nnx.Rngs(seed))
    model.remat = remat
    graphdef, params = split_model(model)
    opt = make_optimizer(optimizer, learning_rate=lr, max_grad_norm=max_grad_norm)
    state = place_state(init_state(params, opt, precision.loss_scale_for(pol), seed=seed), mesh)
    objective = objective or PolicyLoss(cfg=objective_config("grpo"), metrics_cfg=metrics_config(objective_config("grpo")))
    update_fn = make_update_fn(graphdef, opt, objective, num_microbatches=num_microbatches,
                               max_grad_norm=max_grad_norm, chunk_size=8, mesh=mesh)
    return mesh, graphdef, state, update_fn, make_scorer(graphdef, mesh, chunk_size=8), opt


def full_batch(mesh, old_logprobs, params, np_batch, rollout_noise=0.05, seed=1) -> RolloutBatch:
    """A placed RolloutBatch: old_logp from a real forward at θ_old, rollout_logp = old_logp + noise."""
    old_logp, _ = old_logprobs(params, np_batch["tokens"], np_batch["attention_mask"])
    old = np.asarray(old_logp) * np_batch["response_mask"]
    noise = np.random.default_rng(seed).normal(scale=rollout_noise, size=old.shape).astype(np.float32)
    return place_batch(RolloutBatch(**np_batch, old_logp=old, rollout_logp=(old + noise) * np_batch["response_mask"]),
                       mesh)


__all__ = ["VOCAB", "build", "full_batch", "jit_update", "synthetic_batch", "tiny_config"]
