"""docs/contracts.md lists every field of the types that cross package seams, and every file it names exists."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "contracts.md").read_text()


def _types():
    from jaxrl_mismatch.models.config import ModelConfig
    from jaxrl_mismatch.models.moe import RouterOutput
    from jaxrl_mismatch.rollout.engine import Completion, EngineInfo, SamplingSpec
    from jaxrl_mismatch.train.batch import RolloutBatch
    from jaxrl_mismatch.train.state import TrainState

    return [ModelConfig, RouterOutput, Completion, EngineInfo, SamplingSpec, RolloutBatch, TrainState]


@pytest.mark.parametrize("cls", _types(), ids=lambda c: c.__name__)
def test_every_field_is_documented(cls):
    named = set(re.findall(r"`([^`]+)`", DOC))
    words = {w for text in named for w in re.findall(r"\w+", text)}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in words]
    assert missing == [], f"docs/contracts.md does not mention {cls.__name__} fields {missing}"


def test_every_named_file_exists():
    paths = set(re.findall(r"`((?:models|rollout|train|metrics|objectives|schedules|data|jobs)/\w+\.(?:py|proto))", DOC))
    assert paths, "the check found no file names"
    missing = sorted(p for p in paths if not (REPO / "jaxrl_mismatch" / p).exists())
    assert missing == []
