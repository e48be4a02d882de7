"""Tiny random Qwen3-MoE checkpoints for parity, I/O and sharding tests (built from the config class, no network).

As in `hf_tiny.py`, every parameter is redrawn (norm gains ~1 ± 0.2, weights ~N(0, 0.08²)); the router is
drawn wider (~N(0, 0.5²)) so that top-k choices are decisive rather than near ties.
"""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.models.hf_tiny import VOCAB

MOE_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=128, rope_theta=1e6,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], attn_implementation="eager",
)


def tiny_moe_config(tied: bool = False, **overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**MOE_COMMON, "tie_word_embeddings": tied, **overrides})


def make_moe_model(tied: bool = False, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_moe_config(tied, **overrides)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model
