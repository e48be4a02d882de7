"""Trainer × engine precision (FP16 paper's ablation at CPU scale): fp32 / bf16 / fp16 on each side.

    jaxrl-mismatch compare experiments/precisions.py

The arithmetic task without injected noise: the only mismatch is the precision's (fp16 uses dynamic loss
scaling in the trainer). The mismatch metrics show the FP16 paper's ordering; 1 seed per pair.
"""

TRAINER = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
ENGINE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def get_spec():
    return {
        "name": "precisions",
        "config": "configs/arith_length_cpu.py",
        # A learning rate that is stable in fp32 (7e-4 is the edge-of-stability setting of the other specs).
        "overrides": {"steps": 60, "optim.lr": 3e-4, "log.report": False, "checkpoint.every": 30},
        "variants": {f"{t}-{e}": {"trainer.precision": TRAINER[t], "rollout.dtype": ENGINE[e]}
                     for t in TRAINER for e in ENGINE},
        "seeds": [0],
        "out": "runs/compare/precisions",
    }
