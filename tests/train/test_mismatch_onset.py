"""Mismatch that starts mid-run (rollout/mismatch_schedule.py): the strength schedule, and a real run whose
`mismatch/*` curve is exactly 0 before the onset step and jumps at it, continued across a resume."""

from __future__ import annotations

import pytest

from jaxrl_mismatch.rollout.mismatch_schedule import mismatch_scale, rollout_mismatch
from jaxrl_mismatch.runlog import read_jsonl
from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_checks import validate
from tests.train.test_loop_integration import _run, base_model, tiny_config  # noqa: F401 (fixture)


def test_scale_is_zero_before_onset_then_ramps_linearly_to_one():
    assert [mismatch_scale(s, 0, 0) for s in range(3)] == [1.0, 1.0, 1.0]  # defaults: always on
    assert [mismatch_scale(s, 3, 0) for s in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [mismatch_scale(s, 2, 4) for s in range(8)] == [0, 0, 0.25, 0.5, 0.75, 1, 1, 1]


@pytest.mark.slow
@pytest.mark.xla_full_opt  # exact mode's zero mismatch before the onset is a bit-for-bit claim
def test_quantized_mismatch_onset_shows_in_the_curve_and_survives_resume(base_model, tmp_path):  # noqa: F811
    # Exact mode: before the onset μ = π(θ_old) bit for bit, so the mismatch is exactly 0 there; from the
    # onset the engine serves W + s·(Q(W) − W) and the mismatch is the int8 quantization's.
    def config(steps):
        c = tiny_config(base_model, tmp_path / "run", exact=True, quantize="int8", mismatch_onset_step=2,
                        mismatch_ramp_steps=2)
        c.steps, c.eval.every = steps, 0
        return c

    _run(config(3))  # steps 0-2, checkpoint at 2 and 3
    summary = _run(config(5))  # resumes after the onset: steps 3-4
    assert summary["start_step"] == 3
    steps = [r for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl")) if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4]
    assert [r["rollout/mismatch_scale"] for r in steps] == [0.0, 0.0, 0.5, 1.0, 1.0]
    diff = [r["mismatch/log_ppl_abs_diff"] for r in steps]
    assert diff[0] == diff[1] == 0.0 and steps[0]["mismatch/rho_std"] == steps[1]["mismatch/rho_std"] == 0.0
    assert all(d > 1e-5 for d in diff[2:]), diff  # the jump at step 2, continued after the resume
    assert all(r["mismatch/rho_std"] > 0 for r in steps[2:])


def test_noise_and_quantize_strength_follow_the_schedule():
    c = base_config()
    c.rollout.logit_noise_std, c.rollout.mismatch_onset_step, c.rollout.mismatch_ramp_steps = 0.4, 10, 2
    assert rollout_mismatch(c.rollout, 9) == {"logit_noise_std": 0.0, "quantize_strength": 0.0}
    assert rollout_mismatch(c.rollout, 10) == {"logit_noise_std": 0.2, "quantize_strength": 0.5}
    assert rollout_mismatch(c.rollout, 11) == {"logit_noise_std": 0.4, "quantize_strength": 1.0}


@pytest.mark.parametrize(("fields", "message"), [
    (dict(quantize="int4"), "config.rollout.quantize: 'int4' is not one of"),
    (dict(engine="vllm", quantize="int8"), "config.rollout.quantize: 'int8' is not available with the vllm engine"),
    (dict(engine="vllm", quantize="fp8", mismatch_onset_step=5), "config.rollout.mismatch_onset_step: a quantization"),
    (dict(mismatch_ramp_steps=-1), "config.rollout.mismatch_ramp_steps: must be a number >= 0"),
])
def test_config_refuses_what_the_engine_cannot_serve(tmp_path, fields, message):
    c = base_config()
    c.model.path = str(tmp_path)
    c.rollout.update(fields)
    with pytest.raises(ConfigError) as e:
        validate(c)
    assert str(e.value).startswith(message)


@pytest.mark.slow
def test_external_server_with_other_quantization_is_refused_by_name(base_model, tmp_path):  # noqa: F811
    from jaxrl_mismatch.rollout.launcher import ManagedServer

    server = ManagedServer(str(tmp_path / "srv"), engine="jax", model=str(base_model), dtype="float32")
    server.start()  # serves full-precision weights
    try:
        c = tiny_config(base_model, tmp_path / "run", address=server.address, token_file=server.token_file,
                        quantize="int8")
        with pytest.raises(ConfigError, match=r"config.rollout.quantize: 'int8', but .* serves 'none' weights"):
            _run(c)
    finally:
        server.stop()
