"""LR schedulers under injected training–inference mismatch (LR-schedule paper's claim at CPU scale).

    jaxrl-mismatch compare experiments/schedulers.py

The arithmetic length-growth task (configs/arith_length_cpu.py) at a learning rate that trains fine
without mismatch, with real mismatch injected where the tokens are sampled (σ = 3 on the engine's
logits). Constant LR vs the conventional schedules vs the host-triggered decays; 3 seeds each.
"""

STEPS = 80
OPT_STEPS = STEPS * 2  # batch.minibatches = 2 optimizer steps per RL step (in-graph schedules count these)


def get_spec():
    return {
        "name": "schedulers",
        "config": "configs/arith_length_cpu.py",
        "overrides": {"steps": STEPS, "rollout.logit_noise_std": 3.0, "log.report": False, "checkpoint.every": 40},
        "variants": {
            "constant": {},
            "cosine": {"optim.schedule": "cosine", "optim.schedule_kwargs.decay_steps": OPT_STEPS},
            # Fixed step decay: halve every 20 RL steps from the start, floor 0.1 (a schedule set in advance).
            "step": {"optim.schedule": "step_decay", "optim.schedule_kwargs.decay_period": 40},
            # LR paper: decay when the response length surges; at CPU scale the surge is ~2× within ~10 steps.
            "length_triggered": {"controller.name": "length_triggered_decay", "controller.kwargs.surge_ratio": 1.6,
                                 "controller.kwargs.baseline_window": 3, "controller.kwargs.window": 3},
            # Halve at once when the mismatch indicator crosses 0.5, again every 10 steps while it stays there.
            "mismatch_triggered": {"controller.name": "metric_triggered",
                                   "controller.kwargs.metric": "mismatch/log_ppl_abs_diff",
                                   "controller.kwargs.threshold": 0.5, "controller.kwargs.decay_period": 10},
            # Control: constant LR at the floor the mismatch-triggered run reaches (0.1 × 7e-4 by step 30), to tell
            # the trigger's timing from the smaller LR itself.
            "constant_low": {"optim.lr": 7e-5},
            # Reference: constant LR without injected mismatch (what the task reaches when μ = π up to fp32 rounding).
            "no_mismatch": {"rollout.logit_noise_std": 0.0},
        },
        "seeds": [0, 1, 2],
        "out": "runs/compare/schedulers",
        "collapse": {"metric": "val/accuracy", "frac": 0.5, "window": 1, "patience": 2},
    }
