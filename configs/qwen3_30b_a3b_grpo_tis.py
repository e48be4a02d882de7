"""Objective-level hacking paper's MoE setup: Qwen3-30B-A3B with GRPO token clipping + token TIS, BF16 rollouts.

Dong et al., "Probing RLVR training instability through the lens of objective-level hacking" §4.1:
Qwen3-30B-A3B on DAPO-Math-17k, AIME24 for validation; each step samples 128 problems × 16 responses,
then 4 parameter updates (off-policy: 4 minibatches of 32 prompts); max response length 8K; GRPO with token-level clipping ε_low = ε_high = 0.2
and the per-response token mean of eq. 2;
Fig. 2's green run adds truncated importance sampling (TIS, Yao et al. 2025) on ρ = π_train/π_infer (eq. 5).
Inference ran in vLLM (BF16) and training in Megatron (BF16) on A100s — the mismatch the paper studies.

What the paper does not state, chosen here and said plainly: the learning rate (1e-6, the DAPO/verl recipe
value for this model), the TIS cap (objective default C = 3; Yao et al. use 2 — override with
`--config.objective.overrides.correction_cap=2`), and no router auxiliary loss in RL (router_aux_coef = 0).
For the paper's other arms: `--config.objective.overrides.correction=none` (Fig. 2 grey),
`--config.objective.preset=gspo` (Fig. 4 blue), `--config.objective.overrides.eps_high=0.24|0.28` (Fig. 4),
`--config.diagnostics.weight_distortion_delta=2` (Fig. 5).

Routing replay is off, as in the paper. vLLM does not return the experts it routed to, so R3 (and the
moe/router_disagree_* metrics) need the built-in engine: `--config.rollout.engine=jax
--config.trainer.routing_replay=R3`; R2 works with either engine.

    jaxrl-mismatch train --config configs/qwen3_30b_a3b_grpo_tis.py \
        --config.model.path=/data/Qwen3-30B-A3B \
        --config.task.files.train=/data/dapo-math-17k.jsonl --config.task.files.validation=/data/aime24.jsonl
"""

from jaxrl_mismatch.train.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/qwen3_30b_a3b_grpo_tis"
    c.steps = 1000
    c.model.path = "checkpoints/Qwen3-30B-A3B"

    c.task.name = "dapo"  # DAPO-Math-17k JSONL (docs/data.md)
    c.task.files = {"train": "data/dapo-math-17k.jsonl", "validation": "data/aime24.jsonl"}
    c.task.num_val = 30
    c.task.max_prompt_len = 2048

    c.rollout.engine = "vllm"
    c.rollout.dtype = "bfloat16"
    c.rollout.group_size = 16
    c.rollout.max_tokens = 8192
    c.rollout.temperature = 1.0

    c.batch.prompts_per_step = 128
    c.batch.minibatches = 4  # "4 parameter update steps" per rollout batch
    c.batch.dynamic_sampling = False  # the paper samples 128 problems per step (no DAPO oversampling stated)
    c.batch.microbatches = 16  # 32 prompts × 16 responses per minibatch: 32 rows per microbatch

    c.trainer.precision = "bf16"
    c.trainer.fp32_lm_head = False
    # 128 experts split over 8 devices per expert group; FSDP over the rest.
    c.trainer.mesh = {"data": 1, "fsdp": -1, "expert": 8, "tensor": 1}
    c.trainer.chunk_size = 1024
    c.trainer.remat = True
    c.trainer.routing_replay = "off"

    c.optim.lr = 1e-6
    c.optim.weight_decay = 0.01
    c.optim.max_grad_norm = 1.0

    c.objective.preset = "grpo"  # GRPO advantages, token clipping ε = 0.2 both sides (OLH §4.1)
    c.objective.overrides.correction = "token_tis"  # Fig. 2 green: TIS on ρ (OLH eq. 5)
    # OLH eq. 2 (and eq. 16 for the GSPO arm) averages tokens within each response, then responses:
    # 1/G Σ_i 1/|o_i| Σ_t, not the preset's DAPO token mean; the same aggregation for every arm.
    c.objective.overrides.agg = "seq-mean-token-mean"
    c.objective.router_aux_coef = 0.0

    c.eval.every = 20
    c.eval.k = 8
    c.eval.temperature = 1.0
    c.eval.greedy = False
    c.checkpoint.every = 20
    return c
