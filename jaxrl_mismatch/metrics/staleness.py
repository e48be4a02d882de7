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


def staleness_metrics(old_logp: TokenFloat | None, behav_logp: TokenFloat | None, rollout_logp: TokenFloat,
                      mask: TokenMask, version_lag: Int[Array, "batch"]) -> dict[str, Scalar]:
    """`staleness/*` of one step batch (see the module docstring).

    old_logp: log π_prox (the trainer at the current version); None when there is no π_prox forward
    (`proximal = "bypass"`: μ stands in for it), and then the staleness part — π_prox/π_behav — is not
    computable and its three keys are left out (with μ in π_prox's place it would read back the precision
    part, negated), and the precision part covers the stale rows only. behav_logp: log π_behav, the trainer at each row's sample version (rows with lag 0 are not
    read; None: every row has lag 0). rollout_logp: log μ. version_lag: [B] current version − the row's
    sample version (≥ 0)."""
    m = as_bool_mask(mask)
    tok, seq = Masked(m), Masked(jnp.any(m, axis=-1))
    lag = version_lag.astype(jnp.float32)
    mu = rollout_logp.astype(jnp.float32)
    old = mu if old_logp is None else old_logp.astype(jnp.float32)
    behav = old if behav_logp is None else jnp.where((lag > 0)[:, None], behav_logp.astype(jnp.float32), old)
    s_k1, s_k3, s_std = _kl(log_rho(old, behav, m), tok)
    # Without π_prox the lag-0 rows have no trainer log-prob at all (π_behav = π_prox there): the precision part
    # is then taken over the stale rows only, where π_behav was scored.
    p_tok = tok if old_logp is not None else Masked(m & (lag > 0)[:, None])
    p_k1, p_k3, p_std = _kl(log_rho(behav, mu, m), p_tok)
    if old_logp is None:  # a step without stale rows then measured nothing: NaN ("not logged"), not a 0 that reads
        p_k1, p_k3, p_std = (jnp.where(p_tok.nonempty, v, jnp.nan) for v in (p_k1, p_k3, p_std))  # as no mismatch
    out = {
        "staleness/version_lag_mean": seq.mean(lag),
        "staleness/version_lag_max": seq.max(lag),
        "staleness/stale_seq_frac": seq.frac(lag > 0),
        "staleness/kl_k1": s_k1, "staleness/kl_k3": s_k3, "staleness/rho_std": s_std,
        "staleness/precision_kl_k1": p_k1, "staleness/precision_kl_k3": p_k3, "staleness/precision_rho_std": p_std,
    }
    if old_logp is None:  # no π_prox: the staleness part is unknown, not zero
        for key in ("staleness/kl_k1", "staleness/kl_k3", "staleness/rho_std"):
            del out[key]
    return {k: f32(v) for k, v in out.items()}
