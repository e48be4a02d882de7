"""Asynchronous rollouts: the demo's step rate synchronous vs `rollout.max_staleness` 1 and 2, and what the
`proximal = "bypass"` option saves in `Learner.prepare`.

    .venv/bin/python benchmarks/async_rollouts.py [--steps 20] [--model runs/tiny_cpu_base] [--part all|loop|bypass|behaviour]

`loop`: the demo config (`configs/tiny_cpu.py`) run through the real CLI three times in a row, one per mode —
synchronous (`max_staleness = 0`), 1 and 2 — each for `--steps` steps without evaluation or checkpoints in
between (the final step's evaluation and checkpoint fall outside the timed steps). The trainer process is
pinned to core 0 (`taskset -c 0`); the managed rollout server it launches is re-pinned, every one of its
threads, to core 1 (`os.sched_setaffinity` on /proc/<pid>/task/*) as soon as it is up, so each side has a
core of its own. From each run's metrics (the first `--warmup` steps, which compile, left out):

- steps/s = timed steps / Σ time/step_s;
- trainer idle = Σ time/rollout_s / Σ time/step_s: the trainer waits for the batch (synchronous: the whole
  rollout; asynchronous: the wait in `take` plus a weight push held by an in-progress Generate);
- server idle = 1 − Σ Generate time / Σ time/step_s: synchronous, the Generate time is time/rollout_s (the
  weight push included); asynchronous, `time/generate_s` of the batches the timed steps trained on (the
  producer's wall time per batch, lock waits included): both upper bounds on the server's busy time, so
  the idle fractions are lower bounds.

`bypass`: two `Learner`s of the demo shape on the same random batches, `objective.preset` "decoupled"
(θ_old forward) and "naive_ppo" (proximal = "bypass": μ as π_prox, no forward), `prepare` timed
interleaved; the saving is the median difference.

`behaviour`: the asynchronous loop's one forward the synchronous loop does not have — π_behav, every lagged
row scored with the weights of its version (`train/behaviour.py`) — timed through `BehaviourScorer.behav_logp`
on demo batches of two kinds: all rows one version behind (as at staleness 1), and lags 0/1/2 by group in
thirds (a batch whose Generate calls straddled pushes). Four scorers, interleaved: the unpacked scorer
(`models.scoring.make_scorer`) and the packed one (`train/packed_scoring.py`), each scoring the whole batch
once per lag (before `train/row_scoring.py`) or only the lag's rows (now); medians. `prepare`'s own θ_old forward (packed) is the `bypass` part's "θ_old forward" row.

Prints a table and writes docs/results/async_rollouts.{json,md} (`--part bypass` / `behaviour` alone:
async_rollouts_<part>.{json,md}; `--out STEM` writes STEM.json and STEM.md). The target (issue 20): ≥ 1.4× the
synchronous step rate at staleness 1 on 2 cores. Timings are only meaningful on an otherwise idle machine.
"""

from __future__ import annotations

import json
import os
import platform
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

MODES = {"sync": 0, "staleness_1": 1, "staleness_2": 2}
SUFFIXES = (".json", ".md")  # what a results stem gets


def result_path(flag: str, out: str) -> Path:
    """The JSON path of the results stem `out` (`STEM.json`, its table `STEM.md`): a name ending in the script's
    own suffix (.json or .md) loses it, any other is kept whole (`res_v1.2` writes `res_v1.2.json`, not
    `res_v1.json`). A directory, or a name ending in a slash, is refused: one line naming `flag`, exit 2 (it
    wrote `adir.json` beside the folder `adir/`)."""
    from jaxrl_mismatch.usage import UsageError, exit_on_usage_error

    def check() -> Path:
        if not out.strip():
            raise UsageError(f"{flag}: empty path")
        if os.path.isdir(out) or out.endswith(("/", os.sep)):
            raise UsageError(f"{flag} {out}: names a directory; give a results stem (the script writes STEM.json and "
                             "STEM.md), e.g. a path inside it")
        suffix = Path(out).suffix
        return Path(out[: -len(suffix)] if suffix in SUFFIXES else out)

    stem = exit_on_usage_error(check)
    return stem.with_name(stem.name + ".json")


def demo_config(model: str):
    """The demo config (`configs/tiny_cpu.py`) with `model.path` = `model`."""
    sys.path.insert(0, str(REPO / "configs"))
    from tiny_cpu import get_config

    c = get_config()
    c.model.path = str(model)
    return c


def pin_server(run_dir: Path, core: int, stop: threading.Event, out: dict) -> None:
    """Pin every thread of the managed server (pid in rollout_ready.json) to `core`, again as threads appear."""
    ready = run_dir / "rollout_ready.json"
    while not stop.is_set():
        if ready.exists():
            try:
                pid = json.loads(ready.read_text())["pid"]
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.sched_setaffinity(int(tid), {core})
                out["server_pid"], out["pinned"] = pid, True
            except (OSError, ValueError, KeyError):
                pass  # the file is being written, or the process is gone
        stop.wait(0.5)


def run_mode(name: str, staleness: int, a, work: Path) -> dict:
    run_dir = work / name
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "jaxrl_mismatch.cli", "train",
           "--config", str(REPO / "configs" / "tiny_cpu.py"), f"--config.run_dir={run_dir}",
           f"--config.model.path={a.model}", f"--config.steps={a.steps}", f"--config.rollout.max_staleness={staleness}",
           "--config.eval.every=0", "--config.checkpoint.every=0", "--config.log.progress=False",
           "--config.log.report=False", "--config.log.tensorboard=False"]
    stop, pinned = threading.Event(), {}
    pinner = threading.Thread(target=pin_server, args=(run_dir, 1, stop, pinned), daemon=True)
    pinner.start()
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    stop.set()
    if out.returncode != 0:
        raise SystemExit(f"error: {name} run failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= a.warmup]
    step_s = sum(r["time/step_s"] for r in rows)
    wait_s = sum(r["time/rollout_s"] for r in rows)
    gen_s = sum(r.get("time/generate_s", r["time/rollout_s"]) for r in rows)
    return {"max_staleness": staleness, "timed_steps": len(rows), "steps_per_s": len(rows) / step_s,
            "step_s_median": statistics.median(r["time/step_s"] for r in rows),
            "trainer_idle_frac": wait_s / step_s, "server_idle_frac": max(0.0, 1.0 - gen_s / step_s),
            "lag_mean": statistics.mean(r["staleness/version_lag_mean"] for r in rows),
            "dropped_batches": max((r.get("rollout/dropped_batches", 0.0) for r in rows), default=0.0),
            "reward_mean": statistics.mean(r["reward/mean"] for r in rows),
            "server_pinned": bool(pinned.get("pinned")), "wall_s_incl_startup": wall}


def bypass_saving(a, work: Path) -> dict:
    """Median `Learner.prepare` time with the θ_old forward (decoupled) and without it (bypass)."""
    import numpy as np

    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "configs"))
    from packing import SHAPES, make_batch
    from tiny_cpu import get_config

    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    learners = {}
    for preset in ("decoupled", "naive_ppo"):
        c = get_config()
        c.model.path, c.run_dir = str(a.model), str(work / f"bypass_{preset}")
        c.objective.preset = preset
        c.objective.overrides = {}
        learners[preset] = Learner(learner_config(c))
    vocab = learners["decoupled"].model_cfg.vocab_size
    times: dict[str, list[float]] = {p: [] for p in learners}
    for i in range(a.bypass_repeats + 1):
        batch = make_batch(SHAPES["demo"], vocab, seed=i)
        batch = batch.replace(rollout_logp=(-np.abs(np.random.default_rng(i).normal(size=batch.rollout_logp.shape))
                                            * batch.response_mask).astype(np.float32))
        for p, learner in learners.items():
            t0 = time.perf_counter()
            learner.prepare(batch, seed=i)
            if i:  # the first call compiles
                times[p].append(time.perf_counter() - t0)
    rec, byp = statistics.median(times["decoupled"]), statistics.median(times["naive_ppo"])
    return {"prepare_s_recompute": rec, "prepare_s_bypass": byp, "saving_s": rec - byp,
            "saving_frac_of_prepare": (rec - byp) / rec, "repeats": a.bypass_repeats}


def behaviour_saving(a) -> dict:
    """Median π_behav time of `BehaviourScorer.behav_logp` on demo batches: unpacked vs packed scorer, each
    scoring the whole batch per lag (as before train/row_scoring.py) or the lag's rows only; two batch kinds."""
    import numpy as np

    sys.path.insert(0, str(REPO / "benchmarks"))
    sys.path.insert(0, str(REPO / "configs"))
    from packing import SHAPES, make_batch
    from tiny_cpu import get_config

    from jaxrl_mismatch import precision
    from jaxrl_mismatch.models import load_hf
    from jaxrl_mismatch.models.scoring import make_scorer
    from jaxrl_mismatch.train.behaviour import BehaviourScorer
    from jaxrl_mismatch.train.learner_config import learner_config
    from jaxrl_mismatch.train.packed_scoring import make_packed_scorer
    from jaxrl_mismatch.train.row_scoring import score_rows
    from jaxrl_mismatch.train.state import split_model

    c = get_config()
    c.model.path = str(a.model)
    c.rollout.max_staleness = 2
    lc = learner_config(c)
    policy = precision.policy(lc.precision, fp32_lm_head=lc.fp32_lm_head, param_dtype="float32")
    model_cfg, model = load_hf(lc.model_path, policy=policy, mesh=lc.mesh, scan_layers=lc.scan_layers,
                               attention_impl=lc.attention_impl)
    graphdef, params = split_model(model)
    kw = dict(chunk_size=lc.chunk_size, temperature=lc.temperature)
    scorers = {}
    for name, make in (("unpacked", make_scorer), ("packed", make_packed_scorer)):
        forward = make(graphdef, lc.mesh, **kw)
        for how in ("whole", "rows"):
            # What `Learner._score` does outside exact mode; "whole": every row scored for every lag (before).
            def score(p, batch, rows, forward=forward, packed=name == "packed", whole=how == "whole"):
                rows = np.ones_like(rows) if whole else rows
                return score_rows(forward, p, batch.tokens, batch.attention_mask, rows,
                                  packed=packed) * np.asarray(batch.response_mask)

            scorers[name, how] = s = BehaviourScorer(2, score)
            for v in (1, 2, 3):  # version 3 is current: lag 1 is scored with version 2, lag 2 with version 1
                s.remember(v, params)
    shape = SHAPES["demo"]
    kinds = {"lag1": lambda rows: np.ones(rows, np.int32),  # staleness 1: every row one version behind
             "mixed": lambda rows: np.repeat(np.arange(shape["prompts"]) % 3, shape["group"]).astype(np.int32)}
    times = {(k, *n): [] for k in kinds for n in scorers}
    diff = {k: 0.0 for k in kinds}
    for i in range(a.bypass_repeats + 2):
        for kind, lags in kinds.items():
            batch = make_batch(shape, model_cfg.vocab_size, seed=i)
            batch = batch.replace(version_lag=lags(batch.num_rows))
            outs = {}
            for n in (list(scorers) if i % 2 else list(scorers)[::-1]):
                t0 = time.perf_counter()
                outs[n] = scorers[n].behav_logp(batch)
                if i >= 2:  # the first two batches compile (bucketed shapes)
                    times[(kind, *n)].append(time.perf_counter() - t0)
            ref = outs["unpacked", "whole"]
            diff[kind] = max(diff[kind], *(float(np.max(np.abs(o - ref))) for o in outs.values()))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"behav_s_unpacked": med["lag1", "unpacked", "rows"], "behav_s_packed": med["lag1", "packed", "rows"],
           "repeats": a.bypass_repeats, "median_s": {"/".join(k): v for k, v in med.items()},
           "max_abs_logp_diff": max(diff.values()),
           "mixed_lags": "lag of group g = g mod 3 (32 groups of 8: 11/11/10 groups at lags 0/1/2)"}
    out["saving_s"] = out["behav_s_unpacked"] - out["behav_s_packed"]
    out["saving_frac"] = out["saving_s"] / out["behav_s_unpacked"]
    return out


def table(loop: dict, bypass: dict | None, behaviour: dict | None = None) -> str:
    lines = []
    if loop:
        base = loop["sync"]["steps_per_s"]
        lines += ["| mode | max_staleness | steps/s | × sync | median step (s) | trainer idle | server idle | mean lag |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in loop.items():
            lines.append(f"| {name} | {r['max_staleness']} | {r['steps_per_s']:.3f} | {r['steps_per_s'] / base:.2f} | "
                         f"{r['step_s_median']:.3f} | {r['trainer_idle_frac']:.0%} | {r['server_idle_frac']:.0%} | "
                         f"{r['lag_mean']:.2f} |")
    if bypass:
        lines += ["", "| Learner.prepare (demo batch) | median s |", "| --- | --- |",
                  f"| θ_old forward (decoupled) | {bypass['prepare_s_recompute']:.4f} |",
                  f"| bypass (naive_ppo) | {bypass['prepare_s_bypass']:.4f} |",
                  f"| saving | {bypass['saving_s']:.4f} ({bypass['saving_frac_of_prepare']:.0%}) |"]
    if behaviour:
        m = behaviour["median_s"]
        lines += ["", "| π_behav forward, median s (demo batch) | all rows lag 1 | lags 0/1/2 (groups in thirds) |",
                  "| --- | --- | --- |"]
        for name in ("unpacked", "packed"):
            for how, what in (("whole", "whole batch per lag (before)"), ("rows", "the lag's rows only")):
                lines.append(f"| {name}, {what} | {m[f'lag1/{name}/{how}']:.4f} | {m[f'mixed/{name}/{how}']:.4f} |")
        lines.append(f"| max abs log-prob difference to unpacked whole-batch | {behaviour['max_abs_logp_diff']:.1e} | |")
    return "\n".join(lines)


def main() -> int:
    ap = ArgumentParser(description=description(__doc__))
    ap.add_argument("--steps", type=positive_int, default=20,
                    help="loop part: steps per mode (the first --warmup are not timed)")
    ap.add_argument("--warmup", type=nonneg_int, default=3, help="loop part: steps left out of the timing")
    ap.add_argument("--model", default=str(REPO / "runs" / "tiny_cpu_base"),
                    help="the demo's warm-started policy (jaxrl-mismatch train --config configs/tiny_cpu.py writes it)")
    ap.add_argument("--part", choices=("all", "loop", "bypass", "behaviour"), default="all")
    ap.add_argument("--bypass-repeats", type=positive_int, default=10,
                    help="bypass and behaviour parts: timed batches")
    ap.add_argument("--note", default="", help="a line for the results file (e.g. the machine's load)")
    ap.add_argument("--out", default=None, help="results stem: writes STEM.json and STEM.md (a trailing .json or "
                    ".md is dropped; default docs/results/async_rollouts, or async_rollouts_<part> for --part "
                    "bypass/behaviour alone: the loop's results stay)")
    a = ap.parse_args()
    a.out = a.out or str(REPO / "docs" / "results" / ("async_rollouts" if a.part in ("all", "loop")
                                                      else f"async_rollouts_{a.part}"))
    out = result_path("--out", a.out)
    check_out("--out", out, __file__, table=True)
    load_at_start = os.getloadavg()
    # the trainer runs with cwd=REPO: a path relative to the caller's folder is made absolute before it is passed on
    a.model = os.path.abspath(a.model)
    runs_loop = a.part in ("all", "loop")
    if runs_loop and a.steps <= a.warmup:
        print(f"error: --steps: {a.steps} leaves no timed step after --warmup {a.warmup}", file=sys.stderr)
        return 2
    if runs_loop and (os.cpu_count() or 1) < 2:
        print("error: the loop part pins trainer and server to cores 0 and 1; this machine has 1", file=sys.stderr)
        return 2
    # the demo's warm-started policy (`jaxrl-mismatch train --config configs/tiny_cpu.py` writes it), checked as
    # `train` checks it: a folder that is no usable model is one line here, not a traceback after minutes
    check_model("--model", a.model, demo_config(a.model), missing="run the demo's warm start (jaxrl-mismatch train "
                "--config configs/tiny_cpu.py writes runs/tiny_cpu_base) or pass --model")
    loop, bypass, behaviour = {}, None, None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if a.part in ("all", "loop"):
            for name, s in MODES.items():
                loop[name] = run_mode(name, s, a, work)
                print(f"{name}: {loop[name]['steps_per_s']:.3f} steps/s", flush=True)
        if a.part in ("all", "bypass"):
            bypass = bypass_saving(a, work)
        if a.part in ("all", "behaviour"):
            behaviour = behaviour_saving(a)
    text = table(loop, bypass, behaviour)
    print(text)
    result = {"part": a.part, "loop": loop, "bypass": bypass, "behaviour": behaviour,
              # --steps / --warmup shape the loop part only (bypass and behaviour record their own repeats)
              **({"steps": a.steps, "warmup": a.warmup} if loop else {}), "model": repo_relative(a.model),
              "note": a.note, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                          "loadavg_at_start": load_at_start, "loadavg_at_end": os.getloadavg()},
              "speedup_staleness_1": (loop["staleness_1"]["steps_per_s"] / loop["sync"]["steps_per_s"]) if loop else None}
    heading = f"{a.steps} steps per mode" if loop else f"--part {a.part}"
    write_json(out, result, __file__, table=f"# Asynchronous rollouts ({heading})\n\n{a.note}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
