"""E2 — mismatch corrections at realistic mismatch, only the importance weighting differing (FP16 paper §4.3,
LR paper's TIS/MIS ablation at CPU scale).

    jaxrl-mismatch compare experiments/e2_corrections.py:sigma_small   # σ = 0.02 logit noise (bf16-level)
    jaxrl-mismatch compare experiments/e2_corrections.py:sigma_medium  # σ = 0.3
    jaxrl-mismatch compare experiments/e2_corrections.py:int8          # int8 weight-quantized rollouts (FlashRL)

The shipped corrections grid (experiments/corrections.py, σ = 3, 2 seeds) changed two things at once: its
baseline clipped at ε_high = 0.2 while TIS/MIS/IcePop used DAPO's 0.28, and GSPO / PG-seq-IS change the
loss. Here every variant is the same DAPO-style GRPO — std-normalised group advantages, PPO clip ε_low 0.2 /
ε_high 0.28, token-mean aggregation — and differs only in the weight w on each token's term
(objectives/policy.py PRESETS):

- `dapo`: w = 1 (no correction; the baseline every variant is paired against, seed by seed);
- `token_tis`: w = min(ρ_t, C), C = 3 (FP16 paper eq. 9's weight, Yao et al.);
- `seq_mis`: w = ρ(y)·1{ρ(y) ≤ C}, C = 3 (FP16 paper eq. 10's weight, Liu et al.);
- `icepop`: w = ρ_t · 1{0.5 ≤ ρ_t ≤ 5} (IcePop's two-sided token mask on the token weight).

One grid per mismatch source (the argument), each 4 variants × 5 seeds at the edge-of-stability LR 7e-4 of
E0, mismatch from step 0. 80 steps × 128 completions per run, two at a time on this 2-core machine when it
is otherwise idle: ~25 min per σ grid (a 1-seed 80-step fp32 run: 115 s alone), ~33 min for int8 (steps
~1.35× longer with int8 rollouts in a smoke run). Resumable.
"""

LR = 7e-4
STEPS = 80
SOURCES = {
    "sigma_small": {"rollout.logit_noise_std": 0.02},
    "sigma_medium": {"rollout.logit_noise_std": 0.3},
    "int8": {"rollout.quantize": "int8"},
}
PRESETS = {"dapo": "dapo", "token_tis": "grpo_token_tis", "seq_mis": "grpo_seq_mis", "icepop": "icepop"}


def get_spec(source: str = "sigma_small"):
    if source not in SOURCES:
        raise ValueError(f"unknown mismatch source {source!r}; valid: {', '.join(SOURCES)}")
    return {
        "name": f"e2_corrections_{source}",
        "config": "configs/arith_length_cpu.py",
        "overrides": {"steps": STEPS, "optim.lr": LR, **SOURCES[source], "log.report": False, "checkpoint.every": 20},
        "variants": {name: {"objective.preset": preset} for name, preset in PRESETS.items()},
        "seeds": [0, 1, 2, 3, 4],
        "baseline": "dapo",
        "out": f"runs/compare/e2_corrections_{source}",
        "metrics": ["reward/mean", "val/accuracy", "mismatch/log_ppl_abs_diff", "mismatch/rho_std",
                    "mismatch/ess_token", "length/mean"],
        "collapse": {"metric": "val/accuracy", "frac": 0.5, "window": 3, "patience": 3},
    }
