"""Mismatch corrections under the same injected mismatch (FP16 paper §4.3 / LR paper's TIS-MIS ablations at CPU scale).

    jaxrl-mismatch compare experiments/corrections.py

Same task, LR and σ = 3 as experiments/schedulers.py, constant LR: no correction vs token TIS, sequence
MIS, IcePop, GSPO and the unbiased sequence-level IS policy gradient. 2 seeds each.
"""


def get_spec():
    return {
        "name": "corrections",
        "config": "configs/arith_length_cpu.py",
        "overrides": {"steps": 80, "rollout.logit_noise_std": 3.0, "log.report": False, "checkpoint.every": 40},
        "variants": {
            "none": {"objective.preset": "grpo"},
            "token_tis": {"objective.preset": "grpo_token_tis"},
            "seq_mis": {"objective.preset": "grpo_seq_mis"},
            "icepop": {"objective.preset": "icepop"},
            "gspo": {"objective.preset": "gspo"},
            "pg_seq_is": {"objective.preset": "pg_seq_is"},
        },
        "seeds": [0, 1],
        "out": "runs/compare/corrections",
        "collapse": {"metric": "val/accuracy", "frac": 0.5, "window": 1, "patience": 2},
    }
