"""Mismatch and health metrics (see docs/objectives.md for every name and formula).

Two kinds, by whether they depend on θ:

* ``step_metrics(old_logp, rollout_logp, mask, advantages, *, cfg)`` — ``mismatch/*``, ``correction/*``,
  ``length/*``, ``diag/*``: computed once per step, jitted, on the whole step batch (right after θ_old).
* ``update_stats(logp, old_logp, advantages, mask, *, cfg, entropy=None)`` — ``ppo/*``, ``policy/entropy``:
  computed in every update as ``<how>:<name>`` sufficient statistics (``accumulator.py``), combined over
  microbatches by ``combine_stats`` (jit) and over the step's updates by ``StatsAccumulator`` (host).

``cfg = metrics_config(obj_cfg, phi_delta=…, phi_pi_low=…)``: every bound comes from the objective.

Mixture-of-experts policies add ``moe/*`` step metrics (``moe_step_metrics``: router agreement with the engine,
router entropy, expert load, ρ std split by routing agreement), computed in the same jitted ``prepare``.
"""

from jaxrl_mismatch.metrics.accumulator import REDUCTIONS, StatsAccumulator, split_key
from jaxrl_mismatch.metrics.config import MetricsConfig, as_metrics_config, bucket_names, metrics_config
from jaxrl_mismatch.metrics.moe import moe_metric_names, moe_step_metrics, routing_disagrees
from jaxrl_mismatch.metrics.step import step_metric_names, step_metrics
from jaxrl_mismatch.metrics.update import combine_stats, update_metric_names, update_stats


def metric_names(cfg=MetricsConfig(), *, with_entropy: bool = True) -> list[str]:
    """Every metric name of a step record from these functions: ``step_metric_names`` + ``update_metric_names``."""
    return step_metric_names(cfg) + update_metric_names(with_entropy=with_entropy)


__all__ = ["REDUCTIONS", "MetricsConfig", "StatsAccumulator", "as_metrics_config", "bucket_names", "combine_stats",
           "metric_names", "metrics_config", "moe_metric_names", "moe_step_metrics", "routing_disagrees", "split_key",
           "step_metric_names", "step_metrics", "update_metric_names", "update_stats"]
