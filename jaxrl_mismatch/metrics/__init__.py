"""Mismatch and health metrics computed inside jit (flat dict of float32 scalars; see docs/objectives.md)."""

from jaxrl_mismatch.metrics.mismatch import (
    MetricsConfig,
    bucket_names,
    compute_metrics,
    length_metrics,
    metric_names,
    mismatch_metrics,
    ppo_metrics,
)

__all__ = ["MetricsConfig", "bucket_names", "compute_metrics", "length_metrics", "metric_names",
           "mismatch_metrics", "ppo_metrics"]
