"""Every shipped config builds and passes validation (the GPU/TPU ones too: their paths are only read at run time)."""

import importlib.util
from pathlib import Path

import pytest

from jaxrl_mismatch.train.config import validate

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.py"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_is_valid(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    validate(module.get_config())


def test_expected_configs_exist():
    assert {p.stem for p in CONFIGS} >= {"tiny_cpu", "qwen3_4b_dapo_lr_decay", "r1_distill_1p5b_fp16_sanity"}
