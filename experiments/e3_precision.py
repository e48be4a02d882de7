"""E3 — does precision change the *outcome*? The FP16 paper's sanity matrix at CPU scale (its §4, Fig. 3).

    jaxrl-mismatch compare experiments/e3_precision.py:ppo        # one grid per algorithm (ALGORITHMS below):
    jaxrl-mismatch compare experiments/e3_precision.py:pg_seq_is  #   bf16 / fp16 / fp32, 5 paired seeds, LR 1e-4
    jaxrl-mismatch compare experiments/e3_precision.py:ppo@3e-4   # the same grid at another LR
    jaxrl-mismatch compare experiments/e3_precision.py:exact@3e-4 # bf16 vs bf16 + rollout.exact (PPO), 5 seeds

The FP16 paper trains each of its algorithms in BF16 and FP16 (trainer and rollout engine in the same
precision) and finds the outcome differs: BF16 runs collapse, FP16 ones keep improving, FP16 PG-seq-IS does
best (Fig. 3). The shipped precision grid (experiments/precisions.py, 1 seed) measured the mismatch of each
pair but not the outcome. Here each grid is one algorithm in three precisions, paired against `bf16`:

- `bf16` / `fp16`: trainer and engine both in that precision (fp16 with dynamic loss scaling);
- `fp32`: both sides float32 (mismatch ~1e-7).

and the `exact` grid separates bf16's *rounding* from its *mismatch*: `bf16_exact` samples from the
trainer's own bf16 π(θ_old) (`rollout.exact`, VeXact review) — the same arithmetic with zero mismatch. It
is its own, shorter grid because exact sampling is slow on CPU (smoke run: 16–25 s per step against ~2 s).

Algorithms: the paper's eqs. 3–10 as presets (objectives/policy.py). The GRPO family is the paper's Dr.GRPO
form (mean baseline, per-sequence token sum over the constant L = max response length, clip-higher 0.28,
C = 3, §4.1); PG-seq-* are eqs. 5–7; GSPO its own clip. 4 optimizer steps per rollout batch, as §4.1.
The paper's sanity metric is the *training* reward on its perfectible set, so collapse is judged on
`reward/mean` (10-step trailing median, half its peak, 10 steps).

Longer responses (`configs/arith_length_cpu.py:long`: 4–6 operands, full scratchpads of ~28 tokens, 57 %
initial accuracy at T = 1 — the paper's perfectible band) because a sequence's mismatch accumulates over
its tokens. 8 prompts × 8 samples per step. Sized from 1-seed 6-step smoke runs of this spec on this
2-core machine (docs/experiments.md, "Sizing"): bf16 ~0.9 s per step, exact 6–11 s, plus ~45 s of
compilation per new shape: ~35 min per algorithm grid and ~35 min for the exact grid, two runs at a time
when the machine is otherwise idle (the arith_long_base warm start first: 6.5 min). Resumable.
"""

LR = 1e-4
# The first grids (ppo, exact) ran at 3e-4, where every arm — fp32 included — degrades from step 0
# (docs/experiments.md, E3). A 1-seed, 30-step fp32 probe at 1e-4, 3e-5 and 1e-4 with one minibatch kept
# validation within 0.56–0.61 of its 0.574 start and the training reward rising 0.57 → ~0.67, so 1e-4 is the
# grids' LR. A grid at another LR is named `<grid>@<lr>`; its directory carries the LR unless it is 3e-4,
# the LR the first two grids' directories were made with.
FIRST_LR = 3e-4
STEPS, EXACT_STEPS = 60, 40
MAX_TOKENS = 64  # configs/arith_length_cpu.py:long (responses ~28 tokens); Dr.GRPO's L
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
    grid, at, lr_text = grid.partition("@")
    if grid not in (*ALGORITHMS, "exact"):
        raise ValueError(f"unknown grid {grid!r}; valid: {', '.join(ALGORITHMS)}, exact (optionally @LR)")
    try:
        lr = float(lr_text) if at else LR
    except ValueError:
        raise ValueError(f"grid {grid}@{lr_text}: the LR after '@' is not a number") from None
    if not lr > 0:
        raise ValueError(f"grid {grid}@{lr_text}: the LR must be > 0")
    name = f"e3_precision_{grid}" if lr == FIRST_LR else f"e3_precision_{grid}_lr{lr:g}"
    algo = dict(ALGORITHMS["ppo" if grid == "exact" else grid])
    if algo["objective.preset"].startswith("drgrpo"):
        algo["objective.overrides.max_len"] = MAX_TOKENS
    precisions = ("bf16", "bf16_exact") if grid == "exact" else ("bf16", "fp16", "fp32")
    return {
        "name": name,
        "config": "configs/arith_length_cpu.py:long",
        "overrides": {"steps": EXACT_STEPS if grid == "exact" else STEPS, "optim.lr": lr,
                      "rollout.max_tokens": MAX_TOKENS, "batch.prompts_per_step": 8, "batch.minibatches": 4,
                      "batch.microbatches": 1, "eval.every": 10, "log.report": False, "checkpoint.every": 20, **algo},
        "variants": {p: PRECISIONS[p] for p in precisions},
        "seeds": [0, 1, 2, 3, 4],
        "baseline": "bf16",
        # fp32 has less mismatch than fp16 (~1e-7 vs ~2e-4): if fp16's outcome comes from its small mismatch,
        # fp32 does at least as well.
        "controls": {} if grid == "exact" else {"fp16": "fp32"},
        "out": f"runs/compare/{name}",
        "collapse": {"metric": "reward/mean", "frac": 0.5, "window": 10, "patience": 10},
    }
