"""The experiments' CPU task: arithmetic RL where responses grow because longer reasoning pays.

    jaxrl-mismatch train --config configs/arith_length_cpu.py
    jaxrl-mismatch train --config configs/arith_length_cpu.py:long   # longer responses (experiments/e3_precision.py)
    jaxrl-mismatch train --config configs/arith_length_cpu.py:long_discover   # RL grows them (the same)

Why: on the demo task responses stay ~18 tokens, so the LR paper's length-triggered decay never fires
and nothing collapses. Here the warm start teaches the full scratchpad, then for its last 150 steps mostly
the bare answer "#42", so the initial policy mostly answers at once and is mostly wrong; RL discovers that
writing the steps is what gets rewarded, and the mean response length rises during the run. The
comparison specs in `experiments/` run this config under the mismatch sources of the rollout engine
(`rollout.logit_noise_std`, precisions, `rollout.quantize`) with different LR schedules, corrections and
precisions; docs/experiments.md has what they measured, with seed counts.

`:long` is the same task with 4–6 operands (one scratchpad step each) and no shortcut phase: every response
is a full scratchpad, ~28 tokens instead of ~16 (the FP16 paper's point is that mismatch accumulates over a
response's tokens). Its warm start (1200 steps) answered 57 % of held-out prompts at T = 1 (greedy 71 %)
— inside the 20–80 % band of the FP16 paper's "perfectible" sanity set.
(With 6–8 operands and 900 steps it answered 0.8 %: too hard for RL to start.) At lr 1e-4–1e-3 RL does not
improve it (docs/experiments.md, E3): its errors are not ones that 60 steps of RL fix.

`:long_discover` is `:long`'s task (4–6 operands) with the default variant's shortcut phase (the last 150 of
1200 warm-start steps mostly target the bare answer), so, as on the default task, RL has to rediscover the
scratchpad and responses grow towards `:long`'s ~28 tokens during the run.
"""

from jaxrl_mismatch.train.config import base_config


def get_config(variant: str = ""):
    c = base_config()
    c.run_dir = "runs/arith_length"
    c.steps = 80
    c.model.path = "runs/arith_length_base"
    c.model.warmstart_if_missing = True
    # 750 steps of full scratchpads, then 150 where 80 % of the targets are the bare answer.
    c.model.warmstart_args = "--steps 900 --shortcut-prob 0.8 --shortcut-steps 150"

    c.task.name = "arithmetic"
    c.task.num_train = 20000
    c.task.num_val = 128
    c.task.data_seed = 0  # the same problems and held-out prompts for every seed of a grid

    c.rollout.group_size = 8
    c.rollout.max_tokens = 48

    c.batch.prompts_per_step = 16  # 128 completions per step
    c.batch.max_oversample_rounds = 1
    c.batch.minibatches = 2
    c.batch.microbatches = 2

    c.trainer.chunk_size = 64
    # Measured while tuning (1 seed each, 80-100 steps): 7e-4 learns without injected mismatch and degrades
    # with rollout.logit_noise_std = 3; 1e-3 collapsed without mismatch; 5e-4 trained at σ = 0 and σ = 2.
    c.optim.lr = 7e-4
    c.optim.max_grad_norm = 1.0

    c.objective.preset = "grpo"

    c.eval.every = 10
    c.eval.k = 2
    c.checkpoint.every = 50

    if variant == "long":
        c.run_dir = "runs/arith_long"
        c.model.path = "runs/arith_long_base"
        c.model.warmstart_args = "--steps 1200 --min-operands 4 --max-operands 6 --max-len 160"
        c.rollout.max_tokens = 64
    elif variant == "long_discover":
        c.run_dir = "runs/arith_long_discover"
        c.model.path = "runs/arith_long_discover_base"
        c.model.warmstart_args = ("--steps 1200 --min-operands 4 --max-operands 6 --max-len 160 "
                                  "--shortcut-prob 0.8 --shortcut-steps 150")
        c.rollout.max_tokens = 64
    elif variant:
        raise ValueError(f"unknown variant {variant!r}; valid: '' (default), 'long', 'long_discover'")
    return c
