import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_mismatch.report.plot import make_report
from jaxrl_mismatch.train.observe import RunWriter, StepAccumulator, read_jsonl


def test_accumulator_averages_minibatches_and_resets():
    acc = StepAccumulator()
    acc.add({"mismatch/rho_mean_pi_0-0.1": jnp.float32(1.0), "grad/norm": jnp.float32(4.0)})
    acc.add({"mismatch/rho_mean_pi_0-0.1": jnp.float32(3.0), "grad/norm": jnp.float32(0.0)})
    out = acc.compute()
    assert out == {"grad/norm": 2.0, "mismatch/rho_mean_pi_0-0.1": 2.0}
    assert acc.compute() == {}


def test_accumulator_rejects_changing_names_within_a_step():
    acc = StepAccumulator()
    acc.add({"a": jnp.float32(1.0)})
    with pytest.raises(ValueError, match="b"):
        acc.add({"a": jnp.float32(1.0), "b": jnp.float32(2.0)})


def test_writer_jsonl_tensorboard_and_resume_truncation(tmp_path):
    w = RunWriter(str(tmp_path))
    for s in range(5):
        w.write(s, {"reward/mean": np.float32(s / 10), "lr": 1e-3, "bad": float("nan")})
    w.close()
    recs = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in recs] == list(range(5))
    assert recs[2]["reward/mean"] == pytest.approx(0.2)
    assert recs[0]["bad"] == "nan"
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    # A resumed run from step 3 drops steps >= 3 written before the crash, then appends.
    w = RunWriter(str(tmp_path), resume_from_step=3)
    w.write(3, {"reward/mean": 0.9})
    w.close()
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [0, 1, 2, 3]


def test_read_jsonl_skips_torn_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps({"step": 0, "x": 1.0}) + "\n" + '{"step": 1, "x"')
    assert read_jsonl(str(p)) == [{"step": 0, "x": 1.0}]


def test_report_writes_png_with_surge(tmp_path):
    w = RunWriter(str(tmp_path), tensorboard=False)
    for s in range(40):
        w.write(
            s,
            {
                "reward/mean": 0.2 + s / 100,
                "length/mean": 10.0 if s < 10 else 30.0,
                "mismatch/log_ppl_abs_diff": 1e-3 * (1 + math.sin(s)),
                "mismatch/rho_std": 0.01,
                "grad/norm_clipped_per_token": 0.05,
                "lr": 1e-3 if s < 20 else 5e-4,
                "controller/surge_step": -1 if s < 12 else 12,
            },
        )
    w.close()
    out = make_report(str(tmp_path))
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_report_errors_on_missing_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        make_report(str(tmp_path))


def test_accumulator_keeps_extremes_and_last_state():
    acc = StepAccumulator()
    acc.add({"length/max": jnp.float32(10), "mismatch/rho_min": jnp.float32(0.9),
             "loss_scale/skipped_steps": jnp.float32(1), "reward/mean": jnp.float32(0.2)})
    acc.add({"length/max": jnp.float32(7), "mismatch/rho_min": jnp.float32(0.95),
             "loss_scale/skipped_steps": jnp.float32(2), "reward/mean": jnp.float32(0.4)})
    out = acc.compute()
    assert out["length/max"] == 10 and out["mismatch/rho_min"] == pytest.approx(0.9)
    assert out["loss_scale/skipped_steps"] == 2 and out["reward/mean"] == pytest.approx(0.3)
