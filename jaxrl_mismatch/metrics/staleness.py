"""`staleness/*`: the mismatch of a step split by cause — staleness (old weights) and precision (the engine).

With asynchronous rollouts (`rollout.max_staleness`) a sample comes from μ = the engine at weight version
v − ℓ (ℓ = its version lag), while π_prox = π(θ_old) is the trainer at the current version v. The token
log-ratio of `mismatch/*` then splits exactly, in log space, through π_behav = the *trainer* at version v − ℓ:

    log ρ_t = log π_prox/μ = log π_prox/π_behav  +  log π_behav/μ
                             └── staleness ──┘     └─ precision ─┘

`Learner.prepare` scores π_behav with the weights it kept for the last s versions (the same forward — the
exact scorer in `rollout.exact` mode — it uses for π_prox, so with `rollout.exact` the precision part is 0
bit for bit and all that remains is staleness). Rows with ℓ = 0 have π_behav = π_prox. Computed inside the
jitted `prepare`, over the whole step batch, next to `mismatch/*`; the k1 estimates add up exactly
(`staleness/kl_k1 + staleness/precision_kl_k1 = mismatch/kl_k1`, up to the ±20 clamp); spreads do not add.
Names and formulas: docs/objectives.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int

from jaxrl_mismatch.metrics._masked import Masked, f32
from jaxrl_mismatch.objectives._types import Scalar, TokenFloat, TokenMask
from jaxrl_mismatch.objectives.ratios import as_bool_mask, log_rho

STALENESS_KEYS = (
    "staleness/version_lag_mean", "staleness/version_lag_max", "staleness/stale_seq_frac",
    "staleness/kl_k1", "staleness/kl_k3", "staleness/rho_std",
    "staleness/precision_kl_k1", "staleness/precision_kl_k3", "staleness/precision_rho_std",
)


def _kl(lr, tok: Masked) -> tuple[Scalar, Scalar, Scalar]:
    """(k1, k3, std of the ratio) of token log-ratios `lr`, the estimators of `mismatch/*`."""
    r = jnp.exp(lr)
    return tok.mean(-lr), tok.mean(jnp.expm1(lr) - lr), tok.std(r)


def staleness_metrics(old_logp: TokenFloat, behav_logp: TokenFloat | None, rollout_logp: TokenFloat,
                      mask: TokenMask, version_lag: Int[Array, "batch"]) -> dict[str, Scalar]:
    """`staleness/*` of one step batch (see the module docstring).

    old_logp: log π_prox (the trainer at the current version). behav_logp: log π_behav, the trainer at each
    row's sample version (rows with lag 0 are not read; None: every row has lag 0). rollout_logp: log μ.
    version_lag: [B] current version − the row's sample version (≥ 0)."""
    m = as_bool_mask(mask)
    tok, seq = Masked(m), Masked(jnp.any(m, axis=-1))
    lag = version_lag.astype(jnp.float32)
    old = old_logp.astype(jnp.float32)
    behav = old if behav_logp is None else jnp.where((lag > 0)[:, None], behav_logp.astype(jnp.float32), old)
    s_k1, s_k3, s_std = _kl(log_rho(old, behav, m), tok)
    p_k1, p_k3, p_std = _kl(log_rho(behav, rollout_logp.astype(jnp.float32), m), tok)
    out = {
        "staleness/version_lag_mean": seq.mean(lag),
        "staleness/version_lag_max": seq.max(lag),
        "staleness/stale_seq_frac": seq.frac(lag > 0),
        "staleness/kl_k1": s_k1, "staleness/kl_k3": s_k3, "staleness/rho_std": s_std,
        "staleness/precision_kl_k1": p_k1, "staleness/precision_kl_k3": p_k3, "staleness/precision_rho_std": p_std,
    }
    return {k: f32(v) for k, v in out.items()}
