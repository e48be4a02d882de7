"""LossInterventions (VeXact zero-mismatch, controlled injection, φ, ξ, J) and the config registry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_mismatch.objectives import (
    IS_WEIGHTS,
    LOG_RATIO_CLAMP,
    PRESETS,
    REGISTRY,
    ObjectiveConfig,
    compute_advantages,
    is_weights,
    batch_constants,
    objective_config,
    policy_loss,
    ref_kl_k3,
    surrogate_j,
    variance_weights,
    weight_distortion,
)


def make_batch(seed, b=6, t=10):
    rng = np.random.default_rng(seed)
    old = (-rng.exponential(1.5, size=(b, t))).astype(np.float32)
    roll = np.minimum(old + 0.3 * rng.normal(size=(b, t)), 0).astype(np.float32)
    mask = np.arange(t)[None, :] < rng.integers(1, t + 1, size=b)[:, None]
    adv = np.repeat(rng.normal(size=(b, 1)), t, 1).astype(np.float32)
    return old, roll, mask, adv


def test_weight_distortion_eq18_and_surrogate_eq23_against_numpy():
    old, _, mask, adv = make_batch(2)
    phi = np.asarray(weight_distortion(old, mask, delta=2.0, pi_low=0.1))
    want = np.where(mask, np.where(np.exp(old) < 0.1, 2.0, 1.0), 0.0)
    np.testing.assert_array_equal(phi, want)
    assert (want[mask] == 2).any() and (want[mask] == 1).any()
    np.testing.assert_allclose(surrogate_j(adv, phi, mask), np.sum(np.where(mask, adv * (want - 1), 0)), rtol=1e-5)


def test_variance_weights_eq21_statistics_and_loss_use():
    _, _, mask, _ = make_batch(3, b=128, t=128)
    xi = np.asarray(variance_weights(mask, sigma=0.2, seed=0))
    assert abs(xi[mask].mean() - 1) < 0.01 and abs(xi[mask].std() - 0.2) < 0.01 and np.all(xi[~mask] == 0)
    old, roll, mask, adv = make_batch(4)
    xi = variance_weights(mask, sigma=0.2, seed=1)
    cfg = objective_config("pg")
    norm = batch_constants(cfg, mask)
    args = dict(old_logp=old, rollout_logp=roll, advantages=adv, mask=mask, norm=norm)
    g = jax.grad(lambda lp: policy_loss(cfg, logp=lp, token_weight=xi, **args)[0])(jnp.asarray(old))
    g0 = jax.grad(lambda lp: policy_loss(cfg, logp=lp, **args)[0])(jnp.asarray(old))
    np.testing.assert_allclose(g, np.asarray(g0) * np.asarray(xi), rtol=1e-5, atol=1e-8)
    # ξ carries no gradient
    gx = jax.grad(lambda x: policy_loss(cfg, logp=old, token_weight=x, **args)[0])(xi)
    assert np.all(np.asarray(gx) == 0)


def test_registry_lists_and_unknown_names_list_valid_ones():
    assert set(REGISTRY) == {"advantages", "loss", "correction", "rejection", "agg", "preset"}
    with pytest.raises(ValueError, match="unknown correction 'tis'; valid: none, token_is, token_tis"):
        ObjectiveConfig(correction="tis")
    with pytest.raises(ValueError, match="unknown loss 'ppo2'; valid: ppo, gspo, gmpo, pg"):
        ObjectiveConfig(loss="ppo2")
    with pytest.raises(ValueError, match="unknown agg"):
        ObjectiveConfig(agg="mean")
    with pytest.raises(ValueError, match="unknown objective preset 'grpo2'; valid: grpo, dapo"):
        objective_config("grpo2")
    with pytest.raises(ValueError, match="unknown ObjectiveConfig field"):
        objective_config("grpo", clip_eps=0.2)
    with pytest.raises(ValueError, match="max_len"):
        objective_config("drgrpo")
    with pytest.raises(ValueError, match="rejection_low must be None"):
        objective_config("grpo", rejection="k3_token", rejection_low=0.1, rejection_high=1.0)
    with pytest.raises(ValueError, match="needs rejection_high"):
        objective_config("grpo", rejection="ratio_token")
    with pytest.raises(ValueError, match="dual_clip"):
        objective_config("grpo", dual_clip=0.5)
    # a value of the wrong type is named as such (a CLI `eps_low=abc` said "'<' not supported between ...")
    with pytest.raises(ValueError, match=r"^eps_low must be float, got 'abc'$"):
        objective_config("grpo", eps_low="abc")
    with pytest.raises(ValueError, match=r"^dual_clip must be float or None, got '3'$"):
        objective_config("grpo", dual_clip="3")
    assert objective_config("grpo", correction_cap=2).correction_cap == 2  # an int is a number
    for loss in ("gspo", "gmpo", "pg"):  # no dual clip there: it would be ignored
        with pytest.raises(ValueError, match=f"dual_clip is PPO's .* loss '{loss}' has none"):
            objective_config("grpo", loss=loss, dual_clip=3.0)
    with pytest.raises(ValueError, match="unknown advantages 'std'; valid: grpo, drgrpo, rloo"):
        objective_config("grpo", advantages="std")


def test_presets_set_their_advantages():
    # Issue 13: 'drgrpo' changed only the aggregation. FP16 eqs. 8–10 (footnote 1) are Dr.GRPO: token sum
    # with a constant normaliser AND a mean baseline without std division.
    for preset in ("drgrpo", "drgrpo_token_tis", "drgrpo_seq_mis"):
        cfg = objective_config(preset, max_len=64)
        assert (cfg.advantages, cfg.agg, cfg.loss) == ("drgrpo", "seq-mean-token-sum-norm", "ppo"), preset
        # §4.1: clip-higher 0.28 for the whole GRPO family, baseline included (it was 0.2 for the baseline only,
        # so baseline vs correction also compared two clips).
        assert (cfg.eps_low, cfg.eps_high) == (0.2, 0.28), preset
    assert objective_config("drgrpo_token_tis", max_len=8).correction == "token_tis"
    assert objective_config("drgrpo_seq_mis", max_len=8).correction == "seq_sum_mis"
    for preset in PRESETS:
        if not preset.startswith("drgrpo"):
            assert objective_config(preset).advantages == "grpo", preset  # std-normalised GRPO
        assert PRESETS[preset]["advantages"] in ("grpo", "drgrpo"), preset  # every preset says which
    assert objective_config("drgrpo", max_len=8, advantages="rloo").advantages == "rloo"  # overridable
    rewards, groups = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), jnp.array([0, 0, 0, 0, 1, 1])
    adv = compute_advantages(objective_config("drgrpo", max_len=8).advantages, rewards, groups, 2)
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5, 0.0, 0.0])  # R − mean_g, no std division


def test_ref_kl_k3_is_nonnegative_masked_and_clamped():
    rng = np.random.default_rng(0)
    logp = np.log(rng.uniform(0.01, 1, (3, 5))).astype(np.float32)
    ref = np.log(rng.uniform(0.01, 1, (3, 5))).astype(np.float32)
    mask = np.arange(5)[None] < np.array([[5], [2], [0]])
    ref_junk = np.where(mask, ref, np.inf).astype(np.float32)
    got = np.asarray(ref_kl_k3(logp, ref_junk, mask))
    q = np.clip(ref.astype(np.float64) - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    np.testing.assert_allclose(got, np.where(mask, np.exp(q) - q - 1, 0), rtol=1e-5, atol=1e-7)
    assert np.all(got >= 0) and np.all(got[~mask] == 0)
    far = np.asarray(ref_kl_k3(np.full((1, 2), -100.0, np.float32), np.zeros((1, 2), np.float32), np.ones((1, 2))))
    np.testing.assert_allclose(far, np.exp(LOG_RATIO_CLAMP) - LOG_RATIO_CLAMP - 1, rtol=1e-5)
    g = jax.grad(lambda lp: jnp.sum(ref_kl_k3(lp, ref_junk, mask)))(jnp.asarray(logp))
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[~mask] == 0)


def test_the_kl_penalty_is_logged_as_a_token_mean_over_the_whole_step():
    """`policy/kl_ref_k3` is Σ k3 / tokens over all the step's updates, not a mean of per-minibatch means: two
    minibatches of 2 and 10 response tokens give the step's token mean. Each minibatch's loss still carries
    kl_coef × its own token mean (the penalty as the loss normalises it), and without a KL nothing is logged."""
    from jaxrl_mismatch.metrics import StatsAccumulator, metrics_config
    from jaxrl_mismatch.train.batch import RolloutBatch
    from jaxrl_mismatch.train.objective import PolicyLoss

    cfg = objective_config("grpo")
    rng = np.random.default_rng(1)
    t = 6
    mask = (np.arange(t)[None] < np.array([[1], [1], [5], [5]])).astype(np.float32)  # minibatches of 2 and 10
    logp = np.log(rng.uniform(0.05, 1, (4, t))).astype(np.float32)
    ref = np.log(rng.uniform(0.05, 1, (4, t))).astype(np.float32)
    zeros = np.zeros((4, t), np.float32)
    batch = RolloutBatch(tokens=np.ones((4, t + 1), np.int32), attention_mask=np.ones((4, t + 1), np.int32),
                         response_mask=mask, advantages=zeros, rollout_logp=logp, old_logp=logp, ref_logp=ref)
    loss = PolicyLoss(cfg=cfg, metrics_cfg=metrics_config(cfg), kl_coef=0.5)
    k3 = np.asarray(ref_kl_k3(logp, ref, mask))
    acc = StatsAccumulator()
    for rows in ([0, 1], [2, 3]):
        mb = batch.rows(np.array(rows))
        acc.add(loss.update_stats(jnp.asarray(mb.old_logp), jnp.zeros((2, t)), mb))
        value, _ = loss.loss(jnp.asarray(mb.old_logp), jnp.zeros((2, t)), mb, loss.batch_constants(mb))
        assert float(value) == pytest.approx(0.5 * k3[rows].sum() / mask[rows].sum(), rel=1e-5)  # A = 0: KL only
    got = acc.result()["policy/kl_ref_k3"]
    assert got == pytest.approx(k3.sum() / mask.sum(), rel=1e-5)
    per_minibatch = np.mean([k3[r].sum() / mask[r].sum() for r in ([0, 1], [2, 3])])
    assert abs(got - per_minibatch) > 0.05 * got  # the data tell the two apart
    assert "num:policy/kl_ref_k3" not in PolicyLoss(cfg=cfg, metrics_cfg=metrics_config(cfg)).update_stats(
        jnp.asarray(logp), jnp.zeros((4, t)), batch)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_builds_and_runs(preset):
    old, roll, mask, adv = make_batch(5)
    cfg = objective_config(preset, max_len=16) if preset.startswith("drgrpo") else objective_config(preset)
    hash(cfg)  # jit-static
    loss, aux = policy_loss(cfg, logp=old + 0.01, old_logp=old, rollout_logp=roll, advantages=adv, mask=mask,
                            norm=batch_constants(cfg, mask, old, roll))
    assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in aux.values())
