"""Warm start of the CPU demo policy: a tiny Qwen3-style model trained by SFT on the arithmetic task.

Why a warm start: RL from a random network gets zero reward and no gradient signal; the papers start
from a pretrained model that already solves part of the problems. Here a few minutes of supervised
training on scratchpad solutions play that role — deliberately *short*, so the policy gets the
format right but the arithmetic only partly (greedy accuracy in the tens of percent), leaving RL
clear headroom to show.

``jaxrl-mismatch warmstart --out DIR`` writes a self-contained HF checkpoint directory:
``config.json`` + ``model.safetensors`` (``models.hf_io.save_hf``), ``tokenizer.json`` +
``tokenizer_config.json`` + ``special_tokens_map.json``, ``generation_config.json``, and
``task.json`` (the arithmetic spec the policy was trained on, so RL and evaluation draw prompts from
the same distribution) plus ``warmstart.json`` (measured loss, accuracies, timings). transformers,
vLLM and ``models.hf_io.load_hf`` load it. ``--out`` must be new, empty or an earlier warm start
(replaced only with ``--force``), checked with every other flag before any training; the directory is
written under a temporary sibling name and renamed at the end (``outputs.staged_dir``), so a killed or
failed run never leaves a half-written checkpoint or a temporary behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

from jaxrl_mismatch.data import arithmetic
from jaxrl_mismatch.outputs import check_out_dir, staged_dir
from jaxrl_mismatch.usage import INT32_MAX, ArgumentParser, UsageError, check_seed, physical_memory_bytes

# JAX, flax, optax and the model code are imported by the functions that use them: `--help` and a refused flag
# import none of them (~2.5 s of imports before a one-line error), as `jobs/_inputs.py` promises for every job.
if TYPE_CHECKING:
    from jaxtyping import Array, Float, Int

    from jaxrl_mismatch.data.tokenizer import TextTokenizer
    from jaxrl_mismatch.models import ModelConfig, Transformer


def tiny_config(vocab_size: int, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, max_len: int) -> ModelConfig:
    """A Qwen3-architecture config (GQA, q/k RMSNorm, untied LM head) sized for a 2-core CPU.

    Untied embeddings: vLLM's CPU backend keeps a stale pre-packed LM head after in-place weight
    updates of *tied* models (oneDNN pre-packs the head; ``rollout/vllm_engine.py: _retie_cpu_lm_head``
    and the tied case of ``tests/rollout/test_vllm_engine.py``), and at this size the extra [D, V]
    matrix costs nothing.
    """
    from jaxrl_mismatch.models.config import ModelConfig

    if hidden % heads:
        raise ValueError(f"--hidden {hidden} is not divisible by --heads {heads}")
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=-(-vocab_size // 8) * 8,  # pad to a multiple of 8; the tokenizer check allows a larger model
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=True,
        max_position_embeddings=max_len,
    )


def sft_loss(
    model: Transformer,
    tokens: Int[Array, "batch seq_plus_1"],
    attention_mask: Int[Array, "batch seq_plus_1"],
    response_mask: Float[Array, "batch seq"],
) -> Float[Array, ""]:
    """Mean negative log-likelihood of the response tokens (answer + EOS) given the prompt.

    Alignment is the batching contract: ``logp[:, t]`` scores ``tokens[:, t+1]``, and
    ``response_mask[:, t]`` is 1 exactly there, so prompt tokens and padding carry no loss.
    """
    import jax.numpy as jnp

    from jaxrl_mismatch.models import token_logprobs

    logp, _ = token_logprobs(model, tokens[:, :-1], tokens[:, 1:], attention_mask[:, :-1], chunk_size=64)
    return -jnp.sum(logp * response_mask) / jnp.maximum(jnp.sum(response_mask), 1.0)


def shortcut_targets(tok: TextTokenizer, problems: list[arithmetic.Problem], targets: list[list[int]], prob: float,
                     seed: int) -> list[list[int]]:
    """`targets` with a `prob` share (chosen by `seed`) replaced by the bare answer "#<answer><eos>"."""
    short = np.random.default_rng([seed, 1]).random(len(problems)) < prob
    return [tok.encode(f"#{p.answer}", add_special_tokens=False) + [tok.eos_id] if s else t
            for p, t, s in zip(problems, targets, short)]


def make_train_step(graphdef, optimizer):
    """Jitted pure step ``(params, opt_state, batch arrays) -> (params, opt_state, loss, grad_norm)``."""
    import jax
    import optax
    from flax import nnx

    @jax.jit
    def step(params, opt_state, tokens, attention_mask, response_mask):
        def loss_fn(p):
            return sft_loss(nnx.merge(graphdef, p), tokens, attention_mask, response_mask)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    return step


def make_generate(graphdef, cfg: ModelConfig, *, max_new_tokens: int, eos_id: int, pad_id: int):
    """Jitted KV-cache decoding of left-padded prompts (``kv_cache.decode_loop``): greedy when ``temperature == 0``
    else sampling.

    Returns ``tokens [B, max_new_tokens]``; positions after a row's EOS hold ``pad_id``.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_mismatch.models import decode_loop, init_cache, prefill

    @jax.jit
    def generate(params, prompt_ids, prompt_mask, key, temperature):
        model = nnx.merge(graphdef, params)
        b, p = prompt_ids.shape
        cache = init_cache(cfg, b, p + max_new_tokens, jnp.float32)
        logits, cache = prefill(model, prompt_ids, prompt_mask, cache)
        keys = jax.random.split(key, max_new_tokens)

        def pick(t, logits):
            logits = logits.astype(jnp.float32)
            greedy = jnp.argmax(logits, axis=-1)
            sampled = jax.random.categorical(keys[t], logits / jnp.maximum(temperature, 1e-6), axis=-1)
            return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32), {}

        tokens, _, _, _ = decode_loop(model, logits, cache, pick, new_len=max_new_tokens, max_tokens=max_new_tokens,
                                      stop_ids=jnp.asarray([eos_id], jnp.int32), pad_id=pad_id)
        return tokens

    return generate


def evaluate(generate, params, tok: TextTokenizer, problems: list[arithmetic.Problem], *, temperature: float, seed: int, batch: int = 128) -> dict:
    """Accuracy (exact final answer), well-formed fraction and mean response length on ``problems``."""
    import jax
    import jax.numpy as jnp

    from jaxrl_mismatch.models import left_pad

    correct, formed, lengths = 0, 0, []
    key = jax.random.PRNGKey(seed)
    batch = min(batch, len(problems))
    for start in range(0, len(problems), batch):
        chunk = problems[start : start + batch]
        rows = [tok.encode(p.prompt) for p in chunk]
        rows += [rows[0]] * (batch - len(rows))  # fixed shape: one compilation
        ids, mask = left_pad(rows, tok.pad_id)
        key, sub = jax.random.split(key)
        out = np.asarray(generate(params, ids, mask, sub, jnp.float32(temperature)))
        for p, row in zip(chunk, out):
            row = row.tolist()
            n = row.index(tok.eos_id) + 1 if tok.eos_id in row else len(row)
            text = tok.decode(row[:n])
            lengths.append(n)
            correct += arithmetic.reward(text, p.answer) == 1.0
            formed += arithmetic.is_well_formed(text)
    n = max(len(problems), 1)
    return {"accuracy": correct / n, "well_formed": formed / n, "mean_response_tokens": float(np.mean(lengths))}


def write_generation_config(tok: TextTokenizer, out_dir: str, max_new_tokens: int) -> None:
    cfg = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id, "max_new_tokens": max_new_tokens}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


# Counts and sizes at most INT32_MAX: step counts reach optax's int32 step counter, --max-len the int32 positions
# (and a config.json that `serve` answers GetInfo with), sizes the arrays' dimensions; none is near it in use.
_INT32_FLAGS = ("steps", "batch_size", "num_train", "layers", "hidden", "heads", "kv_heads", "intermediate",
                "max_len", "min_operands", "max_operands", "max_value", "log_every")
SFT_MAX_TOKENS = 4096  # the longest SFT row (prompt + response, less one): the last of the step's length buckets
_SFT_BUCKETS = range(16, SFT_MAX_TOKENS + 1, 16)


def min_positions(operands: int) -> int:
    """The fewest positions (tokens) a problem of `operands` operands takes as an SFT example: `<bos>`, the operands,
    operators and "=" (2k + 1), the scratchpad's k - 1 steps of k - 1, ..., 1 operands joined by "=" ((k - 1)^2
    + k - 2), "#", the answer and `<eos>` (3) — with one-digit numbers everywhere: k^2 + k + 3."""
    return operands * operands + operands + 3


# Flags whose size the memory estimate depends on: the one whose default would shrink it most is named.
_SIZE_FLAGS = ("batch_size", "intermediate", "hidden", "layers", "kv_heads", "num_train")


def memory_estimate(args: argparse.Namespace) -> dict[str, int]:
    """A lower bound of the bytes the warm start holds at once, by part: the float32 model, gradients and AdamW
    moments (16 bytes a parameter; the embeddings left out), one step's activations kept for the backward pass
    (per layer and token at least the attention input and output and the MLP's three [intermediate] tensors,
    float32) and the padded training rows (the plain and the shortcut copy, three int32/float32 arrays each), both
    at the shortest length bucket (16 tokens)."""
    d, inter, layers, heads, kv = args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads
    per_layer = 2 * d * d + 2 * d * kv * (d // heads) + 3 * d * inter  # q, o; k, v; gate, up, down
    tokens = 16
    return {"model and optimizer state": 16 * layers * per_layer,
            "activations": 4 * args.batch_size * tokens * layers * (2 * d + 3 * inter),
            "training rows": 2 * 3 * 4 * args.num_train * (tokens + 1)}


def check_memory(args: argparse.Namespace, defaults: dict[str, int], available: int | None = None) -> None:
    """UsageError naming the size flag at fault (the one whose default in `defaults` would shrink the estimate
    most) when even `memory_estimate`'s lower bound exceeds this machine's memory (`available`, default: its
    physical memory): such a warm start failed with a MemoryError or XLA's RESOURCE_EXHAUSTED (exit 1) after
    its problems were generated."""
    available = physical_memory_bytes() if available is None else available
    parts = memory_estimate(args)
    total = sum(parts.values())
    if available is None or total <= available:
        return

    def shrunk(name: str) -> int:
        return sum(memory_estimate(argparse.Namespace(**{**vars(args), name: defaults[name]})).values())

    culprit = min(_SIZE_FLAGS, key=shrunk)
    flag = f"--{culprit.replace('_', '-')}"
    gib = 1 << 30
    detail = ", ".join(f"{k} {v / gib:.3g}" for k, v in parts.items() if v)
    raise UsageError(f"{flag} {getattr(args, culprit)}: the warm start needs at least {total / gib:.3g} GiB of memory "
                     f"({detail} GiB), more than this machine's {available / gib:.3g} GiB; lower {flag}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ArgumentParser(prog="jaxrl-mismatch warmstart", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write (HF format)")
    ap.add_argument("--force", action="store_true", help="replace --out if it holds an earlier warm start (never other files)")
    ap.add_argument("--steps", type=int, default=700, help="SFT steps (fewer: weaker policy, more RL headroom)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (cosine decay, 5%% warmup)")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--max-len", type=int, default=128, help="max_position_embeddings of the model (at most 2^31 - 1)")
    ap.add_argument("--min-operands", type=int, default=3)
    ap.add_argument("--max-operands", type=int, default=5)
    ap.add_argument("--max-value", type=int, default=9)
    ap.add_argument("--mul-prob", type=float, default=0.3)
    ap.add_argument("--num-train", type=int, default=20000, help="distinct training problems")
    ap.add_argument("--num-eval", type=int, default=256, help="validation problems for the final accuracy")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--shortcut-prob", type=float, default=0.0,
                    help="fraction of SFT targets that give the answer without the scratchpad (length-growth task)")
    ap.add_argument("--shortcut-steps", type=int, default=None,
                    help="apply --shortcut-prob only in the last N steps (default: all steps)")
    args = ap.parse_args(argv)
    for name in ("steps", "batch_size", "num_train", "layers", "hidden", "heads", "kv_heads", "intermediate",
                 "max_len", "min_operands", "max_operands", "max_value", "log_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in (*_INT32_FLAGS, "num_eval", "shortcut_steps"):
        if getattr(args, name) is not None and getattr(args, name) > INT32_MAX:
            raise UsageError(f"--{name.replace('_', '-')} must be <= 2^31 - 1 ({INT32_MAX}), got {getattr(args, name)}")
    if args.shortcut_steps is not None and not 0 <= args.shortcut_steps <= args.steps:
        raise UsageError(f"--shortcut-steps must be in [0, --steps], got {args.shortcut_steps}")
    if args.shortcut_steps is not None and args.shortcut_prob == 0.0:  # it was accepted and changed nothing
        raise UsageError("--shortcut-steps: it limits --shortcut-prob to the last steps, but --shortcut-prob is 0 "
                         "(no shortcut targets); give --shortcut-prob too, or leave --shortcut-steps out")
    if not 0.0 <= args.shortcut_prob <= 1.0:
        raise UsageError(f"--shortcut-prob must be in [0, 1], got {args.shortcut_prob}")
    check_seed("--seed", args.seed)
    if args.num_eval < 0:
        raise UsageError(f"--num-eval must be >= 0, got {args.num_eval}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a number > 0, got {args.lr}")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise UsageError(f"--weight-decay must be a number >= 0, got {args.weight_decay}")
    if not 0.0 <= args.mul_prob <= 1.0:
        raise UsageError(f"--mul-prob must be in [0, 1], got {args.mul_prob}")
    if args.hidden % args.heads:
        raise UsageError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.heads % args.kv_heads:
        raise UsageError(f"--heads {args.heads} is not divisible by --kv-heads {args.kv_heads}")
    if (args.hidden // args.heads) % 2:
        raise UsageError(f"--hidden / --heads = {args.hidden // args.heads} must be even (rotary embeddings)")
    if not 2 <= args.min_operands <= args.max_operands:
        raise UsageError(f"need 2 <= --min-operands <= --max-operands, got {args.min_operands}, {args.max_operands}")
    try:
        args.spec = arithmetic.ArithmeticSpec(min_operands=args.min_operands, max_operands=args.max_operands,
                                              max_value=args.max_value, mul_prob=args.mul_prob)
    except ValueError as e:
        raise UsageError(f"{e}") from None
    need = min_positions(args.max_operands)  # before any problem is drawn (a large count drew for hours)
    if need + 8 > args.max_len:
        raise UsageError(f"--max-operands {args.max_operands}: a problem of {args.max_operands} operands takes at "
                         f"least {need} positions (prompt and scratchpad; the warm start keeps 8 more), over "
                         f"--max-len {args.max_len}")
    if need - 1 > SFT_MAX_TOKENS:
        raise UsageError(f"--max-operands {args.max_operands}: a problem of {args.max_operands} operands takes at "
                         f"least {need} positions (prompt and scratchpad), over the {SFT_MAX_TOKENS} tokens a "
                         "warm-start example may have")
    check_memory(args, {name: ap.get_default(name) for name in _SIZE_FLAGS})
    check_out_dir("--out", args.out, "warmstart", force=args.force)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    import jax
    import optax
    from flax import nnx

    from jaxrl_mismatch import precision
    from jaxrl_mismatch.data.batching import bucket_length, pad_rows
    from jaxrl_mismatch.data.tokenizer import build_arithmetic_tokenizer, save_tokenizer
    from jaxrl_mismatch.models import Transformer, hf_io

    spec = args.spec
    t0 = time.perf_counter()
    tok = build_arithmetic_tokenizer()
    try:
        train = arithmetic.generate(spec, "train", args.num_train, seed=args.seed)
        val = arithmetic.generate(spec, "validation", args.num_eval, seed=args.seed) if args.num_eval else []
    except ValueError as e:  # the spec cannot yield that many distinct problems: the flags ask too much
        raise UsageError(f"--num-train/--num-eval: {e}") from None
    prompts = [tok.encode(p.prompt) for p in train]
    answers = [tok.encode(p.response, add_special_tokens=False) + [tok.eos_id] for p in train]
    longest = max(len(p) + len(a) for p, a in zip(prompts, answers))
    max_new = max(len(a) for a in answers) + 8  # room for a policy that writes a little more than the data
    # The context must hold a problem with room to spare, and the longest prompt followed by the `max_new` tokens a
    # rollout may write (task.json's max_new_tokens): they can come from different problems.
    need = max(longest + 8, max(len(p) for p in prompts) + max_new)
    if need > args.max_len:
        raise UsageError(f"problems need {need} positions > --max-len {args.max_len}")
    if longest - 1 > SFT_MAX_TOKENS:
        raise UsageError(f"--max-operands/--max-value: the longest problem takes {longest} positions, over the "
                         f"{SFT_MAX_TOKENS} tokens a warm-start example may have")
    # One fixed target length T (a multiple of 16) for every batch: the step compiles once.
    buckets = (bucket_length(longest - 1, _SFT_BUCKETS),)
    data = pad_rows(prompts, answers, pad_id=tok.pad_id, buckets=buckets)
    # The last --shortcut-steps train on a mixture where a --shortcut-prob share of targets skip the
    # scratchpad ("#answer"): the policy keeps the skill of writing the steps but mostly answers at once —
    # usually wrongly on long problems. RL then finds that writing the steps pays, so responses grow during
    # training (the behaviour the LR paper's length-triggered decay watches for).
    mixed = pad_rows(prompts, shortcut_targets(tok, train, answers, args.shortcut_prob, args.seed), pad_id=tok.pad_id,
                     buckets=buckets)
    shortcut_from = args.steps - (args.steps if args.shortcut_steps is None else args.shortcut_steps)

    cfg = tiny_config(tok.vocab_size, layers=args.layers, hidden=args.hidden, heads=args.heads,
                      kv_heads=args.kv_heads, intermediate=args.intermediate, max_len=args.max_len)
    tok.check_model_vocab(cfg.vocab_size)
    model = Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    warmup = max(1, args.steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(  # decay_steps includes the warm-up: > it even for --steps 1
        0.0, args.lr, warmup_steps=warmup, decay_steps=max(args.steps, warmup + 1), end_value=args.lr * 0.05
    )
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=args.weight_decay))
    opt_state = optimizer.init(params)
    step = make_train_step(graphdef, optimizer)
    print(f"warmstart: {n_params:,} parameters, {len(train)} train problems ({spec}), "
          f"T={data.response_mask.shape[1]}, {args.steps} steps x {args.batch_size}", flush=True)

    rng = np.random.default_rng(args.seed)
    t_train, cpu_train = time.perf_counter(), time.process_time()
    loss_hist = []
    for i in range(1, args.steps + 1):
        idx = rng.integers(0, len(train), size=args.batch_size)
        d = mixed if i > shortcut_from else data
        params, opt_state, loss, gnorm = step(params, opt_state, d.tokens[idx], d.attention_mask[idx], d.response_mask[idx])
        if i % args.log_every == 0 or i == args.steps:
            loss_hist.append((i, float(loss)))
            print(f"  step {i:5d}  loss {float(loss):.4f}  grad_norm {float(gnorm):.3f}  "
                  f"{time.perf_counter() - t_train:6.1f}s", flush=True)
    train_s, train_cpu_s = time.perf_counter() - t_train, time.process_time() - cpu_train

    metrics: dict = {"steps": args.steps, "final_loss": loss_hist[-1][1], "loss": loss_hist, "train_seconds": train_s,
                     "train_cpu_seconds": train_cpu_s,  # wall time depends on what else runs; CPU time less so
                     "num_parameters": int(n_params)}
    if val:
        t_eval = time.perf_counter()
        generate = make_generate(graphdef, cfg, max_new_tokens=max_new, eos_id=tok.eos_id, pad_id=tok.pad_id)
        metrics["validation_greedy"] = evaluate(generate, params, tok, val, temperature=0.0, seed=args.seed)
        metrics["validation_sampled_t1"] = evaluate(generate, params, tok, val, temperature=1.0, seed=args.seed + 1)
        metrics["eval_seconds"] = time.perf_counter() - t_eval

    with staged_dir("--out", args.out, "warmstart", force=args.force) as tmp:
        # config.json carries the tokenizer's ids as generation_config.json does (transformers' AutoConfig read None)
        hf_io.save_hf(nnx.merge(graphdef, params), cfg, tmp, extra_config={
            "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id})
        save_tokenizer(tok, tmp, model_max_length=args.max_len)
        write_generation_config(tok, tmp, max_new)
        with open(os.path.join(tmp, arithmetic.TASK_FILE), "w") as f:
            json.dump({"task": "arithmetic", "spec": dataclasses.asdict(spec), "max_new_tokens": max_new,
                       "seed": args.seed, "shortcut_prob": args.shortcut_prob, "shortcut_steps": args.shortcut_steps},
                      f, indent=2)
        metrics["total_seconds"] = time.perf_counter() - t0
        with open(os.path.join(tmp, "warmstart.json"), "w") as f:
            json.dump(metrics, f, indent=2)

    if val:
        g, s = metrics["validation_greedy"], metrics["validation_sampled_t1"]
        print(f"warmstart: validation accuracy greedy {g['accuracy']:.1%} (well-formed {g['well_formed']:.1%}), "
              f"sampled T=1 {s['accuracy']:.1%}, mean response {g['mean_response_tokens']:.1f} tokens", flush=True)
    print(f"warmstart: wrote {args.out} in {metrics['total_seconds']:.1f}s "
          f"(training {train_s:.1f}s wall, {train_cpu_s:.1f}s CPU)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
