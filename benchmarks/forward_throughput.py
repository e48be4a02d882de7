"""Log-prob forward throughput: our jitted chunked `token_logprobs` vs transformers PyTorch, same weights.

    .venv/bin/python benchmarks/forward_throughput.py [--batch 2] [--seq 512] [--iters 5]

One random Llama-architecture checkpoint (4 layers, d=256, vocab 32k by default) is written by
transformers `save_pretrained` and loaded by both sides, so both run the same weights in float32.
Each side computes per-token log π(y_t) for a full batch:
- jax: `jax.jit(token_logprobs)` (LM head + log-softmax in sequence chunks), after one warm-up call
  that pays the compilation;
- torch: `model(ids, attention_mask, position_ids).logits` → `log_softmax` → `gather`, under
  `torch.inference_mode()` with transformers' default (sdpa) attention.
Both also agree on the values (max |Δ logp| is reported). The median of `--iters` timed calls gives
tokens/s = batch·seq / median. CPU numbers are sensitive to other load on the machine; the 1-minute
load average at start is recorded. Writes benchmarks/results/forward_throughput.json.
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

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from benchmarks._args import ArgumentParser, check_fits, description, positive_int  # noqa: E402
from benchmarks._paths import check_out, write_json  # noqa: E402
from jaxrl_mismatch.models import load_hf, positions_from_mask, token_logprobs  # noqa: E402
from jaxrl_mismatch.precision import policy  # noqa: E402

MODEL = dict(
    vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, rope_theta=500000.0, tie_word_embeddings=False,
)


def _time(fn, iters: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    fn()  # warm-up (jit compilation / torch allocator)
    warmup = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return warmup, times


def main() -> None:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--batch", type=positive_int, default=2)
    ap.add_argument("--seq", type=positive_int, default=512)
    ap.add_argument("--iters", type=positive_int, default=5)
    ap.add_argument("--chunk-size", type=positive_int, default=128)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/forward_throughput.json"))
    args = ap.parse_args()
    check_fits(ap, "--batch × --seq", 4 * args.batch * args.seq * MODEL["vocab_size"],
               f"the transformers side's float32 logits over the {MODEL['vocab_size']}-token vocabulary")
    check_out("--out", args.out, __file__)

    load_avg = os.getloadavg()[0]
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**MODEL)).float().eval()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL["vocab_size"], (args.batch, args.seq + 1)).astype(np.int32)
    mask = np.ones_like(tokens)

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        _, model = load_hf(d, policy=policy("fp32"))
    graphdef, state = nnx.split(model)

    @jax.jit
    def jax_logprobs(state, ids, targets, m):
        return token_logprobs(nnx.merge(graphdef, state), ids, targets, m, chunk_size=args.chunk_size)[0]

    jargs = tuple(jax.device_put(x) for x in (tokens[:, :-1], tokens[:, 1:], mask[:, :-1]))
    jax_out = {}

    def run_jax():
        jax_out["logp"] = jax_logprobs(state, *jargs).block_until_ready()

    t_ids, t_mask = torch.from_numpy(tokens[:, :-1]).long(), torch.from_numpy(mask[:, :-1]).long()
    t_pos = torch.from_numpy(np.array(positions_from_mask(mask[:, :-1]))).long()
    t_targets = torch.from_numpy(tokens[:, 1:]).long()
    torch_out = {}

    def run_torch():
        with torch.inference_mode():
            logits = hf(input_ids=t_ids, attention_mask=t_mask, position_ids=t_pos).logits
            torch_out["logp"] = torch.log_softmax(logits.float(), -1).gather(-1, t_targets[..., None])[..., 0]

    n_tokens = args.batch * args.seq
    results = {}
    for name, fn in [("jax (jit, chunked)", run_jax), ("torch (transformers)", run_torch)]:
        warmup, times = _time(fn, args.iters)
        med = statistics.median(times)
        results[name] = {"warmup_s": warmup, "median_s": med, "times_s": times, "tokens_per_s": n_tokens / med}
    max_diff = float(np.abs(np.asarray(jax_out["logp"]) - torch_out["logp"].numpy()).max())
    jax_tps = results["jax (jit, chunked)"]["tokens_per_s"]
    torch_tps = results["torch (transformers)"]["tokens_per_s"]

    print(f"\nforward log-prob throughput, fp32, batch {args.batch} x seq {args.seq}, "
          f"{MODEL['num_hidden_layers']} layers d={MODEL['hidden_size']} vocab {MODEL['vocab_size']}")
    print(f"{'engine':<24}{'median s':>10}{'tokens/s':>12}{'warm-up s':>11}")
    for name, r in results.items():
        print(f"{name:<24}{r['median_s']:>10.3f}{r['tokens_per_s']:>12.0f}{r['warmup_s']:>11.2f}")
    print(f"ratio jax/torch: {jax_tps / torch_tps:.2f}x   max |Δ logp| = {max_diff:.2e}   "
          f"load avg at start {load_avg:.1f} on {os.cpu_count()} CPUs")

    out = {
        "model": MODEL,
        "batch": args.batch,
        "seq": args.seq,
        "chunk_size": args.chunk_size,
        "dtype": "float32",
        "results": results,
        "ratio_jax_over_torch": jax_tps / torch_tps,
        "max_abs_logp_diff": max_diff,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg_1min_at_start": load_avg,
        "jax_backend": jax.default_backend(),
        "torch_threads": torch.get_num_threads(),
        "versions": {"jax": jax.__version__, "torch": torch.__version__},
    }
    write_json(args.out, out, __file__)


if __name__ == "__main__":
    main()
