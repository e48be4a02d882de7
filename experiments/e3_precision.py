"""E3 — does precision change the *outcome*? The FP16 paper's sanity matrix at CPU scale (its §4, Fig. 3).

    jaxrl-mismatch compare experiments/e3_precision.py:ppo        # one grid per algorithm (ALGORITHMS below)
    jaxrl-mismatch compare experiments/e3_precision.py:pg_seq_is

The FP16 paper trains each of its algorithms in BF16 and FP16 (trainer and rollout engine in the same
precision) and finds the outcome differs: BF16 runs collapse, FP16 ones keep improving, FP16 PG-seq-IS does
best (Fig. 3). The shipped precision grid (experiments/precisions.py, 1 seed) measured the mismatch of each
pair but not the outcome. Here each grid is one algorithm and four precisions, 5 paired seeds each, paired
against `bf16`:

- `bf16` / `fp16`: trainer and engine both in that precision (fp16 with dynamic loss scaling);
- `bf16_exact`: bf16 with `rollout.exact` — the engine samples from the trainer's own bf16 π(θ_old), the
  same arithmetic with zero mismatch (VeXact review), so bf16's *rounding* is separated from its *mismatch*;
- `fp32`: both sides float32 (mismatch ~1e-7).

Algorithms: the paper's eqs. 3–10 as presets (objectives/policy.py). The GRPO family is the paper's Dr.GRPO
form (mean baseline, per-sequence token sum over the constant L = max response length, clip-higher 0.28,
C = 3, §4.1); PG-seq-* are eqs. 5–7; GSPO its own clip. 4 optimizer steps per rollout batch, as §4.1.

Longer responses (`configs/arith_length_cpu.py:long`: 4–6 operands, full scratchpads of ~28 tokens, 57 %
initial accuracy at T = 1 — the paper's perfectible band) because a sequence's mismatch accumulates over
its tokens. Sized for this 2-core machine from a 1-seed smoke run
(module constants below; docs/experiments.md has the numbers): each grid well under an hour two at a time
when the machine is otherwise idle. Resumable.
"""

LR = 3e-4
STEPS = 60
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
    "bf16_exact": {"trainer.precision": "bf16", "rollout.dtype": "bfloat16", "rollout.exact": True},
    "fp32": {"trainer.precision": "fp32", "rollout.dtype": "float32"},
}


def get_spec(algorithm: str = "ppo"):
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    algo = dict(ALGORITHMS[algorithm])
    if algo["objective.preset"].startswith("drgrpo"):
        algo["objective.overrides.max_len"] = MAX_TOKENS
    return {
        "name": f"e3_precision_{algorithm}",
        "config": "configs/arith_length_cpu.py:long",
        "overrides": {"steps": STEPS, "optim.lr": LR, "rollout.max_tokens": MAX_TOKENS, "batch.minibatches": 4,
                      "log.report": False, "checkpoint.every": 20, **algo},
        "variants": PRECISIONS,
        "seeds": [0, 1, 2, 3, 4],
        "baseline": "bf16",
        "out": f"runs/compare/e3_precision_{algorithm}",
        "collapse": {"metric": "val/accuracy", "frac": 0.5, "window": 3, "patience": 3},
    }
