"""Policy models: one decoder (Llama-3, Qwen2/2.5, Qwen3, Qwen3-MoE), log-probs, KV cache, HF checkpoint I/O.

See docs/contracts.md for the parameter paths and function signatures other packages rely on.
"""

from jaxrl_mismatch.models.attention import ATTENTION_IMPLS
from jaxrl_mismatch.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from jaxrl_mismatch.models.hf_io import hf_to_params, load_hf, params_to_hf, save_hf
from jaxrl_mismatch.models.kv_cache import (
    KVCache, decode_loop, decode_step, distinct_rows, init_cache, left_pad, prefill, prefill_inputs, select_rows)
from jaxrl_mismatch.models.moe import RouterOutput, load_balancing_loss
from jaxrl_mismatch.models.model import REMAT_POLICIES, Transformer, positions_from_mask, positions_from_segments
from jaxrl_mismatch.models.scoring import Scores, logprobs_from_hidden, make_scorer, score_tokens, token_logprobs

__all__ = [
    "ATTENTION_IMPLS",
    "REMAT_POLICIES",
    "SUPPORTED_ARCHITECTURES",
    "KVCache",
    "ModelConfig",
    "RouterOutput",
    "Scores",
    "Transformer",
    "decode_loop",
    "decode_step",
    "distinct_rows",
    "hf_to_params",
    "init_cache",
    "left_pad",
    "load_balancing_loss",
    "load_hf",
    "logprobs_from_hidden",
    "make_scorer",
    "params_to_hf",
    "positions_from_mask",
    "positions_from_segments",
    "prefill",
    "prefill_inputs",
    "save_hf",
    "select_rows",
    "score_tokens",
    "token_logprobs",
]
