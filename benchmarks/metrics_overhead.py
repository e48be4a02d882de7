"""Overhead of computing every mismatch/health metric inside the jitted loss-and-gradient step.

A small policy (embedding → 2-layer MLP → LM head over a 512-token vocabulary; B=16, T=256) computes the
token log-probs and entropies; step "off" = policy_loss + grad; step "on" = the same plus
``step_metrics`` + ``update_stats`` (all families) returned from the same jit. Both steps return the policy loss aux and the
mean entropy, so the difference is the metrics code only. Steps are timed interleaved (off, on, off, on, …)
after warm-up, and the medians compared. Target: overhead ≤ 3 %.

    python benchmarks/metrics_overhead.py [--repeats 60] [--batch 16] [--seq 256] [--vocab 512]

Prints a table and writes benchmarks/results/metrics_overhead.json.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._args import ArgumentParser, check_fits, positive_int  # noqa: E402
from benchmarks._paths import check_out, write_json  # noqa: E402
from jaxrl_mismatch.metrics import metrics_config, step_metrics, update_stats  # noqa: E402
from jaxrl_mismatch.objectives import PRESETS, batch_constants, objective_config, policy_loss  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "metrics_overhead.json"


def init_params(key, vocab: int, dim: int, hidden: int):
    k = jax.random.split(key, 4)
    s = 1.0 / np.sqrt(dim)
    return {
        "embed": jax.random.normal(k[0], (vocab, dim)) * s,
        "w1": jax.random.normal(k[1], (dim, hidden)) * s,
        "w2": jax.random.normal(k[2], (hidden, dim)) / np.sqrt(hidden),
        "head": jax.random.normal(k[3], (dim, vocab)) * s,
    }


def policy_logprobs(params, inputs, targets):
    """Token log-probs and entropies of a tiny (non-causal-mixing) policy: each position sees its input token."""
    h = params["embed"][inputs]
    h = h + jax.nn.gelu(h @ params["w1"]) @ params["w2"]
    logits = h @ params["head"]
    logz = jax.nn.log_softmax(logits, -1)
    logp = jnp.take_along_axis(logz, targets[..., None], -1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logz) * logz, -1)
    return logp, entropy


def make_steps(cfg, mcfg):
    def loss_fn(params, batch, norm):
        logp, entropy = policy_logprobs(params, batch["inputs"], batch["targets"])
        loss, aux = policy_loss(cfg, logp=logp, old_logp=batch["old_logp"], rollout_logp=batch["rollout_logp"],
                                advantages=batch["adv"], mask=batch["mask"], norm=norm)
        aux["policy/entropy_step"] = jnp.sum(jnp.where(batch["mask"], entropy, 0)) / norm.tokens
        return loss, (aux, logp, entropy)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    @jax.jit
    def step_off(params, batch):
        norm = batch_constants(cfg, batch["mask"], batch["old_logp"], batch["rollout_logp"])
        (loss, (aux, _, _)), grads = grad_fn(params, batch, norm)
        return loss, aux, grads

    @jax.jit
    def step_on(params, batch):
        norm = batch_constants(cfg, batch["mask"], batch["old_logp"], batch["rollout_logp"])
        (loss, (aux, logp, entropy)), grads = grad_fn(params, batch, norm)
        metrics = all_metrics(batch, jax.lax.stop_gradient(logp), jax.lax.stop_gradient(entropy))
        return loss, {**aux, **metrics}, grads

    def all_metrics(batch, logp, entropy):
        # What the trainer computes per step: the θ-independent step metrics and one update's statistics.
        return {**step_metrics(batch["old_logp"], batch["rollout_logp"], batch["mask"], batch["adv"], cfg=mcfg),
                **update_stats(logp, batch["old_logp"], batch["adv"], batch["mask"], cfg=mcfg, entropy=entropy)}

    metrics_only = jax.jit(all_metrics)

    return step_off, step_on, metrics_only


def make_batch(params, rng, b, t, vocab):
    tokens = rng.integers(0, vocab, size=(b, t + 1))
    inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    old_logp, _ = policy_logprobs(params, inputs, targets)
    rollout_logp = jnp.minimum(old_logp + 0.05 * jnp.asarray(rng.normal(size=(b, t)), jnp.float32), 0.0)
    lengths = rng.integers(t // 4, t + 1, size=b)
    mask = jnp.asarray(np.arange(t)[None, :] < lengths[:, None])
    adv = jnp.asarray(np.repeat(rng.normal(size=(b, 1)), t, 1), jnp.float32)
    return {"inputs": inputs, "targets": targets, "old_logp": old_logp, "rollout_logp": rollout_logp,
            "mask": mask, "adv": adv}


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def main():
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=positive_int, default=16)
    ap.add_argument("--seq", type=positive_int, default=256)
    ap.add_argument("--vocab", type=positive_int, default=512)
    ap.add_argument("--dim", type=positive_int, default=128)
    ap.add_argument("--hidden", type=positive_int, default=512)
    ap.add_argument("--repeats", type=positive_int, default=60)
    ap.add_argument("--preset", choices=tuple(PRESETS), default="grpo_token_tis", metavar="PRESET",
                    help=f"objective preset, one of {', '.join(PRESETS)}")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = ap.parse_args()
    check_fits(ap, "--batch × --seq × --vocab", 4 * args.batch * args.seq * args.vocab, "the float32 logits")
    check_fits(ap, "--vocab × --dim", 4 * args.vocab * args.dim, "the float32 embedding")
    check_fits(ap, "--dim × --hidden", 4 * args.dim * args.hidden, "the float32 MLP weight")
    check_out("--out", args.out, __file__)

    params = init_params(jax.random.key(0), args.vocab, args.dim, args.hidden)
    batch = make_batch(params, np.random.default_rng(0), args.batch, args.seq, args.vocab)
    cfg = objective_config(args.preset)
    step_off, step_on, metrics_only = make_steps(cfg, metrics_config(cfg))
    logp_cur, entropy = policy_logprobs(params, batch["inputs"], batch["targets"])

    for _ in range(5):  # compile + warm up both
        timed(step_off, params, batch)
        timed(step_on, params, batch)
        timed(metrics_only, batch, logp_cur, entropy)
    n_metrics = len(step_on(params, batch)[1]) - len(step_off(params, batch)[1])

    off, on, alone = [], [], []
    for i in range(args.repeats):  # interleave, alternating which goes first
        pair = [(step_off, off), (step_on, on)]
        for fn, acc in (pair if i % 2 == 0 else pair[::-1]):
            acc.append(timed(fn, params, batch))
        alone.append(timed(metrics_only, batch, logp_cur, entropy))

    med_off, med_on = statistics.median(off), statistics.median(on)
    overhead = (med_on - med_off) / med_off * 100.0
    # paired per-repeat ratios: robust to load drifting over the run
    paired = statistics.median([b / a - 1.0 for a, b in zip(off, on)]) * 100.0
    # the metrics computation jitted on its own: an upper bound on what it can add (no fusion with the step)
    med_alone = statistics.median(alone)
    result = {
        "device": str(jax.devices()[0]), "platform": platform.platform(), "jax": jax.__version__,
        "batch": args.batch, "seq": args.seq, "vocab": args.vocab, "dim": args.dim, "hidden": args.hidden,
        "preset": args.preset, "repeats": args.repeats, "n_metrics": n_metrics,
        "median_ms_metrics_off": med_off * 1e3, "median_ms_metrics_on": med_on * 1e3,
        "median_ms_metrics_alone": med_alone * 1e3, "metrics_alone_pct_of_step": med_alone / med_off * 100.0,
        "overhead_pct": overhead, "paired_median_overhead_pct": paired, "target_pct": 3.0,
        "meets_target": overhead <= 3.0,
    }
    print(f"{'step':<26}{'median ms':>12}")
    print(f"{'loss+grad, metrics off':<26}{med_off * 1e3:>12.3f}")
    print(f"{'loss+grad, metrics on':<26}{med_on * 1e3:>12.3f}")
    print(f"{'metrics alone (own jit)':<26}{med_alone * 1e3:>12.3f}")
    print(f"overhead (medians): {overhead:+.2f} %   paired median: {paired:+.2f} %   "
          f"metrics alone: {med_alone / med_off * 100:.2f} % of the step   "
          f"({n_metrics} metrics, target ≤ 3 %, device {result['device']})")
    write_json(args.out, result, __file__)


if __name__ == "__main__":
    main()
