"""Mismatch that starts mid-run: the strength of the injected / quantized mismatch as a function of the step.

The LR paper's runs see the training–inference mismatch *rise* during training, and its length-triggered
decay reacts to that rise; a run whose mismatch is present from step 0 cannot show whether the timing of a
decay matters. `rollout.mismatch_onset_step` = N and `rollout.mismatch_ramp_steps` = R make the configured
mismatch sources (`rollout.logit_noise_std`, `rollout.quantize`) act with strength

    s(step) = 0                                  for step < N
            = min(1, (step − N + 1) / R)         for step ≥ N   (R = 0: s = 1 from step N on)

so it appears at step N and reaches full strength at step N + R − 1. Logit noise is scaled (σ·s); quantized
weights are blended per request, W + s·(Q(W) − W) (`models/quantize.py: blend`). Being a pure function of
the step, the schedule needs no state of its own: a resumed run recomputes it from the checkpointed step and
config.
"""

from __future__ import annotations


def mismatch_scale(step: int, onset_step: int, ramp_steps: int) -> float:
    """s(step) of the module docstring, in [0, 1]."""
    if step < onset_step:
        return 0.0
    if ramp_steps <= 0:
        return 1.0
    return min(1.0, (step - onset_step + 1) / ramp_steps)


def rollout_mismatch(rollout, step: int) -> dict[str, float]:
    """The SamplingSpec fields of a training rollout at `step` for a config's `rollout` section: the scaled
    noise σ·s and the quantization strength s (s of `mismatch_scale`)."""
    s = mismatch_scale(step, rollout.mismatch_onset_step, rollout.mismatch_ramp_steps)
    return {"logit_noise_std": rollout.logit_noise_std * s, "quantize_strength": s}
