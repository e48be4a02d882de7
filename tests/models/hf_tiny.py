"""Tiny random Hugging Face models for parity and I/O tests (no network: built from config classes).

HF initialises norms to 1 and biases to 0, which would let a wrong norm or a dropped bias pass a parity
test; `make_hf_model` therefore redraws every parameter (norm gains ~1 ± 0.2, biases ~N(0, 0.1²)).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128,
    attn_implementation="eager",
)
# Llama-3 scaling with a short original context so that it changes frequencies at test lengths:
# head_dim 16 gives wavelengths 6.3, 20, 63, ...; with 32/4 = 8 and 32/1 = 32 as band edges all
# three branches (kept, interpolated, divided by `factor`) are exercised.
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def tiny_hf_config(family: str, tied: bool, **overrides):
    """`overrides` replace any of the defaults (e.g. num_attention_heads=2 for head_dim 32)."""
    if family == "llama":
        kw = dict(rope_scaling=LLAMA3_SCALING, rope_theta=10000.0)
        return LlamaConfig(**{**_COMMON, **kw, "tie_word_embeddings": tied, **overrides})
    if family == "qwen2":
        return Qwen2Config(**{**_COMMON, "rope_theta": 1e6, "tie_word_embeddings": tied, **overrides})
    if family == "qwen3":  # head_dim != hidden / heads, as in real Qwen3 checkpoints
        kw = dict(head_dim=32, rope_theta=1e6)
        return Qwen3Config(**{**_COMMON, **kw, "tie_word_embeddings": tied, **overrides})
    raise ValueError(family)


def make_hf_model(family: str, tied: bool, seed: int = 0, **overrides) -> torch.nn.Module:
    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}[family]
    torch.manual_seed(seed)
    model = cls(tiny_hf_config(family, tied, **overrides)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


def padded_batch(seed: int = 0, seq: int = 14) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [4, seq] and mask: one full row, two left-padded rows, one right-padded row."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(4, seq)).astype(np.int32)
    mask = np.ones((4, seq), np.int32)
    mask[1, :3] = 0  # left padding
    mask[2, seq - 5 :] = 0  # right padding
    mask[3, :6] = 0  # left padding
    tokens[mask == 0] = 0  # pad id
    return tokens, mask


def positions(mask: np.ndarray) -> np.ndarray:
    """Same convention as `models.positions_from_mask`, computed independently in numpy."""
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def hf_token_logprobs(model: torch.nn.Module, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) from the PyTorch reference, [B, S-1] float64."""
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(tokens).long(),
            attention_mask=torch.from_numpy(mask).long(),
            position_ids=torch.from_numpy(positions(mask)).long(),
        )
        logp = torch.log_softmax(out.logits.float(), dim=-1)[:, :-1]
        picked = torch.gather(logp, -1, torch.from_numpy(tokens[:, 1:]).long()[..., None])[..., 0]
    return picked.double().numpy()


def real_positions(mask: np.ndarray) -> np.ndarray:
    """Where both the input token and its target are real tokens: [B, S-1] bool."""
    return (mask[:, :-1] == 1) & (mask[:, 1:] == 1)
