"""LR-schedule paper replication: Qwen3-4B-Base on DAPO-Math with the length-triggered step decay.

"Beyond Precision: Training-Inference Mismatch is an Optimization Problem and Simple LR Scheduling Fixes
It" (arXiv 2602.01826): lr 1e-6, batch 64 = PPO mini-batch (fully on-policy), grad clip 1.0, max response
8192, oversampling + rejection of all-0/all-1 groups, mismatch tracked as log_ppl_abs_diff; the LR halves
every 1.8 × (surge step) once the mean response length surges 3×, down to 0.1 × lr.

For a GPU/TPU cluster with local files (no hub access at run time):
    jaxrl-mismatch train --config configs/qwen3_4b_dapo_lr_decay.py \
        --config.model.path=/data/Qwen3-4B-Base \
        --config.task.files.train=/data/dapo-math-17k.jsonl \
        --config.task.files.validation=/data/aime24.jsonl
Set `rollout.address` to use an already running vLLM rollout server (see launch/).
"""

from jaxrl_mismatch.train.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/qwen3_4b_dapo_lr_decay"
    c.steps = 1000
    c.model.path = "checkpoints/Qwen3-4B-Base"

    c.task.name = "dapo"  # DAPO-Math-17k JSONL (see docs/data.md for the expected fields)
    c.task.files = {"train": "data/dapo-math-17k.jsonl", "validation": "data/aime24.jsonl"}
    c.task.num_val = 30
    c.task.max_prompt_len = 2048

    c.rollout.engine = "vllm"
    c.rollout.dtype = "bfloat16"  # the paper's setting: BF16 rollouts, where the mismatch grows
    c.rollout.group_size = 16  # DAPO recipe
    c.rollout.max_tokens = 8192
    c.rollout.temperature = 1.0

    c.batch.prompts_per_step = 64
    c.batch.minibatches = 1  # batch = PPO mini-batch: completely on-policy
    c.batch.dynamic_sampling = True
    c.batch.max_oversample_rounds = 10
    c.batch.microbatches = 16

    c.trainer.precision = "bf16"
    c.trainer.fp32_lm_head = True
    c.trainer.mesh = {"data": 1, "fsdp": -1, "tensor": 1}
    c.trainer.chunk_size = 1024
    c.trainer.remat = True  # 8k-token responses: recompute block activations in the backward pass

    c.optim.lr = 1e-6
    c.optim.weight_decay = 0.01
    c.optim.max_grad_norm = 1.0

    c.controller.name = "length_triggered_decay"
    c.controller.kwargs.surge_ratio = 3.0
    c.controller.kwargs.period_factor = 1.8
    c.controller.kwargs.floor = 0.1
    c.controller.kwargs.baseline_window = 20
    c.controller.kwargs.window = 10

    c.objective.preset = "dapo"  # clip-higher 0.28, token-mean

    c.eval.every = 20
    c.eval.k = 8  # avg@8 on AIME
    c.eval.temperature = 1.0
    c.eval.greedy = False
    c.checkpoint.every = 20
    return c
