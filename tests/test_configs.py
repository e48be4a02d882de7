"""Every shipped config builds and passes validation (the GPU/TPU ones too: their paths are only read at run time)."""

import importlib.util
from pathlib import Path

import pytest

from jaxrl_mismatch.train.config_checks import validate

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.py"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_is_valid(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    validate(module.get_config())


def test_expected_configs_exist():
    assert {p.stem for p in CONFIGS} >= {"tiny_cpu", "qwen3_4b_dapo_lr_decay", "r1_distill_1p5b_fp16_sanity"}


def test_request_chunks_respect_limits_and_cover_every_prompt():
    from jaxrl_mismatch.rollout import SamplingSpec
    from jaxrl_mismatch.rollout.protocol import Limits
    from jaxrl_mismatch.rollout.session import request_chunks

    # The Qwen3-4B config's step: 64 prompts × 16 samples × 8192 tokens = 2 requests at the default limit.
    prompts = [[1] * 300] * 64
    chunks = request_chunks(prompts, SamplingSpec(n=16, max_tokens=8192), Limits())
    assert [c.start for c in chunks] == [0, 32] and chunks[-1].stop == 64
    # Tight custom limits: every request within both limits, all prompts covered in order.
    limits = Limits(max_request_prompt_tokens=700, max_request_completion_tokens=10 * 64)
    chunks = request_chunks(prompts[:10], SamplingSpec(n=2, max_tokens=64), limits)
    assert sum(c.stop - c.start for c in chunks) == 10
    for c in chunks:
        assert (c.stop - c.start) * 300 <= 700 and (c.stop - c.start) * 128 <= 640
    with pytest.raises(ValueError, match="max_tokens"):
        request_chunks(prompts, SamplingSpec(n=16, max_tokens=1 << 20), Limits())
