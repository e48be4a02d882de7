"""What keeping the prepared batch on the device buys a learner step (issue 23 item 2), in one run.

    .venv/bin/python benchmarks/learner_transfers.py [--repeats N] [--packing both|on|off]

`Learner.step` (the prepared batch stays on the device, each minibatch gathered there, the step's metrics
fetched once) against the host round trip it replaced, kept here as the reference: `prepare`'s batch
pulled to the host, each minibatch cut, packed and uploaded from there, each update's statistics fetched
before the next update is dispatched. Both use the same jitted prepare and update programs, on two learners
from the same weights stepping on the same batches (the demo config and batch shape of `benchmarks/packing.py`,
a new batch every step), interleaved so background load hits both alike; the first step compiles and is
not timed. Both must end at the same policy bit for bit and log the same metrics, or the script fails.
Writes benchmarks/results/learner_transfers.json.
"""

from __future__ import annotations

import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_mismatch import precision  # noqa: E402
from jaxrl_mismatch.metrics import StatsAccumulator  # noqa: E402
from jaxrl_mismatch.models import Transformer, save_hf  # noqa: E402
from jaxrl_mismatch.train import distributed  # noqa: E402
from jaxrl_mismatch.train.minibatches import minibatch_order  # noqa: E402
from jaxrl_mismatch.train.packing import pack_batch  # noqa: E402
from jaxrl_mismatch.train.step import jit_update, place_batch  # noqa: E402
from _args import ArgumentParser, description, positive_int  # noqa: E402
from _paths import check_out, write_json  # noqa: E402
from packing import DEMO_MODEL, SHAPES, learner_for, make_batch  # noqa: E402


def host_round_trip_step(learner, host, seed: int) -> dict[str, float]:
    """The step as it was before: the prepared batch to the host and back per minibatch, a sync per update."""
    out, metrics = learner._prepare_on_device(host, seed)
    batch = jax.tree.map(distributed.to_host, out)
    record = {k: float(v) for k, v in metrics.items()}
    cfg, acc = learner.cfg, StatsAccumulator()
    for epoch in range(cfg.ppo_epochs):
        order = minibatch_order(seed, epoch, batch.num_rows, cfg.minibatches)
        for m in range(cfg.minibatches):
            mb = batch.rows(order[m * learner.minibatch_rows:(m + 1) * learner.minibatch_rows])
            if cfg.packing:
                mb = pack_batch(mb, num_groups=cfg.microbatches, shards=learner._batch_shards, microbatches=True)
            mb = place_batch(mb, learner.mesh)
            if learner._update is None:
                learner._update = jit_update(learner._update_fn, learner.state, mb, learner.mesh)
            learner.state, stats = learner._update(learner.state, mb)
            acc.add(stats)
    return {**record, **acc.result()}


def run(packing: bool, repeats: int, work: Path) -> dict:
    shape = SHAPES["demo"]
    ckpt = work / "ckpt"
    if not ckpt.exists():
        save_hf(Transformer(DEMO_MODEL, precision.policy("fp32"), rngs=nnx.Rngs(0)), DEMO_MODEL, ckpt)
    learners = {k: learner_for(ckpt, work / f"run_{k}_{packing}", shape, packing) for k in ("round_trip", "device")}
    steps = {"round_trip": lambda h, i: host_round_trip_step(learners["round_trip"], h, i),
             "device": lambda h, i: learners["device"].step(h, seed=i, minibatch_seed=i)}
    times: dict[str, list[float]] = {k: [] for k in learners}
    for i in range(repeats + 1):
        host = make_batch(shape, DEMO_MODEL.vocab_size, seed=i)
        first, _ = learners["device"].prepare(host, seed=i)  # μ = π(θ_old) + noise, as in benchmarks/packing.py
        noise = np.random.default_rng(i).normal(scale=0.05, size=host.response_mask.shape).astype(np.float32)
        host = host.replace(rollout_logp=(np.asarray(first.old_logp) + noise) * host.response_mask)
        records = {}
        for k in (("round_trip", "device") if i % 2 == 0 else ("device", "round_trip")):
            t0 = time.perf_counter()
            records[k] = steps[k](host, i)
            if i:
                times[k].append(time.perf_counter() - t0)
        a, b = records["round_trip"], records["device"]
        if a.keys() != b.keys() or any(a[k] != b[k] and not (np.isnan(a[k]) and np.isnan(b[k])) for k in a):
            raise SystemExit(f"packing={packing}: step {i}'s metrics differ between the two paths")
    params = [jax.tree.leaves(learners[k].state.params) for k in ("round_trip", "device")]
    for x, y in zip(*params):
        if not np.array_equal(np.asarray(x), np.asarray(y)):
            raise SystemExit(f"packing={packing}: the two paths ended at different policies")
    step = {k: {"median_s": statistics.median(t), "total_s": sum(t), "times_s": t} for k, t in times.items()}
    return {"packing": packing, "step": step,
            "speedup_median": step["round_trip"]["median_s"] / step["device"]["median_s"],
            "speedup_total": step["round_trip"]["total_s"] / step["device"]["total_s"]}


def main() -> int:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--repeats", type=positive_int, default=10, help="timed steps per path after one compiling step")
    ap.add_argument("--packing", choices=("both", "on", "off"), default="both")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "learner_transfers.json"))
    a = ap.parse_args()
    check_out("--out", a.out, __file__)
    modes = {"both": (True, False), "on": (True,), "off": (False,)}[a.packing]
    results = []
    with tempfile.TemporaryDirectory() as d:
        for packing in modes:
            results.append(run(packing, a.repeats, Path(d)))
    print(f"\n{'packing':<8} {'round trip (median)':>20} {'device':>8} {'speed-up':>9} {'all steps':>10} {'device':>8} "
          f"{'speed-up':>9}")
    for r in results:
        rt, dv = r["step"]["round_trip"], r["step"]["device"]
        print(f"{'on' if r['packing'] else 'off':<8} {rt['median_s']:>19.3f}s {dv['median_s']:>7.3f}s "
              f"{r['speedup_median']:>8.2f}x {rt['total_s']:>9.1f}s {dv['total_s']:>7.1f}s {r['speedup_total']:>8.2f}x")
    out = {"device": jax.devices()[0].device_kind, "devices": jax.device_count(), "platform": platform.platform(),
           "config": "configs/tiny_cpu.py (4 minibatches x 2 microbatches, fp32), demo batch [256, ~129]",
           "repeats": a.repeats, "results": results}
    write_json(a.out, out, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
