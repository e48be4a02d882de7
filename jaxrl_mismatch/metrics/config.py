"""What the metrics measure against: the objective's own bounds (one source) plus metric-only settings.

``MetricsConfig`` holds the ``ObjectiveConfig`` itself, so every bound a metric compares with — the IS cap C,
IcePop's lower bound, the PPO/GSPO ε, GMPO's ε, the dual-clip c — is read from the recipe the loss uses and
can never drift from it. Build it with ``metrics_config(obj_cfg, phi_delta=…, phi_pi_low=…)``.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrl_mismatch.objectives import ObjectiveConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """The objective the metrics describe, and the metric-only settings (hashable: a jit-static argument)."""

    objective: ObjectiveConfig = ObjectiveConfig()              # bounds of correction/* and ppo/* come from here
    prob_buckets: tuple[float, ...] = (0.0, 0.1, 0.5, 0.9, 1.0)  # π(θ_old) bucket edges; last bucket closed
    phi_delta: float = 2.0                     # δ of objective-hacking eq. 18 for diag/surrogate_j (paper: 2)
    phi_pi_low: float = 0.1                    # π_low of eq. 18 (paper: 0.1)

    def __post_init__(self):
        if not isinstance(self.objective, ObjectiveConfig):
            raise TypeError(f"MetricsConfig.objective must be an ObjectiveConfig, got {type(self.objective).__name__}")
        e = tuple(float(x) for x in self.prob_buckets)
        if len(e) < 2 or any(not 0.0 <= x <= 1.0 for x in e) or any(a >= b for a, b in zip(e[:-1], e[1:])):
            raise ValueError(f"prob_buckets must be >= 2 increasing edges in [0, 1], got {self.prob_buckets!r}")
        object.__setattr__(self, "prob_buckets", e)
        if not math.isfinite(self.phi_delta):
            raise ValueError(f"phi_delta must be finite, got {self.phi_delta!r}")
        if not 0.0 < self.phi_pi_low <= 1.0:
            raise ValueError(f"phi_pi_low must be in (0, 1], got {self.phi_pi_low!r}")

    @property
    def tis_cap(self) -> float:
        """C: a token / sequence counts as truncated (TIS) or dropped (MIS) when ρ > C (FP16 eqs. 6–7)."""
        return self.objective.correction_cap

    @property
    def mask_low(self) -> float:
        """Lower end of the kept band [mask_low, mask_high] of ρ (IcePop; the objective's correction_low)."""
        return self.objective.correction_low

    @property
    def mask_high(self) -> float:
        """Upper end of the kept band of ρ (the objective's correction_cap)."""
        return self.objective.correction_cap


def metrics_config(obj_cfg: ObjectiveConfig, *, phi_delta: float | None = None, phi_pi_low: float | None = None,
                   prob_buckets: tuple[float, ...] | None = None) -> MetricsConfig:
    """``MetricsConfig`` for ``obj_cfg``; ``None`` keeps a setting's default (δ = 2, π_low = 0.1: OLH eq. 23)."""
    given = {"phi_delta": phi_delta, "phi_pi_low": phi_pi_low, "prob_buckets": prob_buckets}
    return MetricsConfig(objective=obj_cfg, **{k: v for k, v in given.items() if v is not None})


def as_metrics_config(cfg: MetricsConfig | ObjectiveConfig) -> MetricsConfig:
    """Accept either config: an ``ObjectiveConfig`` gets the default metric-only settings."""
    if isinstance(cfg, MetricsConfig):
        return cfg
    if isinstance(cfg, ObjectiveConfig):
        return metrics_config(cfg)
    raise TypeError(f"cfg must be a MetricsConfig or an ObjectiveConfig, got {type(cfg).__name__}")


def bucket_names(cfg: MetricsConfig) -> list[tuple[str, float, float]]:
    """``(suffix, lo, hi)`` of each probability bucket, e.g. ``("pi_0.1-0.5", 0.1, 0.5)``."""
    e = cfg.prob_buckets
    return [(f"pi_{lo:g}-{hi:g}", lo, hi) for lo, hi in zip(e[:-1], e[1:])]
