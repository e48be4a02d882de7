"""Policy losses (value, gradient and aux) against NumPy references written here, plus independent autodiff
checks that the token forms of GSPO / GMPO / PG-seq-IS have the gradients of their sequence-level formulas."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_mismatch.objectives import (
    AGGREGATIONS,
    applied_weights,
    clip_indicators,
    batch_constants,
    objective_config,
    policy_loss,
)

B, T, L = 6, 7, 10


def make_batch(seed, noise=0.3):
    rng = np.random.default_rng(seed)
    old = -rng.exponential(1.0, size=(B, T))
    roll = np.minimum(old + 0.4 * rng.normal(size=(B, T)), 0.0)
    logp = old + noise * rng.normal(size=(B, T))
    lengths = rng.integers(1, T + 1, size=B)
    lengths[-1] = 0  # an all-padding row
    mask = np.arange(T)[None, :] < lengths[:, None]
    adv = np.repeat(rng.normal(size=(B, 1)), T, 1)
    f = lambda x: np.where(mask, x, rng.normal(size=(B, T)) * 50).astype(np.float32)  # noqa: E731
    return f(logp), f(old), f(roll), f(adv), mask


# ---------------------------------------------------------------- NumPy reference
def np_weights(corr, num, roll, mask, cap):
    lr = np.where(mask, np.clip(num.astype(np.float64) - roll, -20, 20), 0.0)
    if corr == "none":
        return mask.astype(np.float64)
    if corr == "token_tis":
        return np.where(mask, np.minimum(np.exp(lr), cap), 0)
    seq = np.exp(np.clip(lr.sum(-1, keepdims=True), -20, 20)) * np.ones_like(lr)
    if corr == "seq_sum_is":
        return np.where(mask, seq, 0)
    if corr == "seq_sum_mis":
        return np.where(mask, seq * (seq <= cap), 0)
    raise AssertionError(corr)


def np_objective(loss, logp, old, adv, mask, cfg):
    """(objective, d objective / d logp, clip_low, clip_high) per token."""
    lp, o, a = logp.astype(np.float64), old.astype(np.float64), np.where(mask, adv, 0.0).astype(np.float64)
    l = np.where(mask, np.clip(lp - o, -20, 20), 0.0)
    r = np.exp(l)
    n = np.maximum(mask.sum(-1, keepdims=True), 1)
    zeros = np.zeros_like(r, bool)
    if loss == "ppo":
        lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
        unc, clp = r * a, np.clip(r, lo, hi) * a
        obj = np.minimum(unc, clp)
        inside = (r >= lo) & (r <= hi)
        dobj = np.where((unc <= clp) | inside, a * r, 0.0)
        cl, ch = (a < 0) & (r < lo), (a > 0) & (r > hi)
        if cfg.dual_clip is not None:
            dual = (a < 0) & (obj < cfg.dual_clip * a)
            obj = np.where(dual, cfg.dual_clip * a, obj)
            dobj = np.where(dual, 0.0, dobj)
        return obj, dobj, cl & mask, ch & mask
    if loss == "gspo":
        s = np.exp(l.sum(-1, keepdims=True) / n) * np.ones_like(r)
        lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
        unc, clp = s * a, np.clip(s, lo, hi) * a
        inside = (s >= lo) & (s <= hi)
        return (np.minimum(unc, clp), np.where((unc <= clp) | inside, a * s, 0.0),
                mask & (a < 0) & (s < lo), mask & (a > 0) & (s > hi))
    if loss == "gmpo":
        e = cfg.gmpo_eps
        # A > 0: cap log r at +ε (pessimistic); A < 0: floor it at −ε; A = 0: contributes nothing.
        lc = np.where(a > 0, np.minimum(l, e), np.where(a < 0, np.maximum(l, -e), 0.0))
        g = np.exp(np.where(mask, lc, 0).sum(-1, keepdims=True) / n)
        free = np.where(a > 0, l <= e, l >= -e)
        return a * g, np.where(free, a * g, 0.0), mask & (a < 0) & (l < -e), mask & (a > 0) & (l > e)
    if loss == "pg":
        return a, a, zeros, zeros
    raise AssertionError(loss)


def np_coeff(agg, mask):
    ntok, nseq = mask.sum(), mask.any(-1).sum()
    n = np.maximum(mask.sum(-1, keepdims=True), 1)
    c = {"token-mean": 1.0 / ntok, "seq-mean-token-sum": 1.0 / nseq,
         "seq-mean-token-sum-norm": 1.0 / (nseq * L)}.get(agg)
    return np.where(mask, 1.0 / (n * nseq) if c is None else c, 0.0)


CASES = [
    ("grpo", {}), ("dapo", {"dual_clip": 1.2}), ("grpo_token_tis", {"correction_cap": 1.3}),
    ("grpo_seq_mis", {"correction_cap": 1.1}), ("gspo", {"eps_low": 0.05, "eps_high": 0.08}),
    ("gmpo", {"gmpo_eps": 0.2}),
    ("pg", {}), ("pg_seq_is", {}), ("pg_seq_tis", {"correction_cap": 1.2}), ("pg_seq_mis", {"correction_cap": 1.2}),
]


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("preset,over", CASES, ids=[c[0] for c in CASES])
def test_policy_loss_value_grad_aux_match_numpy(preset, over, agg):
    logp, old, roll, adv, mask = make_batch(zlib.crc32(f"{preset}/{agg}".encode()) % 1000)
    cfg = objective_config(preset, agg=agg, max_len=L, **over)
    norm = batch_constants(cfg, mask, old, roll)

    def f(lp):
        return policy_loss(cfg, logp=lp, old_logp=old, rollout_logp=roll, advantages=adv, mask=mask, norm=norm)

    (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    num = logp if cfg.loss == "pg" else old  # PG uses π(y|θ)/μ (FP16 eqs. 5–7); PPO family π(θ_old)/μ
    corr = {"seq_sum_tis": "seq_sum_mis"}.get(cfg.correction, cfg.correction)
    w = np_weights(cfg.correction, num, roll, mask, cfg.correction_cap) if corr == cfg.correction else None
    if cfg.correction == "seq_sum_tis":
        lr = np.where(mask, np.clip(num.astype(np.float64) - roll, -20, 20), 0.0)
        w = np.where(mask, np.minimum(np.exp(lr.sum(-1, keepdims=True)), cfg.correction_cap), 0)
    if cfg.correction in ("token_tis", "seq_sum_tis", "seq_sum_mis"):  # the data reach the cap in every case
        lr = np.where(mask, np.clip(num.astype(np.float64) - roll, -20, 20), 0.0)
        raw = np.exp(lr if cfg.correction.startswith("token") else lr.sum(-1, keepdims=True)) * np.ones_like(lr)
        assert (mask & ~np.isclose(w, raw)).any(), "no token's weight is changed by the cap: a vacuous case"
    obj, dobj, cl, ch = np_objective(cfg.loss, logp, old, adv, mask, cfg)
    c = np_coeff(agg, mask)
    want_loss = -np.sum(c * w * np.where(mask, obj, 0))
    want_grad = -c * w * np.where(mask, dobj, 0)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-6)
    assert list(aux) == ["loss/policy"] and aux["loss/policy"].dtype == jnp.float32
    np.testing.assert_allclose(aux["loss/policy"], want_loss, rtol=2e-5, atol=1e-6)
    # The weights the loss applies and the clip indicators (on the ratio this objective clips).
    np.testing.assert_allclose(applied_weights(cfg, num, roll, mask, global_weight_mean=norm.weight_mean), w,
                               rtol=2e-5, atol=1e-7)
    ind = clip_indicators(cfg, logp, old, adv, mask)
    np.testing.assert_array_equal(ind["clip_low"], cl)
    np.testing.assert_array_equal(ind["clip_high"], ch)
    r = np.exp(np.clip(logp.astype(np.float64) - old, -20, 20))
    dual = mask & (adv < 0) & (r > 1.2) if preset == "dapo" else np.zeros_like(mask)
    assert dual.any() == (preset == "dapo")
    np.testing.assert_array_equal(ind["dual_clip"], dual)


def test_reference_cases_exercise_clipping_and_masking():
    """Guard against vacuous reference tests: the data above do clip and mask."""
    logp, old, roll, adv, mask = make_batch(0)
    cfg = objective_config("grpo")
    _, _, cl, ch = np_objective("ppo", logp, old, adv, mask, cfg)
    assert cl.any() and ch.any()
    assert (np_weights("seq_sum_mis", old, roll, mask, 1.1)[mask] == 0).any()


# ---------------------------------------------------------------- sequence-level formulas, autodiff
def _seq_mean(x, m):
    return jnp.sum(jnp.where(m, x, 0), -1) / jnp.maximum(jnp.sum(m, -1), 1)


def test_gspo_gradient_equals_sequence_objective_gradient():
    logp, old, _, adv, mask = make_batch(11, noise=0.05)
    cfg = objective_config("gspo", eps_low=0.01, eps_high=0.02)
    norm = batch_constants(cfg, mask)
    nseq = mask.any(-1).sum()

    def paper(lp):  # GSPO: (1/G) Σ_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r_t)
        s = jnp.exp(_seq_mean(lp - old, mask))
        a = adv[:, 0]
        j = jnp.minimum(s * a, jnp.clip(s, 1 - cfg.eps_low, 1 + cfg.eps_high) * a)
        return -jnp.sum(jnp.where(mask.any(-1), j, 0)) / nseq

    ours = lambda lp: policy_loss(cfg, logp=lp, old_logp=old, rollout_logp=old, advantages=adv,  # noqa: E731
                                  mask=mask, norm=norm)[0]
    np.testing.assert_allclose(ours(logp), paper(jnp.asarray(logp)), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(jnp.asarray(logp)), jax.grad(paper)(jnp.asarray(logp)), rtol=1e-4,
                               atol=1e-7)


def test_gmpo_gradient_equals_sequence_objective_gradient():
    logp, old, _, adv, mask = make_batch(12, noise=0.3)
    cfg = objective_config("gmpo", gmpo_eps=0.25)
    norm = batch_constants(cfg, mask)
    nseq = mask.any(-1).sum()

    def paper(lp):  # GMPO: A_i · (Π_t clip-pessimistic r_t)^{1/|y_i|}
        a = adv[:, :1]
        lr = lp - old
        lc = jnp.where(a > 0, jnp.minimum(lr, cfg.gmpo_eps), jnp.maximum(lr, -cfg.gmpo_eps))
        j = adv[:, 0] * jnp.exp(_seq_mean(lc, mask))
        return -jnp.sum(jnp.where(mask.any(-1), j, 0)) / nseq

    ours = lambda lp: policy_loss(cfg, logp=lp, old_logp=old, rollout_logp=old, advantages=adv,  # noqa: E731
                                  mask=mask, norm=norm)[0]
    np.testing.assert_allclose(ours(logp), paper(jnp.asarray(logp)), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(jnp.asarray(logp)), jax.grad(paper)(jnp.asarray(logp)), rtol=1e-4,
                               atol=1e-7)


def test_pg_seq_is_gradient_is_fp16_eq5():
    """∇ of our surrogate = mean_i [π(y_i|θ)/μ(y_i) · ∇ log π(y_i|θ) · A_i] = ∇ mean_i [π(y_i|θ)/μ(y_i) · A_i]."""
    logp, old, roll, adv, mask = make_batch(13, noise=0.2)
    cfg = objective_config("pg_seq_is")
    norm = batch_constants(cfg, mask)
    nseq = mask.any(-1).sum()

    def paper(lp):
        w = jnp.exp(jnp.sum(jnp.where(mask, lp - roll, 0), -1))
        return -jnp.sum(jnp.where(mask.any(-1), w * adv[:, 0], 0)) / nseq

    ours = lambda lp: policy_loss(cfg, logp=lp, old_logp=old, rollout_logp=roll, advantages=adv,  # noqa: E731
                                  mask=mask, norm=norm)[0]
    np.testing.assert_allclose(jax.grad(ours)(jnp.asarray(logp)), jax.grad(paper)(jnp.asarray(logp)), rtol=1e-4,
                               atol=1e-7)


def test_drgrpo_token_tis_is_fp16_eq9():
    """Eq. 9: Σ_t min(ρ_t, C) ∇ min(r_t A, clip(r_t) A) — autodiff of the formula with ρ from π(θ_old)/μ,
    averaged over sequences with Dr.GRPO's constant normaliser L (FP16 App. A.1)."""
    logp, old, roll, adv, mask = make_batch(14)
    cfg = objective_config("drgrpo_token_tis", correction_cap=1.2, max_len=L)
    assert cfg.advantages == "drgrpo" and cfg.agg == "seq-mean-token-sum-norm" and cfg.eps_high == 0.28
    norm = batch_constants(cfg, mask)
    nseq = mask.any(-1).sum() * L

    old_, roll_ = np.where(mask, old, 0), np.where(mask, roll, 0)  # the formula is defined on response tokens only

    def paper(lp):
        lp = jnp.where(mask, lp, 0)
        rho_c = jnp.minimum(jnp.exp(old_ - roll_), cfg.correction_cap)
        r = jnp.exp(lp - old_)
        a = np.where(mask, adv, 0)
        j = rho_c * jnp.minimum(r * a, jnp.clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * a)
        return -jnp.sum(jnp.where(mask, j, 0)) / nseq

    ours = lambda lp: policy_loss(cfg, logp=lp, old_logp=old, rollout_logp=roll, advantages=adv,  # noqa: E731
                                  mask=mask, norm=norm)[0]
    np.testing.assert_allclose(ours(logp), paper(jnp.asarray(logp)), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(jnp.asarray(logp)), jax.grad(paper)(jnp.asarray(logp)), rtol=1e-4,
                               atol=1e-7)


def test_loss_has_no_gradient_through_rollout_logp():
    logp, old, roll, adv, mask = make_batch(15)
    for preset in ("grpo_token_tis", "grpo_seq_mis", "pg_seq_is", "icepop"):
        cfg = objective_config(preset)
        norm = batch_constants(cfg, mask)
        g = jax.grad(lambda r: policy_loss(cfg, logp=logp, old_logp=old, rollout_logp=r, advantages=adv,
                                           mask=mask, norm=norm)[0])(jnp.asarray(roll))
        assert np.all(np.asarray(g) == 0), preset


def test_policy_loss_accepts_preset_name_and_is_jittable():
    logp, old, roll, adv, mask = make_batch(16)
    cfg = objective_config("grpo_seq_mis")
    norm = batch_constants(cfg, mask)
    eager = policy_loss("grpo_seq_mis", logp=logp, old_logp=old, rollout_logp=roll, advantages=adv, mask=mask,
                        norm=norm)[0]
    jitted = jax.jit(lambda *a: policy_loss(cfg, logp=a[0], old_logp=a[1], rollout_logp=a[2], advantages=a[3],
                                            mask=a[4], norm=a[5]))(logp, old, roll, adv, mask, norm)[0]
    np.testing.assert_allclose(eager, jitted, rtol=1e-6)


def test_gmpo_keeps_a_token_gradient_beyond_the_log_ratio_clamp():
    """GMPO's pessimistic side is unclipped and its token gradient, A·g·∇log r_t / |y| (GMPO eq. 1), is not
    scaled by r_t: a token at log r = −25 (A > 0) has the same gradient as the others. The ±20 clamp of each
    token's log-ratio zeroed it (a review's case: 0 against −0.0121)."""
    t = 50
    old = jnp.full((1, t), -1.0)
    logp = old.at[0, 7].add(-25.0)
    adv, mask = jnp.ones((1, t)), jnp.ones((1, t), bool)
    cfg = objective_config("gmpo")
    norm = batch_constants(cfg, mask, old, old)
    loss = lambda x: policy_loss(cfg, logp=x, old_logp=old, rollout_logp=old, advantages=adv, mask=mask,  # noqa: E731
                                 norm=norm)[0]

    def reference(x, eps=0.4):  # −(Π_t min(r_t, clip(r_t, e^−ε, e^ε)))^(1/|y|) for A = 1
        lr = x - old
        return -jnp.exp(jnp.mean(jnp.minimum(lr, jnp.clip(lr, -eps, eps))))

    np.testing.assert_allclose(loss(logp), reference(logp), rtol=1e-5)
    got, want = jax.grad(loss)(logp), jax.grad(reference)(logp)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-9)
    assert float(got[0, 7]) < -0.01
