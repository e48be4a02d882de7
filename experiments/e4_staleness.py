"""E4 — stale rollouts: staleness 0 / 1 / 2 / 4 × {naive PPO, decoupled PPO, decoupled + M2PO} (AReaL's Table at
CPU scale, issue 20 item 5), at a realistic precision mismatch.

    jaxrl-mismatch compare experiments/e4_staleness.py            # int8 weight-quantized rollouts (FlashRL)
    jaxrl-mismatch compare experiments/e4_staleness.py:sigma_small # σ = 0.02 logit noise (bf16-level)
    jaxrl-mismatch compare experiments/e4_staleness.py:int8@3e-4   # the LR control (below)

Each run trains on rollouts exactly s weight versions old (`rollout.max_staleness = s` with
`rollout.fixed_staleness`: the producer's batch for step k is made from step k − s's weights; the first s
steps are 0, 1, …, s − 1 behind), so a variant's staleness is a controlled quantity, not a by-product of
the machine's timing. The objectives (objectives/decoupled.py, presets pinned by tests):

- `naive_ppo`: PPO clip on π/μ, no weight (`proximal = "bypass"`: μ as the proximal policy);
- `decoupled`: AReaL's decoupled PPO, clip on π/π_prox, weight π_prox/μ (untruncated);
- `decoupled_m2po`: the same with M2PO's second-moment token mask, τ_M2 = 0.04;
- `decoupled_tis` (s ≥ 1 only, a control added after the first grid): the decoupled weight truncated at
  C = 3 (AReaL's behaviour-weight cap). In the first grid decoupled PPO lost to naive PPO from s = 1 on while
  its weight π_prox/μ had a ρ std of 0.24–1.9; if that weight's variance is what costs it, capping the weight
  recovers it. At s = 0 it is `decoupled` (ρ never reaches 3 at s = 0), so it is not run there.

All three are GRPO-advantage, token-mean, ε = 0.2; only the proximal policy and the token weight differ. At
staleness 0 `naive_ppo` is PPO around μ and `decoupled` is PPO around π(θ_old) with the precision weight ρ:
the precision mismatch alone. `staleness/*` splits each step's mismatch into the staleness and precision
parts (metrics/staleness.py). The baseline for paired differences is `decoupled_s0`.

`SOURCE@LR` is the LR control: 7e-4 is past stable even without mismatch (E0), and a trust region around μ
(naive PPO's clip) is more conservative than one around π_prox, so at 7e-4 naive PPO may win by damping
the step rather than by how it treats stale data. The control runs naive and decoupled PPO at s = 0 and 2
at another LR (3e-4: E1/E3's LR, where runs learn without degrading), 4 variants × 5 seeds.

12 variants × 5 seeds × 80 steps at the edge-of-stability LR 7e-4 of E0, plus the 3 control variants: about
an hour for the 60 main runs two at a time (~100–125 s each here), 15 min for the controls. Resumable: a
rerun skips the finished runs, so adding the controls ran only their 15.
"""

from jaxrl_mismatch.jobs.compare import split_lr

LR = 7e-4
STEPS = 80
SOURCES = {
    "int8": {"rollout.quantize": "int8"},
    "sigma_small": {"rollout.logit_noise_std": 0.02},
}
OBJECTIVES = ("naive_ppo", "decoupled", "decoupled_m2po")
STALENESS = (0, 1, 2, 4)
CONTROLS = {"decoupled_tis": (1, 2, 4)}  # objective: the staleness it runs at (after the main grid's runs)
LR_CONTROL_STALENESS = (0, 2)  # `SOURCE@LR`: naive vs decoupled at these staleness values only


def get_spec(source: str = "int8"):
    source, lr = split_lr(source, LR)
    if source not in SOURCES:
        raise ValueError(f"unknown mismatch source {source!r}; valid: {', '.join(SOURCES)} (each optionally @LR)")
    if lr == LR:
        grid = [*((o, STALENESS) for o in OBJECTIVES), *CONTROLS.items()]
        controls = {**{f"decoupled_s{s}": f"naive_ppo_s{s}" for s in STALENESS},
                    **{f"{obj}_s{s}": f"decoupled_s{s}" for obj, staleness in
                       [("decoupled_m2po", STALENESS[1:]), *CONTROLS.items()] for s in staleness}}
    else:  # the LR control: AReaL's two objectives, synchronous and at s = 2, at another LR
        grid = [(o, LR_CONTROL_STALENESS) for o in ("naive_ppo", "decoupled")]
        controls = {f"decoupled_s{s}": f"naive_ppo_s{s}" for s in LR_CONTROL_STALENESS}
    name = f"e4_staleness_{source}" + ("" if lr == LR else f"_lr{lr:g}")
    return {
        "name": name,
        "config": "configs/arith_length_cpu.py",
        "overrides": {"steps": STEPS, "optim.lr": lr, **SOURCES[source], "log.report": False, "checkpoint.every": 20},
        # s = 0 is the synchronous loop (fixed staleness needs s >= 1)
        "variants": {f"{obj}_s{s}": {"objective.preset": obj, "rollout.max_staleness": s,
                                     "rollout.fixed_staleness": s > 0}
                     for obj, staleness in grid for s in staleness},
        "seeds": [0, 1, 2, 3, 4],
        "baseline": "decoupled_s0",
        # At each staleness: decoupled vs naive PPO (AReaL's comparison), and each of decoupled's variants (the
        # M2PO mask, the truncated weight) vs decoupled itself.
        "controls": controls,
        "out": f"runs/compare/{name}",
        "metrics": ["reward/mean", "val/accuracy", "mismatch/rho_std", "staleness/rho_std",
                    "staleness/precision_rho_std", "staleness/version_lag_mean"],
        "collapse": {"metric": "val/accuracy", "frac": 0.5, "window": 3, "patience": 3},
    }
