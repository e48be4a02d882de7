"""Which folders `train` may start or resume in: a new or empty one, or a run's own (its lock, or a `checkpoints/`
of this trainer's step folders). A folder of another tool's with a `checkpoints/` subfolder used to count as a run,
and a fresh run there replaced its metrics.jsonl and moved its numbered step folders aside."""

from __future__ import annotations

import pytest

from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_checks import check_paths
from jaxrl_mismatch.train.runlock import is_run_dir


def _check(run_dir, model_dir):
    c = base_config()
    c.run_dir, c.model.path = str(run_dir), str(model_dir)
    check_paths(c)


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def _step(ckpts, name, marker="commit_success.txt"):
    (ckpts / name).mkdir(parents=True)
    if marker:
        (ckpts / name / marker).write_text("x")


def test_another_tools_checkpoints_folder_is_not_a_run(tmp_path, model_dir):
    user = tmp_path / "user"
    _step(user / "checkpoints", "7", marker=None)
    (user / "checkpoints" / "7" / "model.pt").write_text("w")
    (user / "metrics.jsonl").write_text('{"step": 0, "my_metric": 1.0}\n')
    assert not is_run_dir(str(user))
    with pytest.raises(ConfigError, match="config.run_dir: .* is a non-empty directory not written by"):
        _check(user, model_dir)
    for name in ("latest", "7.bak"):  # other names in checkpoints/ are not ours either
        other = tmp_path / name / "run"
        _step(other / "checkpoints", "2")
        _step(other / "checkpoints", name)
        assert not is_run_dir(str(other))
    file_not_dir = tmp_path / "f" / "run"
    (file_not_dir / "checkpoints").mkdir(parents=True)
    (file_not_dir / "checkpoints" / "3").write_text("not a folder")
    assert not is_run_dir(str(file_not_dir))
    empty = tmp_path / "e" / "run"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "notes.txt").write_text("mine")
    assert not is_run_dir(str(empty))


def test_a_run_and_a_copied_run_are_runs(tmp_path, model_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.lock").write_text("123 host\n")
    assert is_run_dir(str(run))
    copied = tmp_path / "copied"
    _step(copied / "checkpoints", "2")
    _step(copied / "checkpoints", "4", marker="_CHECKPOINT_METADATA")  # an interrupted copy: no commit marker
    _step(copied / "checkpoints", "6.orbax-checkpoint-tmp-123", marker=None)
    _step(copied / "checkpoints", "8.damaged-1795773075447589609", marker=None)
    _step(copied / "checkpoints", "9.uncommitted-1795773075447589609", marker=None)
    (copied / "metrics.jsonl").write_text('{"step": 0}\n')
    assert is_run_dir(str(copied))
    _check(copied, model_dir)
    _check(tmp_path / "new", model_dir)
