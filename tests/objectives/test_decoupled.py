"""Decoupled PPO, the bypass proximal policy and M2PO's mask (objectives/decoupled.py) against NumPy written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_mismatch.objectives import PRESETS, m2po_cut, m2po_mask, batch_constants, objective_config, policy_loss
from jaxrl_mismatch.objectives.decoupled import DECOUPLED_PRESETS

B, T = 5, 9


def _batch(seed, stale=0.5):
    rng = np.random.default_rng(seed)
    prox = -rng.exponential(1.0, size=(B, T))
    mu = np.minimum(prox + stale * rng.normal(size=(B, T)), 0.0)  # a stale, noisier behaviour policy
    logp = prox + 0.2 * rng.normal(size=(B, T))
    lengths = rng.integers(2, T + 1, size=B)
    mask = np.arange(T)[None, :] < lengths[:, None]
    adv = np.repeat(rng.normal(size=(B, 1)), T, 1) * mask
    f = lambda x: np.where(mask, x, 0.0).astype(np.float32)  # noqa: E731
    return f(logp), f(prox), f(mu), adv.astype(np.float32), mask


def np_decoupled(logp, prox, mu, adv, mask, eps=0.2, keep=None):
    """AReaL §5.2: −mean_tokens[(π_prox/μ) · min(u A, clip(u, 1−ε, 1+ε) A)], u = π/π_prox."""
    lp, px, m = logp.astype(np.float64), prox.astype(np.float64), mu.astype(np.float64)
    u = np.exp(lp - px)
    w = np.exp(px - m)
    if keep is not None:
        w = w * keep
    obj = np.minimum(u * adv, np.clip(u, 1 - eps, 1 + eps) * adv)
    return -np.sum(np.where(mask, w * obj, 0)) / mask.sum()


def _loss(cfg, logp, prox, mu, adv, mask):
    norm = batch_constants(cfg, jnp.asarray(mask), jnp.asarray(prox), jnp.asarray(mu))
    return policy_loss(cfg, logp=jnp.asarray(logp), old_logp=jnp.asarray(prox), rollout_logp=jnp.asarray(mu),
                       advantages=jnp.asarray(adv), mask=jnp.asarray(mask), norm=norm)[0]


def test_presets_are_pinned():
    assert DECOUPLED_PRESETS == {
        "naive_ppo": dict(advantages="grpo", loss="ppo", proximal="bypass"),
        "decoupled": dict(advantages="grpo", loss="ppo", correction="token_is"),
        "decoupled_tis": dict(advantages="grpo", loss="ppo", correction="token_tis"),
        "decoupled_m2po": dict(advantages="grpo", loss="ppo", correction="token_is", m2po_threshold=0.04),
    }
    for name in DECOUPLED_PRESETS:
        assert name in PRESETS and objective_config(name)  # each validates


def test_decoupled_loss_matches_areal_objective():
    logp, prox, mu, adv, mask = _batch(0)
    got = float(_loss(objective_config("decoupled"), logp, prox, mu, adv, mask))
    np.testing.assert_allclose(got, np_decoupled(logp, prox, mu, adv, mask), rtol=1e-5)


def test_bypass_clips_on_pi_over_mu_and_ignores_theta_old():
    logp, prox, mu, adv, mask = _batch(1)
    cfg = objective_config("naive_ppo")
    a = float(_loss(cfg, logp, prox, mu, adv, mask))
    b = float(_loss(cfg, logp, prox + 3.0, mu, adv, mask))  # θ_old is never read
    assert a == b
    # = PPO with μ as the old policy and no weight
    np.testing.assert_allclose(a, np_decoupled(logp, mu, mu, adv, mask), rtol=1e-5)
    # and differs from the decoupled objective on stale data
    assert abs(a - float(_loss(objective_config("decoupled"), logp, prox, mu, adv, mask))) > 1e-4


def test_bypass_refuses_what_acts_on_rho_for_the_ppo_family():
    """Under bypass the PPO family's ρ = π_prox/μ is μ/μ = 1: a correction, a rejection, normalize_weights or M2PO's
    cut on it did nothing and were accepted; each is refused, naming the field. Without bypass each one changes
    the loss on stale data."""
    logp, prox, mu, adv, mask = _batch(1, stale=0.6)
    for field, value in (("correction", "token_tis"), ("rejection", "ratio_token"), ("normalize_weights", True),
                         ("m2po_threshold", 0.04)):
        extra = {"rejection_high": 1.5} if field == "rejection" else {}
        for loss in ("ppo", "gspo", "gmpo"):
            with pytest.raises(ValueError, match=rf"^{field} acts on ρ = π_prox/μ, which proximal='bypass' makes 1 "
                                                 rf"for loss '{loss}'.*proximal='recompute'"):
                objective_config("naive_ppo", loss=loss, **{field: value}, **extra)
        base = {"correction": "token_tis"} if field == "normalize_weights" else {"correction": "none"}
        on = objective_config("decoupled", **{**base, field: value, **extra})
        off = objective_config("decoupled", **base)
        assert float(_loss(on, logp, prox, mu, adv, mask)) != float(_loss(off, logp, prox, mu, adv, mask)), field


def test_rejection_bounds_are_checked_when_configured():
    """rejection_high = 0 reached `math.log(0)` (a Python error at the first step), a negative one or a low above
    the high rejected every token; each is refused when the objective is configured, naming the field."""
    for kw, msg in ((dict(rejection="ratio_token", rejection_high=0.0), r"^rejection_high must be > 0"),
                    (dict(rejection="k3_seq_mean", rejection_high=-1.0), r"^rejection_high must be > 0"),
                    (dict(rejection="ratio_token", rejection_high=float("nan")), r"^rejection_high must be > 0"),
                    (dict(rejection="ratio_token", rejection_low=-0.5), r"^rejection_low must be >= 0"),
                    (dict(rejection="ratio_seq_sum", rejection_low=2.0, rejection_high=1.5),
                     r"^rejection_low 2.0 > rejection_high 1.5: every token would be rejected")):
        with pytest.raises(ValueError, match=msg):
            objective_config("grpo", **kw)
    objective_config("grpo", rejection="ratio_token", rejection_low=0.0, rejection_high=2.0)  # fine


def test_bypass_pg_keeps_its_weight_and_refuses_what_needs_theta_old():
    """pg's weight is π(θ)/μ, not π_prox/μ: under bypass it still applies (FP16 eqs. 5–7). Its batch mean
    (normalize_weights) and M2PO's cut are taken at θ_old, which bypass never scores; with μ standing in every
    ratio is 1, so normalising would do nothing and the cut (0) would mask every token: both are refused."""
    logp, prox, mu, adv, mask = _batch(1, stale=0.6)
    plain, bypass = objective_config("pg_seq_is"), objective_config("pg_seq_is", proximal="bypass")
    assert float(_loss(bypass, logp, prox, mu, adv, mask)) == float(_loss(plain, logp, prox, mu, adv, mask))
    uncorrected = float(_loss(objective_config("pg", proximal="bypass"), logp, prox, mu, adv, mask))
    assert abs(float(_loss(bypass, logp, prox, mu, adv, mask)) - uncorrected) > 1e-3
    for field, value in (("normalize_weights", True), ("m2po_threshold", 0.04)):
        with pytest.raises(ValueError, match=rf"^{field} needs π\(θ_old\) for loss 'pg'.*proximal='recompute'"):
            objective_config("pg_seq_is", proximal="bypass", **{field: value})
        objective_config("pg_seq_is", **{field: value})  # recompute: fine


def test_decoupled_with_tis_truncates_the_decoupled_weight():
    logp, prox, mu, adv, mask = _batch(2, stale=1.5)
    cfg = objective_config("decoupled_tis")
    lp, px, m = (x.astype(np.float64) for x in (logp, prox, mu))
    u = np.exp(lp - px)
    w = np.minimum(np.exp(px - m), 3.0)
    obj = np.minimum(u * adv, np.clip(u, 0.8, 1.2) * adv)
    want = -np.sum(np.where(mask, w * obj, 0)) / mask.sum()
    np.testing.assert_allclose(float(_loss(cfg, logp, prox, mu, adv, mask)), want, rtol=1e-5)


def np_m2po_keep(prox, mu, mask, tau):
    """M2PO §4: drop the largest (log r)² one by one until the kept mean is ≤ τ."""
    m2 = np.square(prox.astype(np.float64) - mu)
    keep = mask.copy()
    while keep.sum() and m2[keep].mean() > tau:
        vals = np.where(keep, m2, -1)
        keep[np.unravel_index(np.argmax(vals), vals.shape)] = False
    return keep


@pytest.mark.parametrize("tau", [0.04, 0.1, 100.0])
def test_m2po_mask_matches_the_iterative_algorithm(tau):
    logp, prox, mu, adv, mask = _batch(3, stale=0.6)
    keep = np_m2po_keep(prox, mu, mask, tau)
    cut = float(m2po_cut(jnp.asarray(prox), jnp.asarray(mu), jnp.asarray(mask), tau))
    m2 = np.square(prox.astype(np.float64) - mu)
    np.testing.assert_array_equal(mask & (m2 <= cut), keep)
    if tau == 100.0:
        assert cut == np.inf
    else:
        assert 0 < keep.sum() < mask.sum()  # the mask really drops tokens at these τ
    cfg = objective_config("decoupled_m2po", m2po_threshold=tau)
    np.testing.assert_allclose(float(_loss(cfg, logp, prox, mu, adv, mask)),
                               np_decoupled(logp, prox, mu, adv, mask, keep=keep), rtol=1e-5)


@pytest.mark.parametrize("m2, tau, kept", [
    ([0.02, 0.05, 0.05, 0.05], 0.04, 1),  # keeping one 0.05 would keep all three (mean 0.0425 > τ)
    ([0.0] + [0.1] * 100, 0.05, 1),       # the reviewer's case: all 101 were kept, mean 0.099 ≈ 2τ
    ([0.01, 0.03, 0.03, 0.2], 0.04, 3),   # a tie group that fits is kept whole (mean 0.0233)
])
def test_m2po_keeps_or_drops_tied_values_together_and_the_kept_mean_stays_within_tau(m2, tau, kept):
    """The mask keeps every token with (log r)² ≤ cut, so the cut may only fall where the value changes."""
    mu = np.zeros((1, len(m2)), np.float32)
    prox = np.sqrt(np.asarray(m2, np.float32))[None]
    mask = np.ones_like(mu, bool)
    cut = m2po_cut(jnp.asarray(prox), jnp.asarray(mu), jnp.asarray(mask), tau)
    keep = np.asarray(m2po_mask(jnp.asarray(prox), jnp.asarray(mu), jnp.asarray(mask), cut)).astype(bool)
    assert keep.sum() == kept, (float(cut), keep)
    assert np.square(prox[keep].astype(np.float64)).mean() <= tau + 1e-7


def test_m2po_mask_reaches_the_gradient_and_ignores_padding():
    logp, prox, mu, adv, mask = _batch(4, stale=0.8)
    cfg_on, cfg_off = objective_config("decoupled_m2po"), objective_config("decoupled")
    g = lambda cfg: jax.grad(lambda lp: _loss(cfg, lp, prox, mu, adv, mask))(jnp.asarray(logp))  # noqa: E731
    g_on, g_off = np.asarray(g(cfg_on)), np.asarray(g(cfg_off))
    keep = np_m2po_keep(prox, mu, mask, 0.04)
    assert np.all(g_on[mask & ~keep] == 0) and np.any(g_off[mask & ~keep] != 0)
    # random padding values beyond the mask change nothing
    pad = np.where(mask, 0.0, 7.0).astype(np.float32)
    a = float(_loss(cfg_on, logp, prox, mu, adv, mask))
    b = float(_loss(cfg_on, logp + pad, prox - pad, mu + pad, adv, mask))
    assert a == b


def test_bad_fields_name_themselves():
    with pytest.raises(ValueError, match="proximal"):
        objective_config("grpo", proximal="old")
    with pytest.raises(ValueError, match="m2po_threshold"):
        objective_config("grpo", m2po_threshold=0.0)


def test_m2po_masked_frac_counts_the_tokens_each_update_loss_masked():
    """M2PO's cut is a constant of the update's batch (the minibatch): `correction/m2po_masked_frac`, summed over
    a step's updates, counts exactly the tokens whose loss gradient the mask zeroed, while the step metric
    `correction/zero_weight_frac` cuts the whole step batch once (the same only with one minibatch). Data where
    half the rows are staler than the others, so the two minibatches' cuts differ from the step's."""
    from jaxrl_mismatch.metrics import StatsAccumulator, metrics_config, step_metrics
    from jaxrl_mismatch.train.batch import RolloutBatch
    from jaxrl_mismatch.train.minibatches import minibatch_order
    from jaxrl_mismatch.train.objective import PolicyLoss
    from tests.train.tiny_policy import synthetic_batch

    cfg = objective_config("decoupled_m2po")
    objective = PolicyLoss(cfg=cfg, metrics_cfg=metrics_config(cfg))
    b = synthetic_batch(batch=16, seq=24, prompt_len=4, seed=3)
    m = b["response_mask"]
    rng = np.random.default_rng(0)
    old = (-2.0 + 0.3 * rng.normal(size=m.shape)).astype(np.float32) * m
    stale = np.where(np.arange(16) < 8, 0.05, 0.4)[:, None]
    mu = (old + stale * rng.normal(size=m.shape)).astype(np.float32) * m
    adv = (np.where(np.arange(16) % 2, 1.0, -1.0)[:, None] * m).astype(np.float32)  # no zero advantage
    batch = RolloutBatch(tokens=b["tokens"], attention_mask=b["attention_mask"], response_mask=m, advantages=adv,
                         rollout_logp=mu, old_logp=old)
    acc, zeroed = StatsAccumulator(), 0
    for k, rows in enumerate(np.split(minibatch_order(7, 0, 16, 2), 2)):
        mb = batch.rows(rows)
        acc.add(objective.update_stats(jnp.asarray(mb.old_logp), jnp.zeros(m[rows].shape), mb))
        norm = objective.batch_constants(mb)
        # at θ = θ_old (ratio 1, nothing clipped) a token's gradient is 0 exactly when its weight is
        grad = jax.grad(lambda lp: objective.loss(lp, jnp.zeros_like(lp), mb, norm)[0])(jnp.asarray(mb.old_logp))
        zeroed += int(np.sum((np.asarray(grad) == 0) & (m[rows] > 0)))
    applied = acc.result()["correction/m2po_masked_frac"]
    assert zeroed > 0 and applied == pytest.approx(zeroed / m.sum(), abs=1e-7)
    step = float(step_metrics(old, mu, m, adv, cfg=metrics_config(cfg))["correction/zero_weight_frac"])
    assert abs(step - applied) * m.sum() >= 2  # the step-wide cut masks other tokens (9 vs the loss's 13 of 191)
    assert "num:correction/m2po_masked_frac" not in PolicyLoss(
        cfg=objective_config("decoupled"), metrics_cfg=metrics_config(objective_config("decoupled"))).update_stats(
        jnp.asarray(old), jnp.zeros(m.shape), batch)  # only with M2PO
