"""Fields that passed `validate` / `check_paths` (and `jobs._inputs.check_warmstart_args`) and failed later, after
the model loaded or the run directory was made (a traceback, exit 1, or many lines from the rollout server): each
is now refused first, naming the field."""

from __future__ import annotations

import types

import ml_collections
import pytest

from jaxrl_mismatch.data.arithmetic import ArithmeticSpec
from jaxrl_mismatch.jobs._inputs import check_warmstart_args
from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_checks import check_model, check_paths, validate


def _config(**fields):
    c = base_config()
    c.model.path = "model"
    for path, value in fields.items():
        *parents, leaf = path.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def _refused(c, *needles, check=validate):
    with pytest.raises(ConfigError) as e:
        check(c)
    for needle in needles:
        assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_warmstart_args_that_do_not_split_are_refused():
    _refused(_config(**{"model.warmstart_args": "--steps '5"}), "config.model.warmstart_args", "No closing quotation")


@pytest.mark.parametrize("args, needle", [("--bogus", "unrecognized arguments: --bogus"),
                                          ("--steps 0", "--steps must be >= 1"),
                                          # exited 0 having trained nothing; the warm start wrote elsewhere
                                          ("--help", "asks for the warm start's help"), ("--hel", "warm start's help"),
                                          ("--steps 1 --out /tmp/elsewhere", "sets the warm start's --out"),
                                          ("--ou=/tmp/elsewhere", "sets the warm start's --out")])
def test_warmstart_args_its_parser_refuses_are_refused_before_the_warm_start(tmp_path, args, needle):
    c = _config(**{"run_dir": str(tmp_path / "run"), "model.path": str(tmp_path / "base"),
                   "model.warmstart_if_missing": True, "model.warmstart_args": args})
    validate(c)
    check_paths(c)
    _refused(c, "config.model.warmstart_args", needle, check=check_warmstart_args)


@pytest.mark.parametrize("field, value", [("seed", 2**70), ("seed", 99999999999), ("seed", 2**31),
                                          ("task.data_seed", 2**31)])
def test_seeds_beyond_int32_are_refused(field, value):
    _refused(_config(**{field: value}), f"config.{field}:", "[0, 2^31)")


def test_the_largest_seed_is_accepted():
    validate(_config(seed=2**31 - 1, **{"task.data_seed": 2**31 - 1}))


@pytest.mark.parametrize("field", ["task.template", "task.val_split", "task.train_split"])
def test_unknown_template_and_splits_are_refused(field):
    _refused(_config(**{field: "bogus"}), f"config.{field}:", "'bogus'")


@pytest.mark.parametrize("value", [5, True, [1, 2]])
def test_task_files_must_be_paths(value, tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text("{}\n")
    c = _config(**{"task.name": "gsm8k"})
    c.task.files = ml_collections.ConfigDict({"train": value, "validation": str(val)})
    _refused(c, "config.task.files.train")


def test_a_directory_as_a_task_file_is_named_as_one(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    c = _config(**{"task.name": "gsm8k", "run_dir": str(tmp_path / "run"), "model.path": str(model)})
    c.task.files = ml_collections.ConfigDict({"train": str(tmp_path), "validation": str(tmp_path)})
    validate(c)
    _refused(c, "config.task.files.train", "is a directory", check=check_paths)


def test_a_dropped_section_or_field_is_a_missing_field():
    c = _config()
    c.log = ml_collections.ConfigDict()
    _refused(c, "config.log.", ": missing field")
    c = _config()
    c.model = ml_collections.ConfigDict({"path": "model"})
    _refused(c, "config.model.warmstart_", ": missing field")


@pytest.mark.parametrize("field", ["optim.lr", "eval.temperature", "rollout.top_p", "rollout.generate_timeout_s",
                                   "diagnostics.weight_distortion_pi_low", "steps"])
def test_none_where_a_number_is_required_is_refused(field):
    c = _config()
    *parents, leaf = field.split(".")
    node = c
    for p in parents:
        node = node[p]
    node[leaf] = None
    _refused(c, f"config.{field}: must be a number, got None")


def test_none_where_the_default_is_none_is_accepted():
    validate(_config(**{"optim.momentum": None, "trainer.exact_forward": None}))


@pytest.mark.parametrize("field", ["rollout.top_k", "rollout.max_tokens", "rollout.group_size", "eval.k"])
def test_ints_sent_as_int32_are_bounded(field):
    _refused(_config(**{field: 1099511627776}), f"config.{field}:", "2147483647")


@pytest.mark.parametrize("field", ["rollout.generate_timeout_s", "rollout.push_timeout_s", "rollout.retry_s",
                                   "rollout.startup_timeout_s", "rollout.stall_timeout_s"])
@pytest.mark.parametrize("value", [1e10, float("inf")])
def test_timeouts_beyond_30_days_are_refused(field, value):
    _refused(_config(**{field: value}), f"config.{field}:", "2592000")


def test_a_30_day_timeout_is_accepted():
    validate(_config(**{"rollout.generate_timeout_s": 2592000.0}))


def _model_cfg(max_position_embeddings=128):
    return types.SimpleNamespace(max_position_embeddings=max_position_embeddings, is_moe=False, head_dim=32,
                                 architecture="Qwen3ForCausalLM")


def test_max_model_len_beyond_the_models_context_is_refused():
    c = _config(**{"rollout.max_model_len": 4096})
    validate(c)
    with pytest.raises(ConfigError, match=r"config\.rollout\.max_model_len: 4096 .*max_position_embeddings 128"):
        check_model(c, _model_cfg())
    check_model(_config(**{"rollout.max_model_len": 128}), _model_cfg())


def test_num_val_beyond_the_tasks_problems_is_refused_before_the_run_dir(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    c = _config(**{"run_dir": str(tmp_path / "run"), "model.path": str(model), "task.num_val": 10_000_000})
    validate(c)
    _refused(c, "config.task.num_val: 10000000", "distinct problems", check=check_paths)
    assert not (tmp_path / "run").exists()


def test_num_train_beyond_the_warm_starts_problems_is_refused(tmp_path):
    c = _config(**{"run_dir": str(tmp_path / "run"), "model.path": str(tmp_path / "base"),
                   "model.warmstart_if_missing": True, "model.warmstart_args": "--max-operands 3 --max-value 1"})
    spec = ArithmeticSpec(min_operands=3, max_operands=3, max_value=1)
    n, k = spec.split_capacity("train"), spec.split_capacity("validation")
    assert (n, k, spec.num_problems) == (72, 15, 72)  # the train split's ~90 % of 72 and 6 sigma; validation's ~5 %
    c.task.num_train, c.task.num_val = n + 1, k
    validate(c)
    check_paths(c)
    _refused(c, f"config.task.num_train: {n + 1}", "'train' split of the task's", check=check_warmstart_args)
    c.task.num_train, c.task.num_val = n, k + 1
    _refused(c, f"config.task.num_val: {k + 1}", f"holds at most {k} (its share of 72 distinct problems)",
             check=check_warmstart_args)
    c.task.num_val = k
    check_warmstart_args(c)


@pytest.mark.parametrize("schedule, kwargs, message", [
    # optim.lr fills the schedule's first value: it was "make_schedule() got multiple values for keyword argument"
    ("step_decay", {"decay_period": 10, "init_value": 1e-3},
     r"config\.optim\.schedule_kwargs: init_value: schedule 'step_decay' takes its init_value from optim\.lr; set "
     r"optim\.lr instead"),
    ("linear_warmup", {"warmup_steps": 10, "peak_value": 1e-3}, r"takes its peak_value from optim\.lr"),
    # a string was "must be real number, not str", naming no argument
    ("linear_warmup", {"warmup_steps": 10, "init_value": "0"}, r"init_value must be a finite number >= 0, got '0'"),
    # likewise for floor / factor / alpha ("'<=' not supported between 'NoneType' and 'float'"); True was 1.0 (no decay)
    ("step_decay", {"decay_period": 10, "floor": None}, r"floor must lie in \(0, 1\], got None"),
    ("step_decay", {"decay_period": 10, "factor": "half"}, r"factor must lie in \(0, 1\), got 'half'"),
    ("step_decay", {"decay_period": 10, "floor": True}, r"floor must lie in \(0, 1\], got True"),
    ("cosine", {"decay_steps": 10, "alpha": "x"}, r"alpha must lie in \[0, 1\], got 'x'"),
    ("cosine", {"decay_steps": 10, "alpha": True}, r"alpha must lie in \[0, 1\], got True"),
])
def test_schedule_kwargs_that_cannot_be_used_are_named(schedule, kwargs, message):
    c = _config(**{"optim.schedule": schedule, "optim.schedule_kwargs": kwargs})
    with pytest.raises(ConfigError, match=message):
        validate(c)


@pytest.mark.parametrize("fields, needles", [
    # gmpo_eps <= 0: every positive-advantage token outside the clip, no gradient from good answers
    ({"objective.preset": "gmpo", "objective.overrides": {"gmpo_eps": -1.0}}, ["gmpo_eps must be a finite number > 0"]),
    # overrides the recipe never reads: the run trained as if they were not given
    ({"objective.preset": "gmpo", "objective.overrides": {"eps_high": 0.28}},
     ["config.objective.overrides.eps_high: 0.28 does nothing here: loss 'gmpo' has no ratio clip range"]),
    ({"objective.preset": "pg", "objective.overrides": {"eps_low": 0.1}},
     ["config.objective.overrides.eps_low: 0.1 does nothing here"]),
    ({"objective.overrides": {"gmpo_eps": 0.3}}, ["overrides.gmpo_eps: 0.3 does nothing here", "loss is 'ppo'"]),
    ({"objective.overrides": {"max_len": 100}}, ["overrides.max_len: 100 does nothing here", "agg is 'token-mean'"]),
    ({"objective.overrides": {"rejection_high": 2.0}},
     ["overrides.rejection_high: 2.0 does nothing here: rejection is 'none'"]),
    ({"controller.name": "length_triggered_decay", "controller.kwargs": {"decay_period": 10, "period_factor": 5.0}},
     ["config.controller.kwargs: period_factor=5.0 does nothing with decay_period=10"]),
    ({"trainer.remat_policy": "save_dots"},
     ["config.trainer.remat_policy: 'save_dots' does nothing with trainer.remat"]),
    ({"diagnostics.weight_distortion_pi_low": 0.9},
     ["config.diagnostics.weight_distortion_pi_low: 0.9 does nothing while the distortion is off"]),
    # the generator's size and seed given to a file task, which uses every record of its files, in order
    ({"task.name": "prompts", "task.files": {"train": "t.jsonl", "validation": "v.jsonl"}, "task.num_train": 5},
     ["config.task.num_train: 5 does nothing for task 'prompts'"]),
    ({"task.name": "prompts", "task.files": {"train": "t.jsonl", "validation": "v.jsonl"}, "task.data_seed": 7},
     ["config.task.data_seed: 7 does nothing for task 'prompts'"]),
    ({"task.num_train": 0}, ["config.task.num_train: must be an integer >= 1, got 0"]),  # was: split 'train' empty
    ({"trainer.mesh": {"data": True}}, ["config.trainer.mesh.data: must be a positive integer or -1, got True"]),
])
def test_options_that_would_change_nothing_are_refused_naming_the_field(fields, needles):
    _refused(_config(**fields), *needles)


def test_the_same_options_where_they_act_are_accepted():
    for fields in ({"objective.preset": "gmpo", "objective.overrides": {"gmpo_eps": 0.3}},
                   {"objective.preset": "drgrpo", "objective.overrides": {"max_len": 100}},
                   {"objective.overrides": {"eps_high": 0.28, "rejection": "ratio_token", "rejection_high": 2.0}},
                   {"objective.preset": "gmpo", "objective.overrides": {"loss": "ppo"}},  # the preset's gmpo_eps unused
                   {"controller.name": "length_triggered_decay", "controller.kwargs": {"decay_period": 10}},
                   # the default, as configs/qwen3_4b_dapo_lr_decay.py writes it out: not a choice that is ignored
                   {"controller.name": "length_triggered_decay",
                    "controller.kwargs": {"decay_period": 10, "period_factor": 1.8}},
                   {"controller.name": "length_triggered_decay", "controller.kwargs": {"period_factor": 5.0}},
                   {"trainer.remat": True, "trainer.remat_policy": "save_dots"},
                   {"diagnostics.weight_distortion_delta": 2.0, "diagnostics.weight_distortion_pi_low": 0.9}):
        validate(_config(**fields))
