"""FP16 paper §4.1 sanity test: DeepSeek-R1-Distill-Qwen-1.5B on its "perfectible" MATH subset, FP16 on both sides.

"Defeating the Training-Inference Mismatch via FP16" §4: 64 questions × 8 rollouts per policy iteration,
4 gradient steps, clip-higher 0.28, importance-sampling cap C = 3, context 8k; FP16 for the trainer and
the rollout engine (the combination that reached ~100 % training accuracy). The perfectible dataset keeps
MATH problems whose initial accuracy lies in [0.2, 0.8] over 40 samples. Build it from the whole MATH train
set with this config's model, template and sampling settings (the output keeps the MATH format), then train:
    jaxrl-mismatch perfectible --config configs/r1_distill_1p5b_fp16_sanity.py \
        --model /data/DeepSeek-R1-Distill-Qwen-1.5B --file /data/math_train.jsonl --out /data/math_perfectible.jsonl
    jaxrl-mismatch train --config configs/r1_distill_1p5b_fp16_sanity.py \
        --config.model.path=/data/DeepSeek-R1-Distill-Qwen-1.5B \
        --config.task.files.train=/data/math_perfectible.jsonl --config.task.files.validation=/data/math500.jsonl
Switch `trainer.precision`/`rollout.dtype` to bf16/bfloat16 for the paper's BF16 baseline.
"""

from jaxrl_mismatch.train.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/r1_distill_1p5b_fp16_sanity"
    c.steps = 500
    c.model.path = "checkpoints/DeepSeek-R1-Distill-Qwen-1.5B"

    c.task.name = "math"
    c.task.template = "r1_distill"
    c.task.files = {"train": "data/math_perfectible.jsonl", "validation": "data/math500.jsonl"}
    c.task.num_val = 500
    c.task.max_prompt_len = 1024

    c.rollout.engine = "vllm"
    c.rollout.dtype = "float16"
    c.rollout.group_size = 8
    c.rollout.max_tokens = 7000  # context 8,000 with the prompt
    c.rollout.temperature = 1.0

    c.batch.prompts_per_step = 64
    c.batch.minibatches = 4  # 4 gradient steps per policy iteration
    c.batch.dynamic_sampling = False
    c.batch.microbatches = 8

    c.trainer.precision = "fp16"  # FP16 compute with dynamic loss scaling; float32 master weights
    c.trainer.mesh = {"data": 1, "fsdp": -1, "tensor": 1}
    c.trainer.chunk_size = 1024
    c.trainer.remat = True  # 8k-token responses: recompute block activations in the backward pass

    c.optim.lr = 1e-6
    c.optim.max_grad_norm = 1.0

    c.objective.preset = "drgrpo_token_tis"  # FP16 paper eq. 9: Dr.GRPO + token TIS, clip-higher 0.28
    c.objective.overrides.correction_cap = 3.0  # C = 3 (§4.1)
    c.objective.overrides.max_len = 7000  # Dr.GRPO's constant normaliser L = the max response length

    c.eval.every = 25
    c.eval.k = 4
    c.eval.greedy = False
    c.checkpoint.every = 25
    return c
