"""Where the test suite's time goes: a pytest plugin recording, per test, wall time, the worker's own CPU time,
the CPU time of the processes it started (servers, CLI runs, trainers) and XLA compilation time.

On this 2-core machine the suite is CPU-bound, so wall time follows CPU time, not `--durations`: a test waiting on
a subprocess shows wall time that the subprocess spends on the other core. Usage (under xdist too):

    PYTHONPATH=scripts SUITE_PROFILE_DIR=/tmp/prof bash scripts/test.sh -p suite_profile

Each run gets a new folder `<dir>/<time>-<pid>` (default dir `.suite_profile`; nothing already there is touched):
each process writes `rows_<worker>.json` in it ({test id: [wall, self CPU, children CPU, compile] seconds}); at the
end the controller prints the costliest files (CPU = self + children) and writes `files.json` beside them.
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


def _listen(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compile[0] += duration


def _snapshot() -> tuple[float, float, float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime, _compile[0]


_RUN_ENV = "SUITE_PROFILE_RUN"  # this run's folder: made by the controller, inherited by the xdist workers it starts


def pytest_configure(config) -> None:
    import jax

    jax.monitoring.register_event_duration_secs_listener(_listen)
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller, or a run without xdist
        base = Path(os.environ.get("SUITE_PROFILE_DIR") or config.rootpath / ".suite_profile")
        run = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        run.mkdir(parents=True)
        os.environ[_RUN_ENV] = str(run)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _snapshot()
    yield
    after = _snapshot()
    _rows[item.nodeid] = [b - a for a, b in zip(before, after)]


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
