"""E3 — does precision change the *outcome*? The FP16 paper's sanity matrix at CPU scale (its §4, Fig. 3).

    jaxrl-mismatch compare experiments/e3_precision.py:ppo            # one grid per algorithm (ALGORITHMS):
    jaxrl-mismatch compare experiments/e3_precision.py:pg_seq_is      #   bf16 / fp16 / fp32, 5 paired seeds
    jaxrl-mismatch compare experiments/e3_precision.py:ppo@1e-4       # the same grid at another LR
    jaxrl-mismatch compare experiments/e3_precision.py:long_ppo       # on the :long task (responses ~28 tokens)
    jaxrl-mismatch compare experiments/e3_precision.py:exact          # bf16 vs bf16 + rollout.exact (PPO)
    jaxrl-mismatch compare experiments/e3_precision.py:long_exact     # the same on the :long task
    jaxrl-mismatch compare experiments/e3_precision.py:discover_ppo   # on :long_discover (RL grows responses)
    jaxrl-mismatch compare experiments/e3_precision.py:discover_exact_pg_seq_is   # exact grid of another algorithm

The FP16 paper trains each of its algorithms in BF16 and FP16 (trainer and rollout engine in the same
precision) and finds the outcome differs: BF16 runs collapse, FP16 ones keep improving, FP16 PG-seq-IS does
best (Fig. 3). The shipped precision grid (experiments/precisions.py, 1 seed) measured the mismatch of each
pair but not the outcome. Here each grid is one algorithm in three precisions, paired against `bf16`:

- `bf16` / `fp16`: trainer and engine both in that precision (fp16 with dynamic loss scaling);
- `fp32`: both sides float32 (mismatch ~1e-7): the control for "fp16 wins because its mismatch is small".

and the `exact` grid separates bf16's *rounding* from its *mismatch*: `bf16_exact` samples from the
trainer's own bf16 π(θ_old) (`rollout.exact`, VeXact review) — the same arithmetic with zero mismatch. On
the :long task it is a shorter grid (40 steps, run when exact sampling was ~20× slower); on the default task
it has the other grids' 80 steps (speculative exact sampling costs ~1.5× the normal sampler).

Algorithms: the paper's eqs. 3–10 as presets (objectives/policy.py). The GRPO family is the paper's Dr.GRPO
form (mean baseline, per-sequence token sum over the constant L = max response length, clip-higher 0.28,
C = 3, §4.1); PG-seq-* are eqs. 5–7; GSPO its own clip. The paper's sanity metric is the *training* reward
on its perfectible set, so collapse is judged on `reward/mean` (10-step trailing median, half its peak, 10 steps).

Two task settings (configs/arith_length_cpu.py), because the first one tried does not learn:
- `long_*` (the first grids, run 2026-11-25): the `:long` task (4–6 operands, full scratchpads of ~28
  tokens, 57 % at T = 1 before training — the paper's perfectible band), 8 prompts × 8 samples, 4 optimizer
  steps per batch (§4.1), 60 steps. At lr 3e-4 every arm, fp32 included, degrades from step 0; at 1e-4
  (`long_ppo@1e-4`) no arm moves: validation 0.577 → 0.55–0.57, training reward flat (docs/experiments.md).
- default (short): the experiments' default task, on which E0–E2 runs learn (validation ~0.1 → ~0.5 in
  80–100 steps at 3e-4 in E1), 16 prompts × 8 samples, the config's 2 optimizer steps per batch, 80 steps,
  lr 3e-4 (E1's high LR, learning without mismatch). Responses are shorter (~16–20 tokens), so bf16's
  per-sequence mismatch is smaller than the paper's — the trade for runs that learn.
- `discover_*`: the `:long_discover` task (`:long`'s 4–6 operands, warm start ending in the shortcut phase of
  the default task, so RL has to rediscover the scratchpad: responses grow towards ~28 tokens), with the
  default task's batch, 80 steps, lr 3e-4 — longer responses in a run that learns.
Sizing: ~2 min per run here, two at a time: ~15–20 min per short grid. Resumable.
"""

from jaxrl_mismatch.jobs.compare import split_lr

LR = 3e-4  # every grid's default; `GRID@LR` runs it at another LR
LONG_LR = 3e-4  # the LR the :long grids' directories were made with: another LR is part of their name
STEPS, LONG_STEPS, EXACT_STEPS = 80, 60, 40
LONG_MAX_TOKENS = 64  # configs/arith_length_cpu.py:long (responses ~28 tokens); Dr.GRPO's L
MAX_TOKENS = 48  # the default task's rollout.max_tokens (responses ~16–20 tokens)
ALGORITHMS = {
    # FP16 paper eq. 8 (+ footnote 1: Dr.GRPO) with clip-higher 0.28 (§4.1): "GRPO" / PPO without correction.
    "ppo": {"objective.preset": "drgrpo", "objective.overrides.eps_high": 0.28},
    "token_tis": {"objective.preset": "drgrpo_token_tis"},  # eq. 9
    "seq_mis": {"objective.preset": "drgrpo_seq_mis"},  # eq. 10
    "seq_tis": {"objective.preset": "drgrpo_seq_mis", "objective.overrides.correction": "seq_sum_tis"},
    "pg_seq_is": {"objective.preset": "pg_seq_is"},  # eq. 5
    "pg_seq_tis": {"objective.preset": "pg_seq_tis"},  # eq. 6
    "pg_seq_mis": {"objective.preset": "pg_seq_mis"},  # eq. 7
    "gspo": {"objective.preset": "gspo"},
}
PRECISIONS = {
    "bf16": {"trainer.precision": "bf16", "rollout.dtype": "bfloat16"},
    "fp16": {"trainer.precision": "fp16", "rollout.dtype": "float16"},
    "fp32": {"trainer.precision": "fp32", "rollout.dtype": "float32"},
    "bf16_exact": {"trainer.precision": "bf16", "rollout.dtype": "bfloat16", "rollout.exact": True},
}


def get_spec(grid: str = "ppo"):
    grid, lr = split_lr(grid, LR)
    long = grid.startswith("long_")
    discover = grid.startswith("discover_")
    algo_name = grid.removeprefix("long_").removeprefix("discover_")
    exact = algo_name == "exact" or algo_name.startswith("exact_")
    base_algo = "ppo" if algo_name == "exact" else algo_name.removeprefix("exact_")
    if base_algo not in ALGORITHMS:
        raise ValueError(f"unknown grid {grid!r}; valid: {', '.join(ALGORITHMS)}, exact (PPO), exact_ALGO, the same "
                         f"with long_ or discover_ (each optionally @LR)")
    algo = dict(ALGORITHMS[base_algo])
    max_tokens = LONG_MAX_TOKENS if long or discover else MAX_TOKENS
    if algo["objective.preset"].startswith("drgrpo"):
        algo["objective.overrides.max_len"] = max_tokens
    if long:
        name = f"e3_precision_{algo_name}" + ("" if lr == LONG_LR else f"_lr{lr:g}")
        setting = {"steps": EXACT_STEPS if exact else LONG_STEPS, "rollout.max_tokens": max_tokens,
                   "batch.prompts_per_step": 8, "batch.minibatches": 4, "batch.microbatches": 1}
    elif discover:
        name = f"e3_discover_{algo_name}" + ("" if lr == LR else f"_lr{lr:g}")
        setting = {"steps": STEPS, "rollout.max_tokens": max_tokens}  # the task config's batch, as the default task's
    else:
        name = f"e3_short_{algo_name}" + ("" if lr == LR else f"_lr{lr:g}")
        setting = {"steps": STEPS}  # the task config's batch: 16 prompts × 8, 2 minibatches, 2 microbatches
    precisions = ("bf16", "bf16_exact") if exact else ("bf16", "fp16", "fp32")
    return {
        "name": name,
        "config": "configs/arith_length_cpu.py" + (":long" if long else ":long_discover" if discover else ""),
        # (the order of the overrides is the order of the train command's flags: the :long grids' runs were
        # made with steps, optim.lr, then the batch, and `compare` resumes a run only under the same command)
        "overrides": {"steps": setting.pop("steps"), "optim.lr": lr, **setting, "eval.every": 10, "log.report": False,
                      "checkpoint.every": 20, **algo},
        "variants": {p: PRECISIONS[p] for p in precisions},
        "seeds": [0, 1, 2, 3, 4],
        "baseline": "bf16",
        # fp32 has less mismatch than fp16 (~1e-7 vs ~2e-4): if fp16's outcome comes from its small mismatch,
        # fp32 does at least as well.
        "controls": {} if exact else {"fp16": "fp32"},
        "out": f"runs/compare/{name}",
        "collapse": {"metric": "reward/mean", "frac": 0.5, "window": 10, "patience": 10},
    }
