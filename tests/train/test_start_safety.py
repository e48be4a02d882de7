"""What `train` checks before it starts (or restarts) in a run directory, found by a review: a rerun after
"no checkpoint can be restored" started over and deleted the run's metrics.jsonl; a symlinked train.lock had its
target truncated; inf and huge integers passed `validate`; overrides that do nothing were accepted; a usage error
after the run directory was made left it behind; a no-op `trainer.exact_forward` change refused a resume."""

from __future__ import annotations

import json
import math
import os

import pytest

from jaxrl_mismatch.runlog import RunWriter
from jaxrl_mismatch.train import loop
from jaxrl_mismatch.train.checkpoint import CheckpointDamagedError
from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_checks import check_paths, validate
from jaxrl_mismatch.train.config_resume import config_changes
from jaxrl_mismatch.train.runlock import RunDirLock
from jaxrl_mismatch.usage import INT32_MAX, UsageError


def _config(tmp_path, **fields):
    c = base_config()
    c.model.path = str(tmp_path / "model")
    c.run_dir = str(tmp_path / "run")
    for path, v in fields.items():
        section, _, name = path.rpartition(".")
        node = c
        for part in section.split(".") if section else ():
            node = node[part]
        node[name] = v
    return c


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def _metrics(run, *steps):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in steps))


def _bare_trainer(c):
    """A Trainer with only what `_restore` reads when no checkpoint is there (no model, no server)."""
    from jaxrl_mismatch.train.checkpoint import Checkpointer

    t = object.__new__(loop.Trainer)
    t.c = c
    t.ckpt = Checkpointer(os.path.join(c.run_dir, "checkpoints"), max_to_keep=3)
    return t


# ---- 1. no silent restart over a run's log ------------------------------------------------------------------

def test_a_rerun_after_every_checkpoint_was_set_aside_is_refused_not_restarted(tmp_path):
    """The checkpoints were all moved aside as damaged: a rerun started at step 0 and deleted metrics.jsonl."""
    run = tmp_path / "run"
    _metrics(run, -1, 0, 1, 2)
    (run / "checkpoints" / "2.damaged-1795823024353038113").mkdir(parents=True)
    before = (run / "metrics.jsonl").read_bytes()
    t = _bare_trainer(_config(tmp_path))
    try:
        with pytest.raises(CheckpointDamagedError, match=f"{run}: no checkpoint can be restored.*2.damaged-"):
            t._restore()
    finally:
        t.ckpt.close()
    assert (run / "metrics.jsonl").read_bytes() == before


def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path):
    """Trained steps but no checkpoint (killed before `checkpoint.every`): nothing to resume, so it starts over;
    its log is kept aside by RunWriter (next test), so nothing is lost."""
    run = tmp_path / "run"
    _metrics(run, -1, 0, 1)
    loop.check_fresh_start(str(run), str(run / "checkpoints"))
    _metrics(tmp_path / "new", -1)
    loop.check_fresh_start(str(tmp_path / "new"), str(tmp_path / "new" / "checkpoints"))
    loop.check_fresh_start(str(tmp_path / "absent"), str(tmp_path / "absent" / "checkpoints"))


def test_a_fresh_log_keeps_the_earlier_one_renamed(tmp_path):
    """`RunWriter` without a resume step removed an existing metrics.jsonl."""
    _metrics(tmp_path, -1)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    RunWriter(str(tmp_path), tensorboard=False).close()
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.replaced-")]
    assert len(kept) == 1 and kept[0].read_bytes() == before
    assert (tmp_path / "metrics.jsonl").read_bytes() == b""


# ---- 2. the run lock is never followed through a link ---------------------------------------------------------

def test_a_symlinked_run_lock_is_refused_and_its_target_untouched(tmp_path, model_dir):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (run / "train.lock").symlink_to(target)
    with pytest.raises(UsageError, match=f"run lock {run}/train.lock is a symbolic link"):
        RunDirLock(str(run)).acquire()
    with pytest.raises(ConfigError, match="config.run_dir: its run lock .*train.lock is a symbolic link"):
        check_paths(_config(tmp_path))
    assert target.read_text() == "keep me\n"
    (run / "train.lock").unlink()
    os.mkfifo(run / "train.lock")
    with pytest.raises(UsageError, match="train.lock is not a regular file"):
        RunDirLock(str(run)).acquire()
    with pytest.raises(ConfigError, match="train.lock is not a regular file"):
        check_paths(_config(tmp_path))


def test_a_removed_lock_is_never_held_by_two_trainers_and_cleanup_keeps_a_users_empty_folder(tmp_path):
    """A stopped start released its lock, then deleted the lock file and its run directory: a trainer that took the
    lock in between lost both, and a third trainer then ran beside it. The lock file goes while still held now, and
    a lock taken on a file already unlinked is taken again on the path's file. The cleanup also removed every empty
    folder in the run directory, a user's made meanwhile included."""
    from jaxrl_mismatch.train.loop import _missing_dirs, _remove_created

    run = tmp_path / "a" / "run"
    created = _missing_dirs(str(run))
    run.mkdir(parents=True)
    first = RunDirLock(str(run)).acquire()
    (run / "checkpoints").mkdir()
    (run / "user_data" / "empty").mkdir(parents=True)
    first.remove()
    _remove_created(str(run), created)
    assert (run / "user_data" / "empty").is_dir() and not (run / "checkpoints").exists()
    assert not (run / "train.lock").exists()
    second = RunDirLock(str(run)).acquire()
    with pytest.raises(UsageError, match="is in use by another trainer"):  # the file the second trainer holds
        RunDirLock(str(run)).acquire()
    # a lock whose file was unlinked after it was opened (its flock succeeds on the orphan inode) is taken anew
    stale = os.open(run / "train.lock", os.O_RDWR)
    second.remove()
    third = RunDirLock(str(run))
    real_open = os.open

    def open_then_unlinked(path, *args, **kwargs):
        if str(path) == third.path and not getattr(open_then_unlinked, "done", False):
            open_then_unlinked.done = True
            return stale  # the descriptor of the file `remove` just unlinked
        return real_open(path, *args, **kwargs)

    import unittest.mock

    with unittest.mock.patch.object(os, "open", open_then_unlinked):
        third.acquire()
    assert (run / "train.lock").exists() and os.fstat(third._fd).st_ino == os.stat(run / "train.lock").st_ino
    third.release()


# ---- 3. / 4. finite floats, int32 integers, a schedule that evaluates -----------------------------------------

@pytest.mark.parametrize("field", ["rollout.temperature", "eval.temperature", "objective.kl_coef",
                                   "objective.entropy_coef", "rollout.logit_noise_std", "diagnostics.variance_sigma",
                                   "diagnostics.weight_distortion_delta", "optim.max_grad_norm"])
def test_inf_is_refused_naming_the_field(tmp_path, field):
    with pytest.raises(ConfigError, match=f"^config.{field}: must be a finite number, got inf"):
        validate(_config(tmp_path, **{field: math.inf}))


@pytest.mark.parametrize("field", ["optim.lr", "rollout.temperature", "eval.temperature", "objective.kl_coef"])
def test_a_float_past_float32_is_refused_naming_the_field(tmp_path, field):
    """Finite in float64, inf in float32: lr = 1e99 trained a step into non-finite weights (the server refused the
    push after a checkpoint of them was written); temperature = 1e99 reached the server (refused at the first
    Generate, after the model loaded)."""
    with pytest.raises(ConfigError, match=f"^config.{field}: must be within float32's range .* got 1e\\+99$"):
        validate(_config(tmp_path, **{field: 1e99}))
    validate(_config(tmp_path, **{field: 0.5}))


def test_a_learning_rate_float32_rounds_to_nothing_is_refused(tmp_path):
    """lr = 1e-50 is 0.0 in the float32 update: the run trained and no weight moved."""
    with pytest.raises(ConfigError, match=r"^config\.optim\.lr: 1e-50 is below float32's smallest normal number"):
        validate(_config(tmp_path, **{"optim.lr": 1e-50}))
    validate(_config(tmp_path, **{"optim.lr": 1e-30}))


@pytest.mark.parametrize("field,value", [("steps", 10**20), ("optim.warmup_steps", 2**40),
                                         ("task.num_train", INT32_MAX + 1), ("eval.every", 2**31)])
def test_integers_past_int32_are_refused_naming_the_field(tmp_path, field, value):
    with pytest.raises(ConfigError, match=f"^config.{field}: must be within the int32 range"):
        validate(_config(tmp_path, **{field: value}))


def test_a_schedule_that_overflows_at_step_zero_names_optim(tmp_path):
    """decay_steps = 2^40 (an open section, so no int32 field check) overflowed in the jitted step."""
    c = _config(tmp_path, **{"optim.schedule": "cosine"})
    c.optim.schedule_kwargs = {"decay_steps": 2**40}
    with pytest.raises(ConfigError, match="^config.optim: the LR schedule cannot be evaluated"):
        validate(c)
    validate(_config(tmp_path, **{"optim.warmup_steps": INT32_MAX}))  # the largest allowed still evaluates


# ---- 5. overrides that do nothing -----------------------------------------------------------------------------

def test_overrides_that_do_nothing_are_refused_but_defaults_pass(tmp_path):
    validate(_config(tmp_path))  # defaults: controller 'none' without kwargs, arithmetic without files
    c = _config(tmp_path)
    c.controller.kwargs = {"window": 5}
    with pytest.raises(ConfigError, match=r"^config.controller.kwargs: \['window'\] do nothing with controller.name = 'none'"):
        validate(c)
    c = _config(tmp_path)
    c.task.files = {"train": "x.jsonl"}
    with pytest.raises(ConfigError, match="^config.task.files: .* do nothing for task 'arithmetic'"):
        validate(c)
    with pytest.raises(ConfigError, match="^config.task.data_dir: .* does nothing for task 'arithmetic'"):
        validate(_config(tmp_path, **{"task.data_dir": "/data/tfds"}))


# ---- 6. usage errors leave no run directory behind ------------------------------------------------------------

def test_a_missing_token_file_is_refused_before_any_work(tmp_path, model_dir):
    c = _config(tmp_path, **{"rollout.token_file": str(tmp_path / "nope"), "rollout.address": "127.0.0.1:1"})
    with pytest.raises(ConfigError, match=f"^config.rollout.token_file: {tmp_path}/nope does not exist"):
        check_paths(c)
    assert not (tmp_path / "run").exists()


def test_a_usage_error_while_building_removes_the_run_directory_it_created(tmp_path, monkeypatch):
    """A prompt over task.max_prompt_len (found when the task data is tokenised) left RUN/train.lock behind."""
    class _Learner:
        def __init__(self, cfg):
            self.model_cfg = type("M", (), {"vocab_size": 32})()
            self.routing_shape = None

    def too_long(c, vocab_size):
        raise ConfigError("config.task.max_prompt_len: prompt 0 has 9 tokens, more than 1")

    monkeypatch.setattr(loop, "Learner", _Learner)
    monkeypatch.setattr(loop, "learner_config", lambda c: None)
    monkeypatch.setattr(loop, "TaskData", too_long)
    c = _config(tmp_path, run_dir=str(tmp_path / "a" / "b" / "run"))
    with pytest.raises(ConfigError, match="max_prompt_len"):
        loop.Trainer(c)
    assert not (tmp_path / "a").exists()
    # An existing run directory (an earlier run's) is left as it was, lock included.
    run = tmp_path / "old"
    _metrics(run, 0)
    (run / "train.lock").write_text("pid 1 on host\n")
    with pytest.raises(ConfigError, match="max_prompt_len"):
        loop.Trainer(_config(tmp_path, run_dir=str(run)))
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "train.lock"]


# ---- 7. / 8. --------------------------------------------------------------------------------------------------

def test_exact_forward_none_to_false_without_exact_rollouts_is_no_change():
    old, new = base_config(), base_config()
    new.trainer.exact_forward = False
    assert config_changes(old.to_dict(), new.to_dict()) == []
    new.trainer.exact_forward = True
    assert config_changes(old.to_dict(), new.to_dict()) == ["trainer.exact_forward: False → True"]


def test_a_dangling_symlink_run_dir_is_named_as_one(tmp_path, model_dir):
    (tmp_path / "run").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match=f"config.run_dir: {tmp_path}/run is a symbolic link to a missing path"):
        check_paths(_config(tmp_path))
