"""What `trainer.packing` buys a whole RL step: `Learner.step` (prepare + optimize), packed vs unpacked.

    .venv/bin/python benchmarks/packing.py [--shape demo|long|all] [--repeats N]     # all: ~12 min on 2 cores

The loop's own path (`train.learner.Learner.step`), with the demo config (`configs/tiny_cpu.py`: 4 minibatches ×
2 microbatches, token-TIS GRPO, fp32) on a random model of the demo policy's shape, twice in one process:
`trainer.packing = False` and `True`. One step = the θ_old forward of the whole batch + 4 AdamW updates
(forward + backward on each minibatch); with packing both run on packed rows (one group per device for
`prepare`, one per microbatch for the update; `train/packing.py`).

Shapes (RL batches are uneven: every row is padded to the batch's bucketed length):
- `demo`: the demo's batch, 32 prompts × 8 samples, prompt 25–35 tokens, responses 10–48 (`max_tokens`),
  uniform; bucketed by `data.batching.pad_rows` as the loop does.
- `long`: 4 prompts × 8 samples, prompt 128 tokens, responses 64–2048 uniform — the unevenness of
  long-response RL (the configs name up to 8,192) at a size a 2-core CPU steps through in about a minute.

The two learners start from the same weights and step on the same batches — a new batch every step, so
lengths and the packed row count change as in a run — interleaved (one packed step, one unpacked, …) so
background load hits both alike. The first step of each pays the compilations and is not timed; later
steps compile when a new packed shape comes (`pack_batch`'s row buckets bound how often), and those
compilations are counted and timed in "all steps". The first step (same θ) must give the same loss and
gradient norm (≤ 1e-4 relative), and both learners must end at the same policy (max |Δθ| ≤ 5 % of how
far θ moved: Adam's 1/√v magnifies rounding of near-zero gradients), or the script fails.
Reports the padding share before and after packing, the median step time, the total over all steps
(compilations included), the speed-ups and the extra compilations. Writes benchmarks/results/packing.json.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._args import ArgumentParser, description, positive_int  # noqa: E402
from benchmarks._paths import check_out, write_json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_mismatch import precision  # noqa: E402
from jaxrl_mismatch.jobs.warmstart import tiny_config  # noqa: E402
from jaxrl_mismatch.models import Transformer, save_hf  # noqa: E402
from jaxrl_mismatch.train.batch import from_completions  # noqa: E402
from jaxrl_mismatch.train.compiles import count_compilations  # noqa: E402
from jaxrl_mismatch.train.packing import pack_batch  # noqa: E402

# The demo policy's shape (the warm start's defaults), with room for the long shape's rows.
DEMO_MODEL = tiny_config(32, layers=2, hidden=128, heads=4, kv_heads=2, intermediate=384, max_len=2304)
SHAPES = {  # prompts, group size, prompt length [lo, hi], response length [lo, hi]
    "demo": dict(prompts=32, group=8, prompt=(25, 35), response=(10, 48)),
    "long": dict(prompts=4, group=8, prompt=(128, 128), response=(64, 2048)),
}
REPEATS = {"demo": 20, "long": 3}  # timed steps per learner: the long shape takes ~80 s a step here


def make_batch(shape: dict, vocab: int, seed: int):
    """A host RolloutBatch of the shape's lengths (random tokens, group-relative advantages)."""
    rng = np.random.default_rng(seed)
    rows = shape["prompts"] * shape["group"]
    prompt_len = rng.integers(shape["prompt"][0], shape["prompt"][1] + 1, shape["prompts"]).repeat(shape["group"])
    resp_len = rng.integers(shape["response"][0], shape["response"][1] + 1, rows)
    prompts = [rng.integers(1, vocab, n).tolist() for n in prompt_len]
    completions = [rng.integers(1, vocab, n).tolist() for n in resp_len]
    logp = [np.zeros(n, np.float32) for n in resp_len]  # replaced by log π(θ_old) + noise below
    adv = rng.normal(size=rows).astype(np.float32)
    return from_completions(prompts, completions, logp, adv, pad_id=0)


def learner_for(ckpt: Path, run_dir: Path, shape: dict, packing: bool):
    sys.path.insert(0, str(REPO / "configs"))
    from tiny_cpu import get_config

    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    c = get_config()
    c.model.path, c.run_dir = str(ckpt), str(run_dir)
    c.batch.prompts_per_step, c.rollout.group_size = shape["prompts"], shape["group"]
    c.trainer.packing = packing
    return Learner(learner_config(c))


def run_shape(name: str, shape: dict, repeats: int, work: Path) -> dict:
    cfg = DEMO_MODEL
    ckpt = work / "ckpt"
    if not ckpt.exists():
        save_hf(Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(0)), cfg, ckpt)
    learners = {k: learner_for(ckpt, work / f"run_{name}_{k}", shape, k == "packed") for k in ("unpacked", "packed")}
    theta0 = jax.tree.map(np.array, learners["unpacked"].state.params)

    batches = [make_batch(shape, cfg.vocab_size, seed=i) for i in range(repeats + 1)]  # new lengths every step
    shards, micro = learners["packed"]._batch_shards, learners["packed"].cfg.microbatches
    mb_rows = batches[0].num_rows // learners["packed"].cfg.minibatches
    padding: dict[str, list] = {"prepare (a group per device)": [], "update (a group per microbatch)": []}
    for b in batches:  # (real tokens, unpacked slots, packed rows x length) of each step's packing
        mb = b.rows(np.arange(mb_rows))
        for key, part, groups in (("prepare (a group per device)", b, shards),
                                  ("update (a group per microbatch)", mb, micro)):
            packed = pack_batch(part, num_groups=groups, shards=shards, microbatches=key.startswith("update")).packed
            padding[key].append((int(np.asarray(part.attention_mask).sum()), part.tokens.size, packed.tokens.shape))
    padding = {k: {"padding_unpacked": _mean(1 - real / slots for real, slots, _ in v),
                   "padding_packed": _mean(1 - real / (shp[0] * shp[1]) for real, _, shp in v),
                   "packed_rows": [shp[0] for _, _, shp in v]} for k, v in padding.items()}

    times: dict[str, list[float]] = {k: [] for k in learners}
    compiles = {k: 0 for k in learners}
    stats: list[dict[str, dict]] = []  # per step, per learner
    for i, host in enumerate(batches):
        # A rollout whose μ is π(θ_old) plus a little noise.
        first, _ = learners["unpacked"].prepare(host, seed=i)
        noise = np.random.default_rng(i).normal(scale=0.05, size=host.response_mask.shape).astype(np.float32)
        host = host.replace(rollout_logp=(np.asarray(first.old_logp) + noise) * host.response_mask)
        stats.append({})
        for k in (("unpacked", "packed") if i % 2 == 0 else ("packed", "unpacked")):
            with count_compilations("update") as cu, count_compilations("prepare") as cp:
                t0 = time.perf_counter()
                stats[i][k] = learners[k].step(host, seed=i, minibatch_seed=i)  # prepare + optimize
                dt = time.perf_counter() - t0
            if i:  # the first step compiles for certain; later ones when a new shape comes
                times[k].append(dt)
                compiles[k] += cu["compiles"] + cp["compiles"]
    # The first step starts from the same θ: the same loss and gradient norm up to float summation order.
    for key in ("loss/total", "grad/norm"):
        a, b = stats[0]["unpacked"][key], stats[0]["packed"][key]
        if not abs(a - b) <= 1e-4 * abs(a):
            raise SystemExit(f"{name}: first step's {key} differs packed vs unpacked: {b!r} vs {a!r}")
    moved = max(float(np.max(np.abs(a - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(theta0), jax.tree.leaves(learners["unpacked"].state.params)))
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(learners["unpacked"].state.params),
                               jax.tree.leaves(learners["packed"].state.params)))
    # Adam divides by √v, which blows rounding of near-zero gradient entries up to LR scale: a loose bound.
    if not (moved > 0 and diff <= 0.05 * moved):
        raise SystemExit(f"{name}: packed and unpacked learners diverged: max |Δθ| {diff:.3g} vs moved {moved:.3g}")
    step = {k: {"median_s": statistics.median(t), "min_s": min(t), "total_s": sum(t), "compiles": compiles[k],
                "times_s": t} for k, t in times.items()}
    return {
        "shape": {**shape, "batch": list(batches[0].tokens.shape)},
        "padding": padding,
        "step": step,
        "speedup_median": step["unpacked"]["median_s"] / step["packed"]["median_s"],
        "speedup_total": step["unpacked"]["total_s"] / step["packed"]["total_s"],
        "same_policy": {"max_abs_param_diff": diff, "max_abs_param_move": moved},
        "first_step": {k: {m: v[m] for m in ("loss/total", "grad/norm")} for k, v in stats[0].items()},
    }


def _mean(xs) -> float:
    return float(statistics.mean(list(xs)))


def print_table(results: dict) -> None:
    print(f"\n{'shape':<6} {'batch':>10} {'padding':>8} {'packed: prepare':>16} {'update':>7} "
          f"{'step (median)':>14} {'packed':>8} {'speed-up':>9} {'all steps':>10} {'packed':>8} {'speed-up':>9} "
          f"{'compiles':>9}")
    for name, r in results.items():
        pp, pu = r["padding"]["prepare (a group per device)"], r["padding"]["update (a group per microbatch)"]
        su, sp = r["step"]["unpacked"], r["step"]["packed"]
        print(f"{name:<6} {'x'.join(map(str, r['shape']['batch'])):>10} {pp['padding_unpacked']:>8.1%} "
              f"{pp['padding_packed']:>16.1%} {pu['padding_packed']:>7.1%} {su['median_s']:>13.3f}s "
              f"{sp['median_s']:>7.3f}s {r['speedup_median']:>8.2f}x {su['total_s']:>9.1f}s {sp['total_s']:>7.1f}s "
              f"{r['speedup_total']:>8.2f}x {su['compiles']:>4}/{sp['compiles']:<4}")


def main() -> int:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--shape", choices=(*SHAPES, "all"), default="all")
    ap.add_argument("--repeats", type=positive_int, default=None,
                    help=f"timed steps per learner after one compiling step (default {REPEATS})")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "packing.json"))
    a = ap.parse_args()
    check_out("--out", a.out, __file__)
    names = tuple(SHAPES) if a.shape == "all" else (a.shape,)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            results[name] = run_shape(name, SHAPES[name], a.repeats or REPEATS[name], Path(d))
            print_table({name: results[name]})
    print_table(results)
    out = {"device": jax.devices()[0].device_kind, "devices": jax.device_count(), "platform": platform.platform(),
           "model": dataclasses.asdict(DEMO_MODEL),
           "config": "configs/tiny_cpu.py (4 minibatches x 2 microbatches, fp32)",
           "repeats": {n: a.repeats or REPEATS[n] for n in names}, "results": results}
    write_json(a.out, out, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
