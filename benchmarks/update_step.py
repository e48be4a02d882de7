"""Policy-update throughput: our jitted update step vs the same model, loss and optimizer in PyTorch.

    .venv/bin/python benchmarks/update_step.py [--batch 4] [--seq 256] [--repeats 40]

One step = forward + backward + global-norm clipping + AdamW on a full RL batch, which is where an RL
trainer spends its trainer-side time. Both sides start from the SAME weights: a random Qwen3-architecture
model (4 layers, d=256, vocab 32k by default) is built by us, written with `models.save_hf` and loaded by
transformers `Qwen3ForCausalLM.from_pretrained`, in float32.

- jax: `train.step.make_update_fn` with `train.objective.PolicyLoss(objective_config("grpo"))` —
  token PPO-clip (FP16 paper eq. 8), token-mean aggregation — jitted by `jit_update` (donated state,
  explicit shardings, 1-device mesh). The step also computes what it always computes: per-token
  entropy (chunked, rematerialised LM head) and the mismatch/health metrics.
- torch: `model(...).logits` → `log_softmax` → `gather`, a hand-written PPO-clip token-mean loss with the
  same `old_logp` / advantages / response mask (log-ratio clamped to ±20 as in `objectives.ratios`), the
  detached entropy (so both sides produce the same outputs), `clip_grad_norm_(1.0)` and
  `torch.optim.AdamW` with `make_optimizer("adamw")`'s hyperparameters (betas (0.9, 0.999), eps 1e-8,
  weight decay 0.01).

The two sides are interleaved (one jax step, one torch step, …) so background load on a shared machine
hits both alike; the first two steps of each are warm-up (jax's first pays the compilation) and double
as the correctness check: the step-1 loss and raw grad norm must agree (same computation at θ = θ_old)
and the step-2 loss must agree (same optimizer). Every step uses a new learning rate, set from the host
(`schedules.set_lr_scale` on our side, the param-group LR on theirs), and we count XLA compilations of
our update across all of them with `train.compiles.count_compilations`: the contract is exactly 1.
`--exact-forward` adds a third side, interleaved with the two: our update with `trainer.exact_forward`
(log π valued by the exact scorer's per-row program, `train/exact_forward.py`; rollout max_tokens =
seq + 1 − prompt_len), and reports its time over the ordinary update's.
tokens/s = batch × seq / median step time (the fastest step is reported too: on a shared CPU it is the
less load-sensitive of the two). Writes benchmarks/results/update_step.json.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

from benchmarks._args import ArgumentParser, check_fits, description, positive_int, positive_float  # noqa: E402
from benchmarks._paths import check_out, write_json  # noqa: E402
from jaxrl_mismatch import precision  # noqa: E402
from jaxrl_mismatch.models import ModelConfig, Transformer, save_hf  # noqa: E402
from jaxrl_mismatch.models.exact import canonical_length  # noqa: E402
from jaxrl_mismatch.models.sharding import make_mesh  # noqa: E402
from jaxrl_mismatch.objectives import objective_config  # noqa: E402
from jaxrl_mismatch.schedules import OPTIMIZERS, make_optimizer, set_lr_scale  # noqa: E402
from jaxrl_mismatch.train.compiles import count_compilations  # noqa: E402
from jaxrl_mismatch.metrics import metrics_config  # noqa: E402
from jaxrl_mismatch.models.scoring import make_scorer  # noqa: E402
from jaxrl_mismatch.train.batch import RolloutBatch  # noqa: E402
from jaxrl_mismatch.train.exact_forward import ExactForward  # noqa: E402
from jaxrl_mismatch.train.objective import PolicyLoss  # noqa: E402
from jaxrl_mismatch.train.state import init_state, split_model  # noqa: E402
from jaxrl_mismatch.train.step import (  # noqa: E402
    jit_update,
    make_update_fn,
    place_batch,
    place_state,
)

MODEL = dict(
    architecture="Qwen3ForCausalLM", vocab_size=32000, hidden_size=256, intermediate_size=1024,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
    rope_theta=1e6, rope_scaling=None, tie_word_embeddings=False, attention_bias=False, qk_norm=True,
    max_position_embeddings=2048,
)
MAX_GRAD_NORM = 1.0
EPS_CLIP = 0.2  # objective_config("grpo"): eps_low = eps_high = 0.2
LOG_RATIO_CLAMP = 20.0
WARMUP = 2


def lr_scale_at(i: int) -> float:
    """A different host-set LR multiplier at every step, as a length-triggered controller would give."""
    return 1.0 / (1.0 + 0.05 * i)


def make_batch(batch: int, seq: int, prompt_len: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """`seq + 1` tokens per row (so `seq` predicted positions); responses of varied length after a prompt.

    No attention padding (both sides attend to every position), so the masked-out tail of a short
    response changes the loss but not the work: the benchmark measures the same FLOPs on both sides.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    resp_len = rng.integers(seq // 2, seq - prompt_len + 1, batch)
    t = np.arange(seq)[None, :]  # target index t predicts tokens[:, t + 1]
    response_mask = ((t + 1 >= prompt_len) & (t + 1 < prompt_len + resp_len[:, None])).astype(np.float32)
    adv = rng.normal(size=(batch, 1)).astype(np.float32)
    return {
        "tokens": tokens,
        "attention_mask": np.ones_like(tokens),
        "response_mask": response_mask,
        "advantages": adv * response_mask,
    }


def rel_diff(a: float, b: float) -> float:
    """Relative difference of two values that should agree (our and PyTorch's step-1 grad norm):
    |a − b| / max(|a|, |b|), in [0, 1] for two norms; 0 when both are 0 (an all-masked or zero-advantage batch has a zero
    gradient on both sides: they agree). Symmetric, and never a division by zero (the earlier |a / b − 1| failed
    with ZeroDivisionError after the whole measurement when PyTorch's norm was 0); for values that agree it is
    |a / b − 1| to within that difference squared."""
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 else 0.0


def torch_ppo_clip_loss(logp, old_logp, adv, mask):
    """Token PPO-clip, token-mean over response tokens: −Σ min(r·A, clip(r, 1±ε)·A) / Σ mask."""
    m = mask > 0
    log_r = torch.where(m, (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), torch.zeros_like(logp))
    r = torch.exp(log_r)
    a = torch.where(m, adv, torch.zeros_like(adv))
    obj = torch.minimum(r * a, r.clamp(1.0 - EPS_CLIP, 1.0 + EPS_CLIP) * a)
    return -(obj * m).sum() / m.sum().clamp(min=1)


def main() -> None:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--batch", type=positive_int, default=4)
    ap.add_argument("--seq", type=positive_int, default=256)
    ap.add_argument("--prompt-len", type=positive_int, default=32)
    ap.add_argument("--repeats", type=positive_int, default=40, help="timed steps per side (after 2 warm-up steps)")
    ap.add_argument("--lr", type=positive_float, default=1e-3)
    ap.add_argument("--chunk-size", type=positive_int, default=128, help="LM-head chunk of our update's log-prob pass")
    ap.add_argument("--exact-forward", action="store_true", help="also time the update with trainer.exact_forward")
    ap.add_argument("--out", default=None, help="default benchmarks/results/update_step.json "
                                                "(update_step_exact.json with --exact-forward)")
    args = ap.parse_args()
    for flag, value, ok, need in (("--batch", args.batch, args.batch >= 1, "≥ 1"),
                                  ("--repeats", args.repeats, args.repeats >= 1, "≥ 1"),
                                  ("--prompt-len", args.prompt_len, 1 <= args.prompt_len < args.seq, "in 1..--seq − 1"),
                                  ("--chunk-size", args.chunk_size, args.chunk_size >= 1, "≥ 1"),
                                  ("--lr", args.lr, args.lr > 0, "> 0")):
        if not ok:
            print(f"error: {flag} must be {need}, got {value}", file=sys.stderr)
            sys.exit(2)
    check_fits(ap, "--batch × --seq", 4 * args.batch * args.seq * MODEL["vocab_size"],
               f"the PyTorch side's float32 logits over the {MODEL['vocab_size']}-token vocabulary")
    if args.out is None:
        args.out = str(REPO / "benchmarks/results" / ("update_step_exact.json" if args.exact_forward else "update_step.json"))
    check_out("--out", args.out, __file__)

    load_avg_start = os.getloadavg()[0]
    cfg = ModelConfig(**MODEL)
    pol = precision.policy("fp32", param_dtype="float32")
    model = Transformer(cfg, pol, rngs=nnx.Rngs(0))
    with tempfile.TemporaryDirectory() as d:
        save_hf(model, cfg, d)
        hf = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32).train()
    n_params = sum(p.numel() for p in hf.parameters())

    # ---- our side ---------------------------------------------------------------------------------
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    graphdef, params = split_model(model)
    adamw = OPTIMIZERS["adamw"][1]
    opt = make_optimizer("adamw", learning_rate=args.lr, max_grad_norm=MAX_GRAD_NORM)
    state = place_state(init_state(params, opt, precision.loss_scale_for(pol)), mesh)
    obj_cfg = objective_config("grpo")
    update_fn = make_update_fn(graphdef, opt, PolicyLoss(cfg=obj_cfg, metrics_cfg=metrics_config(obj_cfg)),
                               max_grad_norm=MAX_GRAD_NORM, chunk_size=args.chunk_size)

    np_batch = make_batch(args.batch, args.seq, args.prompt_len, cfg.vocab_size)
    old_logp, _ = make_scorer(graphdef, mesh, chunk_size=args.chunk_size)(
        state.params, np_batch["tokens"], np_batch["attention_mask"])
    old_logp = np.asarray(old_logp) * np_batch["response_mask"]
    noise = np.random.default_rng(1).normal(scale=0.05, size=old_logp.shape).astype(np.float32)
    np_batch.update(old_logp=old_logp, rollout_logp=(old_logp + noise) * np_batch["response_mask"])
    batch = place_batch(RolloutBatch(**np_batch), mesh)
    update = jit_update(update_fn, state, batch, mesh)
    exact = {}
    if args.exact_forward:  # same objective and optimizer; π(θ) valued by the exact program
        max_tokens = args.seq + 1 - args.prompt_len
        exact_fn = make_update_fn(graphdef, opt, PolicyLoss(cfg=obj_cfg, metrics_cfg=metrics_config(obj_cfg)),
                                  max_grad_norm=MAX_GRAD_NORM, chunk_size=args.chunk_size,
                                  exact_forward=ExactForward(graphdef, max_tokens, args.prompt_len))
        own = jax.tree.map(lambda x: jax.numpy.array(x, copy=True), params)  # the other update donates its buffers
        exact["state"] = place_state(init_state(own, opt, precision.loss_scale_for(pol)), mesh)
        exact["update"] = jit_update(exact_fn, exact["state"], batch, mesh)
        exact["canonical_length"] = canonical_length(args.prompt_len, max_tokens)

    def exact_step(i: int) -> float:
        s = exact["state"].replace(opt_state=set_lr_scale(exact["state"].opt_state, lr_scale_at(i), mesh))
        t0 = time.perf_counter()
        s, metrics = exact["update"](s, batch)
        jax.block_until_ready((s, metrics))
        exact["state"] = s
        return time.perf_counter() - t0

    jax_state = {"state": state}
    jax_log: list[dict[str, float]] = []

    def jax_step(i: int) -> float:
        s = jax_state["state"]
        s = s.replace(opt_state=set_lr_scale(s.opt_state, lr_scale_at(i), mesh))
        t0 = time.perf_counter()
        s, metrics = update(s, batch)
        jax.block_until_ready((s, metrics))
        dt = time.perf_counter() - t0
        jax_state["state"] = s
        if i < WARMUP:
            jax_log.append({"loss": float(metrics["mean:loss/total"]), "grad_norm": float(metrics["mean:grad/norm"])})
        return dt

    # ---- torch side -------------------------------------------------------------------------------
    t_tok = torch.from_numpy(np_batch["tokens"]).long()
    t_ids, t_targets = t_tok[:, :-1], t_tok[:, 1:]
    t_attn = torch.from_numpy(np_batch["attention_mask"][:, :-1]).long()
    t_old, t_adv, t_mask = (torch.from_numpy(np.array(np_batch[k])) for k in
                            ("old_logp", "advantages", "response_mask"))
    t_opt = torch.optim.AdamW(hf.parameters(), lr=args.lr, betas=(adamw["b1"], adamw["b2"]), eps=adamw["eps"],
                              weight_decay=adamw["weight_decay"])
    torch_log: list[dict[str, float]] = []

    def torch_step(i: int) -> float:
        for group in t_opt.param_groups:
            group["lr"] = args.lr * lr_scale_at(i)
        t0 = time.perf_counter()
        logits = hf(input_ids=t_ids, attention_mask=t_attn).logits
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        logp = logp_all.gather(-1, t_targets[..., None])[..., 0]
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        loss = torch_ppo_clip_loss(logp, t_old, t_adv, t_mask)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_GRAD_NORM)
        t_opt.step()
        t_opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        del entropy
        if i < WARMUP:
            torch_log.append({"loss": float(loss.detach()), "grad_norm": float(grad_norm)})
        return dt

    # ---- interleaved run --------------------------------------------------------------------------
    sides = (("jax", jax_step), ("torch", torch_step)) + ((("jax_exact", exact_step),) if exact else ())
    times: dict[str, list[float]] = {name: [] for name, _ in sides}
    warmup_s: dict[str, list[float]] = {name: [] for name, _ in sides}
    n_steps = WARMUP + args.repeats
    side_compiles = {name: 0 for name, _ in sides if name != "torch"}  # each jax side's own update program
    for i in range(n_steps):
        for name, step in sides:
            with count_compilations("update") as c:
                dt = step(i)
            if name in side_compiles:
                side_compiles[name] += c["compiles"]
            (warmup_s if i < WARMUP else times)[name].append(dt)
    load_avg_end = os.getloadavg()[0]

    n_tokens = args.batch * args.seq
    results = {}
    labels = (("jax", "jax (jit update)"), ("torch", "torch (transformers)"))
    if exact:
        labels += (("jax_exact", "jax exact_forward"),)
    for name, label in labels:
        med = statistics.median(times[name])
        best = min(times[name])
        results[label] = {"median_s": med, "tokens_per_s": n_tokens / med, "min_s": best,
                          "tokens_per_s_at_min": n_tokens / best, "warmup_s": warmup_s[name], "times_s": times[name]}
    jax_tps = results["jax (jit update)"]["tokens_per_s"]
    torch_tps = results["torch (transformers)"]["tokens_per_s"]
    agreement = {
        f"step{i + 1}": {"jax": jax_log[i], "torch": torch_log[i],
                         "abs_diff_loss": abs(jax_log[i]["loss"] - torch_log[i]["loss"]),
                         "rel_diff_grad_norm": rel_diff(jax_log[i]["grad_norm"], torch_log[i]["grad_norm"])}
        for i in range(WARMUP)
    }

    print(f"\npolicy update (fwd + bwd + clip + AdamW, PPO-clip token-mean), fp32, batch {args.batch} x seq "
          f"{args.seq}, Qwen3 {MODEL['num_hidden_layers']} layers d={MODEL['hidden_size']} vocab "
          f"{MODEL['vocab_size']} ({n_params / 1e6:.1f}M params)")
    for i in range(WARMUP):
        a = agreement[f"step{i + 1}"]
        print(f"step {i + 1}: loss jax {a['jax']['loss']:+.7f} torch {a['torch']['loss']:+.7f} "
              f"(|Δ| {a['abs_diff_loss']:.1e});  grad norm jax {a['jax']['grad_norm']:.5f} "
              f"torch {a['torch']['grad_norm']:.5f} (rel Δ {a['rel_diff_grad_norm']:.1e})")
    print(f"{'engine':<24}{'median s':>10}{'tokens/s':>11}{'min s':>8}{'tokens/s@min':>14}{'1st step s':>12}")
    for name, r in results.items():
        print(f"{name:<24}{r['median_s']:>10.3f}{r['tokens_per_s']:>11.0f}{r['min_s']:>8.3f}"
              f"{r['tokens_per_s_at_min']:>14.0f}{r['warmup_s'][0]:>12.2f}")
    ratio_at_min = (results["jax (jit update)"]["tokens_per_s_at_min"]
                    / results["torch (transformers)"]["tokens_per_s_at_min"])
    if exact:
        ex = results["jax exact_forward"]["median_s"] / results["jax (jit update)"]["median_s"]
        ex_min = results["jax exact_forward"]["min_s"] / results["jax (jit update)"]["min_s"]
        print(f"exact_forward / ordinary update time: {ex:.2f}x (median), {ex_min:.2f}x (min); rows computed "
              f"alone at canonical length {exact['canonical_length']}")
    exact_compiles = f" (exact_forward update: {side_compiles['jax_exact']})" if exact else ""
    print(f"ratio jax/torch: {jax_tps / torch_tps:.2f}x (median), {ratio_at_min:.2f}x (min)   "
          f"compilations of our update over {n_steps} distinct LRs: {side_compiles['jax']}{exact_compiles}   "
          f"load avg {load_avg_start:.1f} -> {load_avg_end:.1f} on {os.cpu_count()} CPUs")

    out = {
        "model": MODEL,
        "params": n_params,
        "batch": args.batch,
        "seq": args.seq,
        "prompt_len": args.prompt_len,
        "chunk_size": args.chunk_size,
        "dtype": "float32",
        "objective": "grpo (token PPO-clip, eps 0.2, token-mean)",
        "optimizer": {"name": "adamw", "lr": args.lr, "max_grad_norm": MAX_GRAD_NORM, **adamw},
        "warmup_steps": WARMUP,
        "timed_steps": args.repeats,
        "results": results,
        "ratio_jax_over_torch": jax_tps / torch_tps,
        "ratio_jax_over_torch_at_min": ratio_at_min,
        "agreement": agreement,
        "rel_diff_definition": "|jax - torch| / max(|jax|, |torch|); 0 when both are 0",
        "lr_values": n_steps,
        "compiles_of_update": side_compiles["jax"],
        **({"compiles_of_exact_forward_update": side_compiles["jax_exact"]} if exact else {}),
        **({"exact_forward_over_ordinary": {
            "median": results["jax exact_forward"]["median_s"] / results["jax (jit update)"]["median_s"],
            "min": results["jax exact_forward"]["min_s"] / results["jax (jit update)"]["min_s"]},
            "exact_canonical_length": exact["canonical_length"]} if exact else {}),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg_1min": {"start": load_avg_start, "end": load_avg_end},
        "jax_backend": jax.default_backend(),
        "torch_threads": torch.get_num_threads(),
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
    }
    write_json(args.out, out, __file__)


if __name__ == "__main__":
    main()
