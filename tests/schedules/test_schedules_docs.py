"""The composition example in docs/schedules.md runs, compiles its update once, and prints what it says."""

import pathlib
import re

import jax
import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "schedules.md"


def test_docs_example_runs(capsys):
    block = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and kwargs.get("fun_name") == "jit(update)":
            compiles.append(duration)

    namespace: dict = {}
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    surge_step, lr = capsys.readouterr().out.split()
    assert float(surge_step) == 20.0
    assert float(lr) == pytest.approx(0.25e-6, rel=1e-6)
    assert namespace["ctrl"].metrics()["0_length_triggered_decay/first_decay_step"] == 36
    assert len(compiles) == 1  # 80 different lr_scale values, one compilation
