"""Where the test suite's time goes: a pytest plugin recording, per test, wall time, the worker's own CPU time,
the CPU time of the processes it started (servers, CLI runs, trainers) and XLA compilation time.

On this 2-core machine the suite is CPU-bound, so wall time follows CPU time, not `--durations`: a test waiting on
a subprocess shows wall time that the subprocess spends on the other core. Usage (under xdist too):

    PYTHONPATH=scripts SUITE_PROFILE_DIR=/tmp/prof bash scripts/test.sh -p suite_profile

Each run gets a new folder `<dir>/<time>-<pid>` (default dir `.suite_profile`; nothing already there is touched):
each process writes `rows_<worker>.json` in it ({test id: [wall, self CPU, children CPU, compile] seconds}); at the
end the controller prints the costliest files (CPU = self + children) and writes `files.json` beside them, then
the programs the workers compiled longest (`compiles_<worker>.json` per test, `functions.json` summed: count,
seconds, persistent-cache hits, files).
Children's CPU counts once a child has been waited for, so a module fixture's server lands on the test that
tears it down (same file). Compile time is the wall time of JAX's `backend_compile_duration` events (cache hits
included), so on a busy machine it can exceed the CPU time it took.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

_rows: dict[str, list[float]] = {}
_compile = [0.0]
_by_fun: dict[str, list[float]] = {}  # the running test's compilations: {jit name: [count, seconds, cache hits]}
_compiles: dict[str, dict[str, list[float]]] = {}  # {test id: _by_fun}
_hit = [False]  # the persistent cache answered the compilation now under way


def _listen(event: str, duration: float, fun_name: str = "?", **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compile[0] += duration
        acc = _by_fun.setdefault(fun_name, [0, 0.0, 0])
        acc[0] += 1
        acc[1] += duration
        acc[2] += int(_hit[0])
        _hit[0] = False


def _listen_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hit[0] = True


def _snapshot() -> tuple[float, float, float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime, _compile[0]


_RUN_ENV = "SUITE_PROFILE_RUN"  # this run's folder: made by the controller, inherited by the xdist workers it starts


def pytest_configure(config) -> None:
    import jax

    jax.monitoring.register_event_duration_secs_listener(_listen)
    jax.monitoring.register_event_listener(_listen_event)
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller, or a run without xdist
        base = Path(os.environ.get("SUITE_PROFILE_DIR") or config.rootpath / ".suite_profile")
        run = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        run.mkdir(parents=True)
        os.environ[_RUN_ENV] = str(run)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _by_fun.clear()
    before = _snapshot()
    yield
    after = _snapshot()
    _rows[item.nodeid] = [b - a for a, b in zip(before, after)]
    _compiles[item.nodeid] = dict(_by_fun)


def _by_file(rows: dict[str, list[float]]) -> dict[str, list[float]]:
    files: dict[str, list[float]] = {}
    for test_id, values in rows.items():
        acc = files.setdefault(test_id.split("::")[0], [0.0] * 5)
        for i, v in enumerate(values):
            acc[i] += v
        acc[4] += 1
    return files


def pytest_sessionfinish(session) -> None:
    if _rows:  # an xdist controller runs no tests itself
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (Path(os.environ[_RUN_ENV]) / f"rows_{worker}.json").write_text(json.dumps(_rows))
        (Path(os.environ[_RUN_ENV]) / f"compiles_{worker}.json").write_text(json.dumps(_compiles))


def pytest_terminal_summary(terminalreporter) -> None:
    out = Path(os.environ[_RUN_ENV])
    rows: dict[str, list[float]] = {}
    for path in sorted(out.glob("rows_*.json")):
        rows.update(json.loads(path.read_text()))
    if not rows:
        return
    files = _by_file(rows)
    (out / "files.json").write_text(json.dumps(files, indent=1))
    total = [sum(r[i] for r in rows.values()) for i in range(4)]
    tr = terminalreporter
    tr.section("suite profile (seconds)")
    tr.write_line(f"{len(rows)} tests: wall {total[0]:.0f}, worker CPU {total[1]:.0f}, children CPU {total[2]:.0f}, "
                  f"XLA compile {total[3]:.0f}  ({out})")
    tr.write_line(f"{'wall':>7} {'self':>7} {'child':>7} {'CPU':>7} {'compile':>7} {'tests':>5}  file")
    for name, (wall, own, kids, comp, n) in sorted(files.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:30]:
        tr.write_line(f"{wall:7.1f} {own:7.1f} {kids:7.1f} {own + kids:7.1f} {comp:7.1f} {int(n):5d}  {name}")
    # Which programs the compile time goes to, over the whole run (the workers' own compilations; a cache hit
    # counts too, at the seconds it took): the same name in many files is a candidate for sharing a shape.
    funs: dict[str, list] = {}
    for path in sorted(out.glob("compiles_*.json")):
        for test_id, by_fun in json.loads(path.read_text()).items():
            for name, (count, secs, hits) in by_fun.items():
                acc = funs.setdefault(name, [0, 0.0, 0, set()])
                acc[0] += count
                acc[1] += secs
                acc[2] += hits
                acc[3].add(test_id.split("::")[0])
    (out / "functions.json").write_text(json.dumps({k: [c, s, h, sorted(f)] for k, (c, s, h, f) in funs.items()},
                                                   indent=1))
    tr.write_line(f"{'compile':>7} {'count':>6} {'hits':>5} {'files':>5}  program")
    for name, (count, secs, hits, in_files) in sorted(funs.items(), key=lambda kv: -kv[1][1])[:25]:
        tr.write_line(f"{secs:7.1f} {count:6d} {hits:5d} {len(in_files):5d}  {name}")
