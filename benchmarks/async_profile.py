"""Where the trainer's time goes, synchronous vs asynchronous rollouts: per-phase wall and CPU time of the
trainer process and the CPU each of its threads used, per timed step, on the demo config.

    .venv/bin/python benchmarks/async_profile.py [--staleness 0 1] [--steps 20] [--model runs/tiny_cpu_base]

Each mode runs the real `Trainer` in this process (pinned to core 0 with `taskset -c 0` by this script, which
re-executes itself; the managed rollout server pinned to core 1, every thread, as `async_rollouts.py` does),
with the loop's and the rollout path's functions wrapped in timers (`PHASES`: wall time, and the calling
thread's CPU time — `time.thread_time`, which does not see the XLA threads a jitted call runs on). Thread CPU
comes from /proc/self/task/*/stat over the timed steps: "xla" is XLA's executor and Eigen pool threads (the
jitted programs), the named Python threads are the loop (MainThread) and the producer (rollout-producer).

Why: `async_rollouts.py` shows the asynchronous trainer is the bottleneck and its step is longer than the
synchronous step's non-rollout half; this says by how much each phase (`prepare`'s π_behav forward
`behav_logp`, the producer's decode and batch building, the weight push, ...) and which thread is responsible.
Prints a table and writes benchmarks/results/async_profile.json (`--out`). Only the CPU columns mean much on
a loaded machine.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._args import ArgumentParser, check_model, description, positive_int, nonneg_int  # noqa: E402
from benchmarks._paths import check_out, repo_relative, write_json  # noqa: E402

# (module, attribute path, phase name): the functions timed.
PHASES = (
    ("jaxrl_mismatch.train.loop", "Trainer._push", "push (weights to the server)"),
    ("jaxrl_mismatch.train.learner", "Learner.hf_weights", "  hf_weights (device → host)"),
    ("jaxrl_mismatch.rollout.session", "RolloutSession.push", "  session.push (RPCs)"),
    ("jaxrl_mismatch.train.loop", "Trainer._take_rollout", "take (wait for a produced batch)"),
    ("jaxrl_mismatch.train.learner", "Learner.prepare", "prepare"),
    ("jaxrl_mismatch.train.behaviour", "BehaviourScorer.behav_logp", "  behav_logp (π_behav forward)"),
    ("jaxrl_mismatch.train.learner", "Learner.optimize", "optimize"),
    ("jaxrl_mismatch.train.loop", "Trainer._rollout", "rollout (a batch: generate, rewards, batch)"),
    ("jaxrl_mismatch.rollout.client", "RolloutClient.generate", "  client.generate (Generate RPCs + decode)"),
    ("jaxrl_mismatch.rollout.protocol", "completions_from_proto", "    decode"),
    ("jaxrl_mismatch.train.loop", "to_batch", "  to_batch (advantages, padding)"),
)


class Timers:
    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[float, float, str]]] = collections.defaultdict(list)
        self.on = False

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                if self.on:
                    self.calls[name].append((time.perf_counter() - t0, time.thread_time() - c0,
                                             threading.current_thread().name))
        return timed


def install(timers: Timers) -> None:
    import importlib

    for module, path, name in PHASES:
        owner = importlib.import_module(module)
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        setattr(owner, attr, timers.wrap(name, getattr(owner, attr)))


def thread_cpu() -> dict[int, tuple[str, float]]:
    """tid -> (comm, user + system CPU seconds) of this process's threads."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended
            continue
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


def pin_server(run_dir: Path, core: int, stop: threading.Event) -> None:
    ready = run_dir / "rollout_ready.json"
    while not stop.is_set():
        try:
            pid = json.loads(ready.read_text())["pid"]
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), {core})
        except (OSError, ValueError, KeyError):
            pass
        stop.wait(0.5)


def demo_config(model: str):
    """The demo config (`configs/tiny_cpu.py`) with `model.path` = `model`."""
    sys.path.insert(0, str(REPO / "configs"))
    from tiny_cpu import get_config

    c = get_config()
    c.model.path = str(model)
    return c


def profile(staleness: int, a, work: Path) -> dict:
    """One run of `a.steps` steps at `staleness`; the per-step phase and thread times of the timed steps."""
    from jaxrl_mismatch.train import loop
    from jaxrl_mismatch.train.config_checks import check_paths, validate

    run_dir = work / f"staleness_{staleness}"
    c = demo_config(a.model)
    c.run_dir, c.steps = str(run_dir), a.steps
    c.rollout.max_staleness = staleness
    c.eval.every = c.checkpoint.every = 0
    c.log.progress = c.log.report = c.log.tensorboard = False
    validate(c)
    check_paths(c)
    timers = Timers()
    install(timers)
    stop = threading.Event()
    threading.Thread(target=pin_server, args=(run_dir, 1, stop), daemon=True).start()
    trainer = loop.Trainer(c)
    marks: dict = {}
    step = trainer.train_step

    def timed_step():
        if trainer.step == a.warmup:  # the first steps compile
            timers.on, marks["t0"], marks["cpu0"] = True, time.perf_counter(), thread_cpu()
        metrics = step()
        if trainer.step == a.steps:
            timers.on, marks["t1"], marks["cpu1"] = False, time.perf_counter(), thread_cpu()
            marks["names"] = {t.native_id: t.name for t in threading.enumerate()}
        return metrics

    trainer.train_step = timed_step
    try:
        trainer.run()
    finally:
        trainer.close()
        stop.set()
    n = a.steps - a.warmup
    phases = {name: {"wall_s_per_step": sum(c[0] for c in calls) / n, "cpu_s_per_step": sum(c[1] for c in calls) / n,
                     "calls": len(calls), "threads": sorted({c[2] for c in calls})}
              for name, calls in timers.calls.items()}
    threads: collections.Counter = collections.Counter()
    for tid, (comm, cpu) in marks["cpu1"].items():
        name = marks["names"].get(tid)
        key = name if name is not None else "xla" if comm in ("tf_XLAEigen", "python") else comm
        threads[key] += cpu - marks["cpu0"].get(tid, (comm, 0.0))[1]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if a.warmup <= r["step"] < a.steps]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"max_staleness": staleness, "timed_steps": n, "steps_per_s": n / (marks["t1"] - marks["t0"]),
            "step_s_median": statistics.median(r["time/step_s"] for r in rows),
            "phases": phases, "thread_cpu_s_per_step": {k: v / n for k, v in threads.most_common() if v > 0}}


def table(results: dict) -> str:
    modes = list(results)
    lines = ["| phase (per timed step) | " + " | ".join(f"s={results[m]['max_staleness']} wall / CPU" for m in modes) + " |",
             "| --- |" + " --- |" * len(modes)]
    names = [name for _, _, name in PHASES]
    for name in names:
        cells = []
        for m in modes:
            p = results[m]["phases"].get(name)
            cells.append(f"{p['wall_s_per_step']:.3f} / {p['cpu_s_per_step']:.3f}" if p else "—")
        lines.append(f"| {name.strip()} | " + " | ".join(cells) + " |")
    keys = sorted({k for m in modes for k in results[m]["thread_cpu_s_per_step"]},
                  key=lambda k: -max(results[m]["thread_cpu_s_per_step"].get(k, 0.0) for m in modes))
    for k in keys:
        lines.append(f"| thread CPU: {k} | " + " | ".join(
            f"{results[m]['thread_cpu_s_per_step'].get(k, 0.0):.3f}" for m in modes) + " |")
    lines.append("| steps/s (wall) | " + " | ".join(f"{results[m]['steps_per_s']:.3f}" for m in modes) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--staleness", type=nonneg_int, nargs="+", default=[0, 1], help="modes to profile (0: synchronous)")
    ap.add_argument("--steps", type=positive_int, default=20)
    ap.add_argument("--warmup", type=nonneg_int, default=3)
    ap.add_argument("--model", default=str(REPO / "runs" / "tiny_cpu_base"),
                    help="the demo's warm-started policy (jaxrl-mismatch train --config configs/tiny_cpu.py writes it)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "async_profile.json"))
    ap.add_argument("--mode", type=nonneg_int, default=None, help=argparse.SUPPRESS)  # one mode, in a pinned child
    a = ap.parse_args()
    a.model = os.path.abspath(a.model)
    if a.mode is not None:  # the child: the parent checked every flag and --out, and writes the result
        import logging

        logging.basicConfig(level=logging.WARNING)
        with tempfile.TemporaryDirectory() as tmp:
            print("RESULT " + json.dumps(profile(a.mode, a, Path(tmp))), flush=True)
        return 0
    check_out("--out", a.out, __file__)
    if a.steps <= a.warmup:
        print(f"error: --steps: {a.steps} leaves no timed step after --warmup {a.warmup}", file=sys.stderr)
        return 2
    if any(s < 0 for s in a.staleness):
        print(f"error: --staleness: {a.staleness} has a negative value", file=sys.stderr)
        return 2
    if (os.cpu_count() or 1) < 2:
        print("error: trainer and server are pinned to cores 0 and 1; this machine has 1", file=sys.stderr)
        return 2
    # the demo's warm-started policy (`jaxrl-mismatch train --config configs/tiny_cpu.py` writes it), checked as
    # `train` checks it: a folder that is no usable model is one line here, not a failed child after minutes
    check_model("--model", a.model, demo_config(a.model), missing="run the demo's warm start (jaxrl-mismatch train "
                "--config configs/tiny_cpu.py writes runs/tiny_cpu_base) or pass --model")
    load_at_start, results = os.getloadavg(), {}
    for s in a.staleness:  # each mode in a fresh process: the wrappers, the XLA caches and threads are its own
        out = subprocess.run(["taskset", "-c", "0", sys.executable, __file__, "--mode", str(s), "--steps", str(a.steps),
                              "--warmup", str(a.warmup), "--model", str(a.model)], capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            raise SystemExit(f"error: staleness {s} run failed:\n{out.stderr[-3000:]}")
        results[f"staleness_{s}"] = json.loads(line[len("RESULT "):])
    text = table(results)
    print(text)
    body = {"modes": results, "steps": a.steps, "warmup": a.warmup, "model": repo_relative(a.model),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_at_start": load_at_start,
                        "loadavg_at_end": os.getloadavg()}, "table": text}
    write_json(a.out, body, __file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
