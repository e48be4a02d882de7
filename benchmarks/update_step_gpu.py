"""Update-step throughput and MFU at real shapes, next to PyTorch; engine generation vs the HBM bound.

    .venv/bin/python benchmarks/update_step_gpu.py --device gpu --shape qwen3-0.6b            # 8x2048, 4x8192
    .venv/bin/python benchmarks/update_step_gpu.py --device gpu --shape qwen3-1.7b
    .venv/bin/python benchmarks/update_step_gpu.py --device cpu --shape tiny                  # shows it runs

Parts (each in its own subprocess, so every one gets the whole accelerator — JAX's allocator never hands
memory back, and a co-resident PyTorch would otherwise see only what JAX left):

- `jax`: the project's update step — `train.step.make_update_fn` (fwd + bwd + global-norm clip + AdamW,
  objective `grpo`: token PPO-clip, FP16 paper eq. 8) on a `train.state` TrainState, jitted by
  `jit_update` — for a random model of the shape, bf16 compute with fp32 master weights
  (`precision.policy("bf16", param_dtype="float32")`), scanned layers, `attention_impl` auto (cuDNN on
  GPU). `--remat auto` tries none → save_dots → full until one fits. Reports the compiled temp memory too.
- `torch`: the same step in PyTorch on the same weights and batch: transformers `Qwen3ForCausalLM`
  (`attn_implementation="sdpa"`), `torch.autocast(bfloat16)` over fp32 parameters, log-softmax in fp32,
  the same PPO-clip token-mean loss, `clip_grad_norm_(1.0)`, `torch.optim.AdamW(fused=True)` on CUDA;
  gradient checkpointing only if it does not fit without.
- `engine`: generation tokens/s of the built-in rollout engine (`rollout.jax_engine.JaxEngine`, bf16) vs
  the HBM-bandwidth bound: every decode step must read the weights once and the filled KV cache, so
  tokens/s ≤ batch / (bytes_step / bandwidth), summed over the steps.
- `decode`: cost of one decode step vs the *filled* cache length in a large allocated cache, block-wise
  (what the engine runs) vs reading the whole cache (`block = allocated`, the previous behaviour).
- `packing`: padding of the demo's batch shape (tiny_cpu: 32 prompts × 8 samples, prompt ≈ 30 tokens,
  responses 10–60) before and after `train.packing.pack_rows`, and the log-prob fwd+bwd time of both.

MFU = model FLOPs / time / peak bf16 FLOP/s. Model FLOPs per step = 3 × forward (backward = 2 × forward:
Kaplan et al. 2020 §2.1; Chowdhery et al. 2022, App. B), forward = 2 × matmul parameters (blocks + LM head)
per token + causal attention 4·L·H·hd·(t+1) for the token at position t (QKᵀ and PV over its t+1 keys).
Recomputation (remat, the chunked LM head's backward) is not model FLOPs. Peak FLOP/s and HBM bandwidth
come from NVIDIA datasheets by device name (`DEVICE_SPECS`) or `--peak-tflops` / `--hbm-tbps`.

Writes benchmarks/results/update_step_gpu_<device>_<shape>.json (the device named in it and the file name).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._args import INT32_MAX, ArgumentParser, description, positive_int, nonneg_int, positive_float  # noqa: E402
from benchmarks._paths import check_out, repo_relative_args, write_json, write_text  # noqa: E402

SHAPES = {
    # Qwen3-0.6B / -1.7B config.json shapes (tied embeddings, q/k norms, GQA 16/8, head_dim 128).
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    # A CPU-sized model of the same architecture.
    "tiny": dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
}
DEFAULT_BATCH_SEQ = {"qwen3-0.6b": "8x2048,4x8192", "qwen3-1.7b": "8x2048,4x8192", "tiny": "4x256,2x1024"}
# (bf16 dense TFLOP/s, HBM TB/s) by a substring of `device_kind` / torch's device name; NVIDIA datasheets.
DEVICE_SPECS = (
    ("H100 PCIe", 756.0, 2.0), ("H100 NVL", 835.0, 3.9), ("H100", 989.0, 3.35), ("H200", 989.0, 4.8),
    ("GH200", 989.0, 4.0), ("A100-SXM4-80GB", 312.0, 2.039), ("A100-SXM4-40GB", 312.0, 1.555),
    ("A100 80GB PCIe", 312.0, 1.935), ("A100", 312.0, 1.555), ("L40S", 362.0, 0.864),
)
MAX_GRAD_NORM, EPS_CLIP, LOG_RATIO_CLAMP, LR = 1.0, 0.2, 20.0, 1e-6
PROMPT_LEN = 128


def model_spec(shape: str) -> dict:
    return dict(architecture="Qwen3ForCausalLM", rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
                attention_bias=False, qk_norm=True, max_position_embeddings=40960, **SHAPES[shape])


def matmul_params(spec: dict) -> int:
    d, f, hd = spec["hidden_size"], spec["intermediate_size"], spec["head_dim"]
    h, kv = spec["num_attention_heads"], spec["num_key_value_heads"]
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f
    return spec["num_hidden_layers"] * per_layer + d * spec["vocab_size"]  # + the LM head (tied or not)


def train_flops(spec: dict, batch: int, seq: int) -> float:
    """Model FLOPs of one fwd+bwd over `batch` rows of `seq` positions (see the module docstring)."""
    attn = 4 * spec["num_hidden_layers"] * spec["num_attention_heads"] * spec["head_dim"] * seq * (seq + 1) / 2
    return 3.0 * batch * (2.0 * matmul_params(spec) * seq + attn)


def device_specs(name: str, args) -> tuple[float | None, float | None]:
    peak, bw = args.peak_tflops, args.hbm_tbps
    for key, p, b in DEVICE_SPECS:
        if key.lower() in name.lower():
            peak, bw = peak or p, bw or b
            break
    return peak, bw


def parse_batch_seq(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*([1-9]\d*)x([1-9]\d*)\s*", item)
        if not m:
            raise argparse.ArgumentTypeError(f"expected BxS[,BxS...] with B, S >= 1, got {item!r}")
        if max(int(m.group(1)), int(m.group(2))) > INT32_MAX:
            raise argparse.ArgumentTypeError(f"B and S must be at most {INT32_MAX} (int32), got {item.strip()!r}")
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def make_batch(batch: int, seq: int, vocab: int, seed: int = 0):
    """`seq + 1` tokens per row (`seq` scored positions), no padding, responses after a PROMPT_LEN prompt."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    prompt = min(PROMPT_LEN, seq // 4)
    resp_len = rng.integers(seq // 2, seq - prompt + 1, batch)
    t = np.arange(seq)[None, :]
    response_mask = ((t + 1 >= prompt) & (t + 1 < prompt + resp_len[:, None])).astype(np.float32)
    adv = rng.normal(size=(batch, 1)).astype(np.float32)
    return {"tokens": tokens, "attention_mask": np.ones_like(tokens), "response_mask": response_mask,
            "advantages": adv * response_mask}


def _device_name(jax) -> str:
    dev = jax.devices()[0]
    return dev.device_kind if dev.platform == "gpu" else dev.platform


def _is_oom(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return any(k in text for k in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemory"))


def _timed(step, warmup: int, repeats: int) -> dict:
    times = []
    for i in range(warmup + repeats):
        dt = step(i)
        if i >= warmup:
            times.append(dt)
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


# ------------------------------------------------------------------------------------------------- jax
def part_jax(args, work: Path) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl_mismatch import precision
    from jaxrl_mismatch.metrics import metrics_config
    from jaxrl_mismatch.models import ModelConfig, Transformer, save_hf
    from jaxrl_mismatch.models.sharding import make_mesh
    from jaxrl_mismatch.objectives import objective_config
    from jaxrl_mismatch.schedules import make_optimizer
    from jaxrl_mismatch.train.batch import RolloutBatch
    from jaxrl_mismatch.train.objective import PolicyLoss
    from jaxrl_mismatch.train.state import init_state, split_model
    from jaxrl_mismatch.models.scoring import make_scorer
    from jaxrl_mismatch.train.step import jit_update, make_update_fn, place_batch, place_state

    spec = model_spec(args.shape)
    cfg = ModelConfig(**spec)
    pol = precision.policy(args.precision, param_dtype="float32")
    model = Transformer(cfg, pol, rngs=nnx.Rngs(0), scan_layers=not args.unrolled, attention_impl=args.attention_impl)
    save_hf(model, cfg, work / "ckpt")  # fp32: what the torch part and the engine load
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    obj_cfg = objective_config("grpo")
    objective = PolicyLoss(cfg=obj_cfg, metrics_cfg=metrics_config(obj_cfg))
    opt = make_optimizer("adamw", learning_rate=LR, max_grad_norm=MAX_GRAD_NORM)
    candidates = ["none", "save_dots", "full"] if args.remat == "auto" else [args.remat]
    runs = []
    for b, s in parse_batch_seq(args.batch_seq):
        np_batch = make_batch(b, s, cfg.vocab_size)
        record: dict = {"batch": b, "seq": s, "tried": []}
        for remat in candidates:
            model.remat = remat
            graphdef, params = split_model(model)
            params = jax.tree.map(jnp.copy, params)  # the update donates its state; keep the model's own arrays
            try:
                state = place_state(init_state(params, opt, precision.loss_scale_for(pol)), mesh)
                old_logp, _ = make_scorer(graphdef, mesh, chunk_size=args.chunk_size)(
                    state.params, np_batch["tokens"], np_batch["attention_mask"])
                old = np.asarray(old_logp, np.float32) * np_batch["response_mask"]
                noise = np.random.default_rng(1).normal(scale=0.05, size=old.shape).astype(np.float32)
                host = dict(np_batch, old_logp=old, rollout_logp=(old + noise) * np_batch["response_mask"])
                np.savez(work / f"batch_{b}x{s}.npz", **host)
                batch = place_batch(RolloutBatch(**host), mesh)
                update_fn = make_update_fn(graphdef, opt, objective, max_grad_norm=MAX_GRAD_NORM,
                                           chunk_size=args.chunk_size)
                t0 = time.perf_counter()
                compiled = jit_update(update_fn, state, batch, mesh).lower(state, batch).compile()
                compile_s = time.perf_counter() - t0
                mem = compiled.memory_analysis()
                box = {"state": state}
                first: list[dict] = []

                def step(i):
                    t = time.perf_counter()
                    new, metrics = compiled(box["state"], batch)
                    jax.block_until_ready((new, metrics))
                    box["state"] = new
                    if i == 0:
                        first.append({"loss": float(metrics["mean:loss/total"]), "grad_norm": float(metrics["mean:grad/norm"])})
                    return time.perf_counter() - t

                timing = _timed(step, args.warmup, args.repeats)
            except Exception as err:  # noqa: BLE001 — an OOM is a result; anything else is re-raised
                if not _is_oom(err):
                    raise
                record["tried"].append({"remat": remat, "result": "OOM", "error": str(err).splitlines()[0][:300]})
                state = box = compiled = None  # noqa: F841 — free before the next attempt
                continue
            record.update(remat=remat, compile_s=compile_s, temp_bytes=int(mem.temp_size_in_bytes),
                          argument_bytes=int(mem.argument_size_in_bytes), step1=first[0], **timing)
            del state, box, compiled
            break
        else:
            record["result"] = "OOM"
        runs.append(record)
    return {"device": _device_name(jax), "jax": jax.__version__,
            "precision": args.precision, "scan_layers": not args.unrolled, "attention_impl": args.attention_impl,
            "chunk_size": args.chunk_size, "runs": runs}


# ----------------------------------------------------------------------------------------------- torch
def torch_ppo_clip_loss(torch, logp, old_logp, adv, mask):
    """Token PPO-clip, token-mean over response tokens: −Σ min(r·A, clip(r, 1±ε)·A) / Σ mask."""
    m = mask > 0
    log_r = torch.where(m, (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), torch.zeros_like(logp))
    r = torch.exp(log_r)
    a = torch.where(m, adv, torch.zeros_like(adv))
    obj = torch.minimum(r * a, r.clamp(1.0 - EPS_CLIP, 1.0 + EPS_CLIP) * a)
    return -(obj * m).sum() / m.sum().clamp(min=1)


def part_torch(args, work: Path) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from jaxrl_mismatch.schedules import OPTIMIZERS

    dev = "cuda" if args.device == "gpu" else "cpu"
    adamw = OPTIMIZERS["adamw"][1]
    runs = []
    for b, s in parse_batch_seq(args.batch_seq):
        path = work / f"batch_{b}x{s}.npz"
        if not path.exists():  # the jax part found no configuration that fits: nothing to compare with
            runs.append({"batch": b, "seq": s, "result": "skipped (no jax batch)"})
            continue
        host = dict(np.load(path))
        record: dict = {"batch": b, "seq": s, "tried": []}
        for ckpt in (False, True):
            hf = opt = None
            try:
                hf = AutoModelForCausalLM.from_pretrained(work / "ckpt", dtype=torch.float32,
                                                          attn_implementation="sdpa").to(dev).train()
                if ckpt:
                    hf.gradient_checkpointing_enable()
                opt = torch.optim.AdamW(hf.parameters(), lr=LR, betas=(adamw["b1"], adamw["b2"]), eps=adamw["eps"],
                                        weight_decay=adamw["weight_decay"], fused=dev == "cuda")
                tok = torch.from_numpy(host["tokens"]).long().to(dev)
                ids, targets = tok[:, :-1], tok[:, 1:]
                old, adv, mask = (torch.from_numpy(np.asarray(host[k])).to(dev)
                                  for k in ("old_logp", "advantages", "response_mask"))
                first: list[dict] = []

                def step(i):
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    with torch.autocast(device_type=dev, dtype=torch.bfloat16):
                        logits = hf(input_ids=ids).logits
                    logp_all = torch.log_softmax(logits.float(), dim=-1)
                    logp = logp_all.gather(-1, targets[..., None])[..., 0]
                    loss = torch_ppo_clip_loss(torch, logp, old, adv, mask)
                    loss.backward()
                    grad_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_GRAD_NORM)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t
                    if i == 0:
                        first.append({"loss": float(loss.detach()), "grad_norm": float(grad_norm)})
                    return dt

                timing = _timed(step, args.warmup, args.repeats)
            except Exception as err:  # noqa: BLE001
                if not _is_oom(err):
                    raise
                record["tried"].append({"gradient_checkpointing": ckpt, "result": "OOM"})
                del hf, opt
                if dev == "cuda":
                    torch.cuda.empty_cache()
                continue
            record.update(gradient_checkpointing=ckpt, step1=first[0], **timing)
            if dev == "cuda":
                record["peak_bytes"] = int(torch.cuda.max_memory_allocated())
            del hf, opt
            if dev == "cuda":
                torch.cuda.empty_cache()
            break
        else:
            record["result"] = "OOM"
        runs.append(record)
    name = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__, "runs": runs}


# ---------------------------------------------------------------------------------------------- engine
def part_engine(args, work: Path) -> dict:
    import jax
    import numpy as np

    from jaxrl_mismatch.rollout.engine import SamplingSpec
    from jaxrl_mismatch.rollout.jax_engine import JaxEngine

    spec = model_spec(args.shape)
    b, p, n = args.gen_batch, args.gen_prompt, args.gen_tokens
    engine = JaxEngine(str(work / "ckpt"), dtype=args.engine_dtype, max_model_len=p + n, max_batch_rows=b)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, spec["vocab_size"], p).tolist() for _ in range(b)]
    sampling = SamplingSpec(n=1, max_tokens=n, temperature=1.0, seed=0)
    t0 = time.perf_counter()
    engine.generate(prompts, sampling)
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(args.gen_repeats):
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling)
        times.append(time.perf_counter() - t0)
    assert all(len(c[0].token_ids) == n for c in out)  # no stop token: every row decodes n tokens
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[args.engine_dtype]
    weight_bytes = itemsize * matmul_params(spec)
    kv_per_token = 2 * spec["num_hidden_layers"] * spec["num_key_value_heads"] * spec["head_dim"] * itemsize
    step_bytes = [weight_bytes + kv_per_token * b * (p + t + 1) for t in range(n)]
    return {"device": _device_name(jax), "dtype": args.engine_dtype,
            "batch": b, "prompt": p, "new_tokens": n, "first_call_s": first_s, "median_s": statistics.median(times),
            "tokens_per_s": b * n / statistics.median(times), "decode_bytes_total": float(sum(step_bytes)),
            "note": "time includes prefill and the host side of Generate; the bound counts decode reads only"}


# ---------------------------------------------------------------------------------------------- decode
def part_decode(args, work: Path) -> dict:
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_mismatch import precision
    from jaxrl_mismatch.models import decode_step, init_cache, load_hf

    preset = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[args.engine_dtype]
    _, model = load_hf(work / "ckpt", policy=precision.policy(preset))
    graphdef, state = nnx.split(model)
    b, alloc, steps = args.decode_batch, args.decode_alloc, args.decode_steps
    # filled lengths in 1..alloc − steps − 1 (main checks alloc >= steps + 2): the steps' new tokens fit after them
    fills = sorted({max(1, min(f, alloc - steps - 1)) for f in (16, alloc // 16, alloc // 4, alloc // 2, alloc - 64)})

    # The cache is donated and returned (aliased in place), as in the engine's generation loop: no copy of
    # it per call, so the time is the decode steps' own.
    @functools.partial(jax.jit, donate_argnums=(1,))
    def run(state, cache, tok):
        m = nnx.merge(graphdef, state)

        def body(carry, _):
            cache, tok = carry
            logits, cache = decode_step(m, tok, cache)
            return (cache, jnp.argmax(logits, -1).astype(jnp.int32)), None

        (cache, tok), _ = jax.lax.scan(body, (cache, tok), None, length=steps)
        return tok, cache

    def filled_cache(length: int, fill: int):
        cache = init_cache(model.cfg, b, length, model.policy.compute_dtype)
        return dataclasses.replace(cache, index=jnp.int32(fill), next_position=jnp.full((b,), fill, jnp.int32),
                                   key_mask=jnp.broadcast_to(jnp.arange(cache.max_len)[None, :] < fill, (b, cache.max_len)))

    tok = jnp.zeros((b,), jnp.int32)
    out = []
    for fill in fills:
        for label, length in (("allocated", alloc), ("tight", fill + steps + 1)):
            times = []
            try:
                jax.block_until_ready(run(state, filled_cache(length, fill), tok))  # compile
                for _ in range(args.decode_repeats):
                    cache = jax.block_until_ready(filled_cache(length, fill))
                    t0 = time.perf_counter()
                    jax.block_until_ready(run(state, cache, tok))
                    times.append(time.perf_counter() - t0)
            except Exception as err:  # noqa: BLE001 — an OOM is a result (this point's cache does not fit)
                if not _is_oom(err):
                    raise
                out.append({"cache": label, "allocated": length, "filled": fill, "result": "OOM"})
                continue
            out.append({"cache": label, "allocated": length, "filled": fill,
                        "ms_per_step": 1e3 * min(times) / steps, "ms_per_step_median": 1e3 * statistics.median(times) / steps})
    return {"batch": b, "steps": steps, "dtype": args.engine_dtype, "block": 256, "points": out}


# --------------------------------------------------------------------------------------------- packing
def part_packing(args, work: Path) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl_mismatch import precision
    from jaxrl_mismatch.data.batching import pad_rows
    from jaxrl_mismatch.models import load_hf, token_logprobs
    from jaxrl_mismatch.train.packing import pack_rows, unpack_targets

    rng = np.random.default_rng(0)
    rows = 32 * 8  # tiny_cpu: prompts_per_step 32 x group_size 8
    prompt_len = rng.integers(25, 36, 32).repeat(8)  # one prompt per group of 8 samples
    resp_len = rng.integers(10, 61, rows)
    prompts = [list(rng.integers(1, 500, n)) for n in prompt_len]
    completions = [list(rng.integers(1, 500, n)) for n in resp_len]
    padded = pad_rows(prompts, completions, pad_id=0)
    groups = {"whole batch": 1, "per minibatch (4)": 4, "per microbatch (4 x 2)": 8}
    stats = {}
    for name, g in groups.items():
        packed = pack_rows(padded.tokens, padded.attention_mask, num_groups=g)
        stats[name] = packed.padding_stats(padded.tokens.shape)

    # log-prob fwd+bwd on the benchmark's model, unpacked vs packed (per-microbatch groups), same tokens
    _, model = load_hf(work / "ckpt", policy=precision.policy(args.precision, param_dtype="float32"))
    graphdef, params = nnx.split(model, nnx.Param)
    vocab = model.cfg.vocab_size
    tokens = np.minimum(padded.tokens, vocab - 1)
    packed = pack_rows(tokens, padded.attention_mask, num_groups=8)

    def loss_unpacked(p, tok, mask, valid):  # summed over the targets packing keeps: the same value both ways
        lp, _ = token_logprobs(nnx.merge(graphdef, p), tok[:, :-1], tok[:, 1:], mask[:, :-1], chunk_size=64)
        return jnp.sum(jnp.where(valid, lp, 0.0))

    def loss_packed(p, tok, seg, pos, idx, valid):
        lp, _ = token_logprobs(nnx.merge(graphdef, p), tok[:, :-1], tok[:, 1:], None, chunk_size=64,
                               segment_ids=seg[:, :-1], positions=pos[:, :-1])
        return jnp.sum(unpack_targets(lp, idx, valid, num_groups=8))

    programs = {}
    for name, fn, fargs in (
        ("unpacked", loss_unpacked, (tokens, padded.attention_mask, packed.rows.unpack_valid)),
        ("packed", loss_packed, (packed.rows.tokens, packed.rows.segment_ids, packed.rows.positions,
                                 packed.rows.unpack_index, packed.rows.unpack_valid)),
    ):
        g = jax.jit(jax.value_and_grad(fn))
        fargs = tuple(jnp.asarray(a) for a in fargs)
        jax.block_until_ready(g(params, *fargs))
        programs[name] = (g, fargs)
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(args.decode_repeats):  # interleaved, so load on a shared machine hits both alike
        for name, (g, fargs) in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(g(params, *fargs))
            times[name].append(time.perf_counter() - t0)
    timing = {name: {"min_s": min(t), "median_s": statistics.median(t),
                     "value": float(programs[name][0](params, *programs[name][1])[0])} for name, t in times.items()}
    return {"shape": list(padded.tokens.shape), "stats": stats, "logprob_fwd_bwd": timing,
            "lengths": {"prompt": [25, 35], "response": [10, 60]}}


# ----------------------------------------------------------------------------------------------- driver
PARTS = {"jax": part_jax, "torch": part_torch, "engine": part_engine, "decode": part_decode, "packing": part_packing}


def child_env(args) -> dict:
    """The parts' environment: `--device` decides JAX's platform (an inherited JAX_PLATFORMS does not: with
    JAX_PLATFORMS=cpu in the caller's environment `--device gpu` ran on the CPU and labelled the result gpu)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.device == "cpu":
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    else:
        env["JAX_PLATFORMS"] = "cuda"
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # one process per part owns the GPU
    return env


_PROBE = """import sys
try:
    import jax
    dev = jax.devices()[0]
except Exception as e:  # jax raises a bare AssertionError when no backend of JAX_PLATFORMS starts
    print("PROBE-FAILED", (type(e).__name__ + ": " + str(e).strip().splitlines()[0]) if str(e).strip() else type(e).__name__)
    sys.exit(3)
print("PROBE", dev.platform, dev.device_kind if dev.platform == "gpu" else dev.platform)
"""


def probe_device(args) -> str:
    """The device the parts will run on, named as they name it, asked of a short child with the parts' environment
    (the parent never initialises the GPU), before anything is measured. `--device gpu` without a GPU JAX can use
    is one line naming the flag, exit 2."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=child_env(args), cwd=REPO, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    last = lines[-1].split(" ", 2) if lines else []
    if proc.returncode != 0 or len(last) != 3 or last[0] != "PROBE" or (args.device == "gpu") != (last[1] == "gpu"):
        why = (lines[-1].removeprefix("PROBE-FAILED ") if lines else
               (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1])
        if args.device == "gpu":
            print(f"error: --device gpu: JAX finds no GPU here (with JAX_PLATFORMS=cuda: {why}); run it where "
                  "jax[cuda] sees a GPU, or pass --device cpu", file=sys.stderr)
        else:
            print(f"error: --device cpu: JAX cannot start on the CPU ({why})", file=sys.stderr)
        sys.exit(2)
    return last[2]


def default_out(args, device: str) -> Path:
    """`benchmarks/results/update_step_gpu_<device>_<shape>.json`, `device` as `probe_device` names it, so that
    the path is known and checked before anything is measured."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return REPO / f"benchmarks/results/update_step_gpu_{slug}_{args.shape}.json"


def run_part(name: str, args, work: Path) -> dict:
    out = work / f"{name}.json"
    cmd = [sys.executable, __file__, "--_part", name, "--_work", str(work), *sys.argv[1:]]
    print(f"[{name}] running ...", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=child_env(args), cwd=REPO)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"part {name} exited with {proc.returncode}"}
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


def summarise(args, results: dict) -> dict:
    spec = model_spec(args.shape)
    device = results.get("jax", {}).get("device", args.device)
    peak, bw = device_specs(device, args)
    rows = []
    jax_runs = {(r["batch"], r["seq"]): r for r in results.get("jax", {}).get("runs", [])}
    torch_runs = {(r["batch"], r["seq"]): r for r in results.get("torch", {}).get("runs", [])}
    for key in jax_runs:
        b, s = key
        flops = train_flops(spec, b, s)
        row = {"batch": b, "seq": s, "model_tflop_per_step": flops / 1e12}
        for side, run in (("jax", jax_runs.get(key)), ("torch", torch_runs.get(key))):
            if run and "median_s" in run:
                row[f"{side}_tokens_per_s"] = b * s / run["median_s"]
                row[f"{side}_mfu"] = flops / run["median_s"] / (peak * 1e12) if peak else None
            if run and "step1" in run:
                row[f"{side}_step1_loss"] = run["step1"]["loss"]
        if "jax_tokens_per_s" in row and "torch_tokens_per_s" in row:
            row["jax_over_torch"] = row["jax_tokens_per_s"] / row["torch_tokens_per_s"]
        rows.append(row)
    engine = results.get("engine", {})
    if "median_s" in engine and bw:
        bound_s = engine["decode_bytes_total"] / (bw * 1e12)
        engine["hbm_bound_tokens_per_s"] = engine["batch"] * engine["new_tokens"] / bound_s
        engine["fraction_of_bound"] = engine["tokens_per_s"] / engine["hbm_bound_tokens_per_s"]
    return {"device": device, "peak_bf16_tflops": peak, "hbm_tbps": bw, "params_matmul": matmul_params(spec),
            "table": rows}


def print_table(args, summary: dict, results: dict) -> None:
    print(f"\n{args.shape} on {summary['device']} (peak {summary['peak_bf16_tflops']} TFLOP/s bf16, "
          f"HBM {summary['hbm_tbps']} TB/s), update step = fwd + bwd + clip + AdamW, PPO-clip, "
          f"{args.precision} compute, fp32 master weights")
    print(f"{'batch x seq':>12}{'jax tok/s':>12}{'jax MFU':>9}{'remat':>10}{'temp GB':>9}{'torch tok/s':>13}"
          f"{'torch MFU':>11}{'jax/torch':>11}   step-1 loss jax / torch")
    jr = {(r["batch"], r["seq"]): r for r in results.get("jax", {}).get("runs", [])}
    for row in summary["table"]:
        j = jr[(row["batch"], row["seq"])]

        def fmt(v, f):
            return format(v, f) if isinstance(v, (int, float)) else "-"

        print(f"{row['batch']:>5} x {row['seq']:<5}{fmt(row.get('jax_tokens_per_s'), '.0f'):>12}"
              f"{fmt(row.get('jax_mfu') and 100 * row['jax_mfu'], '.1f'):>9}{j.get('remat', 'OOM'):>10}"
              f"{fmt(j.get('temp_bytes') and j['temp_bytes'] / 1e9, '.2f'):>9}"
              f"{fmt(row.get('torch_tokens_per_s'), '.0f'):>13}{fmt(row.get('torch_mfu') and 100 * row['torch_mfu'], '.1f'):>11}"
              f"{fmt(row.get('jax_over_torch'), '.2f'):>11}   {fmt(row.get('jax_step1_loss'), '+.5f')} / "
              f"{fmt(row.get('torch_step1_loss'), '+.5f')}")
    e = results.get("engine", {})
    if "tokens_per_s" in e:
        bound = e.get("hbm_bound_tokens_per_s")
        print(f"engine generation ({e['dtype']}, {e['batch']} rows, prompt {e['prompt']}, {e['new_tokens']} new): "
              f"{e['tokens_per_s']:.0f} tok/s" + (f", HBM bound {bound:.0f} tok/s ({100 * e['fraction_of_bound']:.1f} %)"
                                                  if bound else " (no bandwidth figure for this device)"))
    d = results.get("decode", {})
    if "points" in d:
        print(f"decode step (batch {d['batch']}, {d['dtype']}, block {d['block']}), ms/step by filled length, in a "
              f"{args.decode_alloc}-slot cache vs a cache just large enough:")
        by_fill: dict = {}
        for p in d["points"]:
            by_fill.setdefault(p["filled"], {})[p["cache"]] = p.get("ms_per_step", float("nan"))  # nan: OOM
        for fill, v in by_fill.items():
            print(f"  filled {fill:>6}: {v.get('allocated', float('nan')):8.3f} ms   tight {v.get('tight', float('nan')):8.3f} ms")
    pk = results.get("packing", {})
    if "stats" in pk:
        print(f"packing on the demo batch shape {pk['shape']} (prompt 25-35, responses 10-60 tokens):")
        for name, st in pk["stats"].items():
            print(f"  {name:<24} rows {st['rows_unpacked']} -> {st['rows_packed']}, padding "
                  f"{100 * st['padding_unpacked']:.1f} % -> {100 * st['padding_packed']:.1f} %, "
                  f"token slots saved {100 * st['slots_saved']:.1f} %")
        t = pk["logprob_fwd_bwd"]
        print(f"  log-prob fwd+bwd ({args.precision}): unpacked {t['unpacked']['min_s']:.3f} s, packed "
              f"{t['packed']['min_s']:.3f} s (summed log-prob {t['unpacked']['value']:.2f} vs {t['packed']['value']:.2f})")


def main() -> int:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--batch-seq", default=None, help="e.g. 8x2048,4x8192 (default depends on --shape)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated, of {', '.join(PARTS)}; jax always runs (first: it writes the checkpoint "
                         "and batches the others use)")
    ap.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--remat", choices=("auto", "none", "full", "save_dots", "offload"), default="auto")
    ap.add_argument("--attention-impl", choices=("auto", "xla", "cudnn", "chunked"), default="auto")
    ap.add_argument("--unrolled", action="store_true", help="layers as a Python loop instead of nnx scan")
    ap.add_argument("--chunk-size", type=positive_int, default=512, help="LM-head sequence chunk of the log-prob pass")
    ap.add_argument("--warmup", type=nonneg_int, default=2)
    ap.add_argument("--repeats", type=positive_int, default=10)
    ap.add_argument("--engine-dtype", choices=("bfloat16", "float16", "float32"), default=None,
                    help="default bfloat16 on gpu, float32 on cpu")
    ap.add_argument("--gen-batch", type=positive_int, default=None, help="engine part: rows (default 64 gpu, 8 cpu)")
    ap.add_argument("--gen-prompt", type=positive_int, default=128, help="engine part: prompt tokens per row")
    ap.add_argument("--gen-tokens", type=positive_int, default=None,
                    help="engine part: new tokens per row (default 512 gpu, 64 cpu)")
    ap.add_argument("--gen-repeats", type=positive_int, default=3, help="engine part: timed calls")
    ap.add_argument("--decode-alloc", type=positive_int, default=None,
                    help="allocated cache slots of the decode sweep (default 8192; at least --decode-steps + 2)")
    ap.add_argument("--decode-batch", type=positive_int, default=None, help="rows of the decode sweep (default 16 gpu, 32 cpu)")
    ap.add_argument("--decode-steps", type=positive_int, default=16)
    ap.add_argument("--decode-repeats", type=positive_int, default=5,
                    help="timed runs per decode point (the fastest is kept); also the packing part's timed runs")
    ap.add_argument("--peak-tflops", type=positive_float, default=None,
                    help="peak bf16 TFLOP/s for MFU (default: the datasheet figure of the device's name, DEVICE_SPECS)")
    ap.add_argument("--hbm-tbps", type=positive_float, default=None,
                    help="HBM TB/s for the engine's bound (default: the datasheet figure of the device's name)")
    ap.add_argument("--out", default=None,
                    help="default benchmarks/results/update_step_gpu_<device>_<shape>.json, <device> as JAX names it")
    ap.add_argument("--_part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_work", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    gpu = args.device == "gpu"
    args.batch_seq = args.batch_seq or DEFAULT_BATCH_SEQ[args.shape]
    if not args._part:  # the parent checks every flag before any part runs (a child gets them checked)
        try:
            parse_batch_seq(args.batch_seq)
        except argparse.ArgumentTypeError as e:
            ap.error(f"argument --batch-seq: {e}")
        unknown = sorted({p.strip() for p in args.parts.split(",") if p.strip()} - set(PARTS))
        if unknown or not args.parts.strip(", "):
            ap.error(f"argument --parts: {', '.join(unknown) or 'none given'}: not a part; choose from "
                     f"{', '.join(PARTS)}")
        # as the trainer's check_model: the part failed with cuDNN's traceback after the model was built
        why = ("it needs a GPU (--device cpu)" if not gpu else
               "it needs bf16/fp16 compute (--precision fp32)" if args.precision == "fp32" else None)
        if args.attention_impl == "cudnn" and why:
            ap.error(f"argument --attention-impl: 'cudnn' cannot run: {why}; use auto, xla or chunked")
        steps = args.decode_steps
        if "decode" in args.parts.replace(" ", "").split(",") and args.decode_alloc is not None \
                and args.decode_alloc < steps + 2:
            ap.error(f"argument --decode-alloc: {args.decode_alloc} slots cannot hold a filled length >= 1 and "
                     f"--decode-steps {steps} more (+1): give at least {steps + 2}")
    args.engine_dtype = args.engine_dtype or ("bfloat16" if gpu else "float32")
    args.gen_batch = args.gen_batch or (64 if gpu else 8)
    args.gen_tokens = args.gen_tokens or (512 if gpu else 64)
    args.decode_alloc = args.decode_alloc or max(8192, args.decode_steps + 2)
    # 64 rows x 8192 slots of Qwen3-0.6B is 60 GB of K/V; XLA:GPU's autotuner then needed 28 GB more (H100 OOM).
    args.decode_batch = args.decode_batch or (16 if gpu else 32)

    if args._part:  # a child: one part, result to <work>/<part>.json
        result = PARTS[args._part](args, Path(args._work))
        write_text(Path(args._work) / f"{args._part}.json", json.dumps(result))  # for the parent, not a result
        return 0
    device = probe_device(args)  # --device gpu without a GPU: one line, exit 2, before anything is measured
    out = Path(args.out) if args.out is not None else default_out(args, device)
    check_out("--out", out, __file__)  # before anything is measured

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if parts and parts[0] != "jax":
        parts = ["jax", *[p for p in parts if p != "jax"]]  # writes the checkpoint and batches the others use
    results = {}
    with tempfile.TemporaryDirectory(prefix="update_step_gpu_") as tmp:
        for name in parts:
            results[name] = run_part(name, args, Path(tmp))
    summary = summarise(args, results)
    print_table(args, summary, results)
    config = repo_relative_args({k: v for k, v in vars(args).items() if not k.startswith("_")})
    failed = {name: r["error"] for name, r in results.items() if "error" in r}
    write_json(out, {"config": config, "summary": summary, "parts": results, "failed_parts": sorted(failed),
                     "machine": platform.machine(), "cpus": os.cpu_count()}, __file__)
    if failed:  # what was measured is kept (above); the run as a whole failed
        print(f"error: {len(failed)} part(s) failed ({'; '.join(failed.values())}; their output is above): {out} "
              f"holds the other parts' results and {{\"error\": ...}} for these", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
