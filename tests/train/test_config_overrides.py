"""Dotted overrides of every documented field, open sections included, reach the objects built from them."""

from __future__ import annotations

import pytest

from jaxrl_mismatch.train.config import ConfigError, base_config
from jaxrl_mismatch.train.config_overrides import apply_override, load_config
from jaxrl_mismatch.train.config_resume import config_changes
from jaxrl_mismatch.train.optimizer import build_controller, build_schedule

CONFIG = "configs/tiny_cpu.py"


def test_controller_kwargs_override_reaches_the_controller():
    c = load_config(CONFIG, [("controller.kwargs.surge_ratio", "2.5"), ("controller.kwargs.floor", "0.2")])
    ctrl = build_controller(c.controller)
    assert ctrl.surge_ratio == 2.5 and ctrl.floor == 0.2
    assert c.controller.kwargs.window == 5  # what the file set is kept


def test_schedule_kwargs_override_reaches_the_schedule():
    c = load_config(CONFIG, [("optim.schedule", "cosine"), ("optim.schedule_kwargs.decay_steps", "100"),
                             ("optim.lr", "2e-4")])
    sched = build_schedule(c.optim)
    assert float(sched(0)) == pytest.approx(2e-4)
    assert float(sched(100)) == pytest.approx(0.0, abs=1e-12)
    assert float(sched(50)) == pytest.approx(1e-4, rel=1e-5)


def test_objective_overrides_reach_the_objective():
    from jaxrl_mismatch.train.learner_config import build_policy_loss

    c = load_config(CONFIG, [("objective.overrides.eps_high", "0.31"), ("objective.overrides.dual_clip", "3.0"),
                             ("objective.preset", "dapo")])
    obj = build_policy_loss(c)
    assert obj.cfg.eps_high == 0.31 and obj.cfg.dual_clip == 3.0
    assert obj.cfg.correction == "token_tis"  # set by the config file, kept


def test_values_parse_by_field_type():
    c = base_config()
    apply_override(c, "batch.dynamic_sampling", "false")
    apply_override(c, "steps", "7")
    apply_override(c, "optim.lr", "3e-5")
    apply_override(c, "task.files.train", "/data/train.jsonl")
    apply_override(c, "trainer.mesh.fsdp", "2")
    assert (c.batch.dynamic_sampling, c.steps, c.optim.lr, c.task.files.train, c.trainer.mesh.fsdp) == (
        False, 7, 3e-5, "/data/train.jsonl", 2)
    for path, text, needle in [("steps", "1.5", "integer"), ("optim.lr", "nan", "finite"),
                               ("batch.dynamic_sampling", "2", "true or false"), ("optim.lr.x", "1", "not a section"),
                               ("optim", "1", "config.optim"), ("nope", "1", "unknown field")]:
        with pytest.raises(ConfigError, match=needle):
            apply_override(c, path, text)


def test_resume_of_a_run_from_before_task_data_seed_keeps_its_problems():
    """Runs saved before `task.data_seed` existed generated their problems from `seed`: resuming one with
    another seed under the new default (0) would train and validate on other problems, so it is a change."""
    saved, current = base_config().to_dict(), base_config()
    del saved["task"]["data_seed"]
    assert config_changes(saved, current.to_dict()) == []  # seed 0: the same problems as before
    saved["seed"] = current.seed = 3
    assert config_changes(saved, current.to_dict()) == ["task.data_seed: 3 → 0"]
    current.task.data_seed = 3
    assert config_changes(saved, current.to_dict()) == []


def test_resume_changes_list_only_fields_that_change_the_run():
    a, b = base_config(), base_config()
    b.steps, b.log.progress, b.eval.every, b.trainer.mesh.fsdp = 999, False, 3, 2  # may change
    assert config_changes(a.to_dict(), b.to_dict()) == []
    b.optim.lr = 1e-4
    b.objective.preset = "dapo"
    b.controller.kwargs.surge_ratio = 2.0
    changes = config_changes(a.to_dict(), b.to_dict())
    assert changes == ["controller.kwargs: {} → {'surge_ratio': 2.0}", "objective.preset: 'grpo' → 'dapo'",
                       "optim.lr: 1e-06 → 0.0001"]


def test_optimizer_hyperparameters_reach_the_update_or_are_refused_by_name():
    """`config.optim` holds every optimizer's hyperparameters; the chosen one takes only its own. One it does
    not take (adam's weight decay, sgd's betas) trained as if unset: now it is refused naming it, and sgd's
    `momentum` is a field whose value reaches the update."""
    import jax.numpy as jnp
    import optax

    from jaxrl_mismatch.train.config_checks import validate
    from jaxrl_mismatch.train.optimizer import build_optimizer

    def two_steps(optim):
        opt, params = build_optimizer(optim), {"w": jnp.ones(3)}
        state = opt.init(params)
        for _ in range(2):
            updates, state = opt.update({"w": jnp.array([1.0, -2.0, 0.5])}, state, params)
            params = optax.apply_updates(params, updates)
        return params["w"]

    c = load_config(CONFIG, [("optim.name", "sgd"), ("optim.lr", "0.1")])
    plain = two_steps(c.optim)
    apply_override(c, "optim.momentum", "0.9")
    assert c.optim.momentum == 0.9
    assert not jnp.allclose(two_steps(c.optim), plain)  # heavy-ball momentum moves the second step
    for name, field, value in [("adam", "weight_decay", "0.5"), ("sgd", "b1", "0.5"), ("adamw", "momentum", "0.9")]:
        c = load_config(CONFIG, [("optim.name", name), (f"optim.{field}", value)])
        with pytest.raises(ConfigError, match=rf"^config\.optim: {field} = .* does nothing for optimizer '{name}'"):
            validate(c)
    validate(load_config(CONFIG, [("optim.name", "adam")]))  # adamw's default weight decay, left alone: fine


def test_a_none_valued_field_takes_true_false_words_as_booleans_and_a_resume_sees_one_value():
    """`trainer.exact_forward` defaults to None, so its command-line text was kept as the string 'false': a run
    started with `=false` and resumed with `=False` was refused as a config change ('false' → False)."""
    c = base_config()
    apply_override(c, "trainer.exact_forward", "false")
    assert c.trainer.exact_forward is False
    apply_override(c, "trainer.exact_forward", "True")
    assert c.trainer.exact_forward is True
    apply_override(c, "optim.momentum", "0.5")
    assert c.optim.momentum == 0.5  # numbers stay numbers
    # 1 / 0, which every boolean field takes, arrive as ints: taken as True / False, not refused
    from jaxrl_mismatch.train.config import exact_forward_enabled
    from jaxrl_mismatch.train.config_checks import validate

    for text, on in (("1", True), ("0", False)):
        d = base_config()
        d.model.path = "x"
        apply_override(d, "trainer.exact_forward", text)
        validate(d)
        assert exact_forward_enabled(d) is on
    apply_override(d, "trainer.exact_forward", "2")
    with pytest.raises(ConfigError, match=r"exact_forward: must be None, True or False \(or 1 / 0\), got 2"):
        validate(d)
    saved = base_config().to_dict()
    saved["trainer"]["exact_forward"] = "false"  # as a run before this fix saved it
    current = base_config()
    current.trainer.exact_forward = False
    assert config_changes(saved, current.to_dict()) == []
    current.trainer.exact_forward = True
    assert config_changes(saved, current.to_dict()) == ["trainer.exact_forward: False → True"]


def test_a_resume_compares_the_objective_as_resolved_and_takes_another_microbatch_count():
    """`objective.overrides.correction_cap=3.0` restating the cap its correction already had was refused as a
    change, and so was `batch.microbatches` (gradient accumulation: the same minibatch gradient)."""
    from jaxrl_mismatch.objectives.policy import objective_config

    a, b = base_config(), base_config()
    a.objective.overrides.correction = b.objective.overrides.correction = "token_tis"
    b.objective.overrides.correction_cap = objective_config("grpo", correction="token_tis").correction_cap
    b.batch.microbatches = 4
    assert config_changes(a.to_dict(), b.to_dict()) == []
    b.objective.overrides.correction_cap = 5.0  # a real change is still named by what was given
    assert config_changes(a.to_dict(), b.to_dict()) == [
        "objective.overrides: {'correction': 'token_tis'} → {'correction': 'token_tis', 'correction_cap': 5.0}"]
    b.objective.overrides.correction_cap = 3.0
    a.objective.router_aux_coef = b.objective.router_aux_coef = 0.001  # the MoE aux loss is per microbatch
    assert config_changes(a.to_dict(), b.to_dict()) == ["batch.microbatches: 1 → 4"]


def test_a_dict_for_a_fixed_section_parses_each_field_by_its_type_and_keeps_the_others():
    """`--config.batch="{'dynamic_sampling': 'false'}"` stored the string, which the loop read as true; a field not
    given disappeared from the section."""
    c = load_config(CONFIG, [("batch", "{'dynamic_sampling': 'false', 'prompts_per_step': 3}"),
                             ("eval", "{'greedy': 'no', 'k': '4'}"),
                             ("optim", "{'lr': 1, 'schedule_kwargs': {'decay_period': 5}}")])
    assert c.batch.dynamic_sampling is False and c.batch.prompts_per_step == 3
    assert c.batch.ppo_epochs == base_config().batch.ppo_epochs  # not given: kept
    assert (c.eval.greedy, c.eval.k, c.optim.lr) == (False, 4, 1.0) and isinstance(c.optim.lr, float)
    assert c.optim.schedule_kwargs.to_dict() == {"decay_period": 5}  # an open section takes the dict as it is
    for text, needle in [("{'prompts_per_step': True}", "config.batch.prompts_per_step: expected an integer"),
                         ("{'prompts_per_step': 2.5}", "config.batch.prompts_per_step: expected an integer"),
                         ("{'dynamic_sampling': 'maybe'}", "config.batch.dynamic_sampling: expected true or false"),
                         ("{'nope': 1}", "config.batch.nope: unknown field")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(CONFIG, [("batch", text)])
    with pytest.raises(ConfigError, match="config.rollout.address: expected a string, got None"):
        load_config(CONFIG, [("rollout", "{'address': None}")])


def test_a_flag_is_never_taken_as_the_value_of_the_one_before_it():
    from jaxrl_mismatch.train.config_overrides import parse_overrides
    from jaxrl_mismatch.usage import UsageError

    # run_dir became '--config.steps=5' and the steps override was lost
    with pytest.raises(UsageError, match=r"^train: --config.run_dir needs a value"):
        parse_overrides(["--config.run_dir", "--config.steps=5"], "train")
    # a value may start with '--' (the warm start's own flags)
    assert parse_overrides(["--config.model.warmstart_args", "--steps 40"], "train") == [
        ("model.warmstart_args", "--steps 40")]


def test_a_frozen_config_file_takes_overrides(tmp_path):
    (tmp_path / "frozen.py").write_text(
        "import ml_collections\nfrom jaxrl_mismatch.train.config import base_config\n"
        "def get_config():\n    return ml_collections.FrozenConfigDict(base_config())\n")
    c = load_config(str(tmp_path / "frozen.py"), [("steps", "4")])  # was AttributeError: immutable (exit 1)
    assert c.steps == 4


def test_a_file_tasks_resume_ignores_the_generators_size_and_seed():
    """A file task reads neither task.num_train nor task.data_seed (both are refused in its config now): a run saved
    before task.data_seed existed, with seed 3, resumed as `task.data_seed: 3 → 0`, and the documented fix
    (--config.task.data_seed=3) is refused for a file task."""
    saved, current = base_config().to_dict(), base_config()
    for c in (saved["task"], current.task):
        c["name"], c["files"] = "prompts", {"train": "t.jsonl", "validation": "v.jsonl"}
    del saved["task"]["data_seed"]
    saved["seed"] = current.seed = 3
    saved["task"]["num_train"] = 500
    assert config_changes(saved, current.to_dict()) == []


def test_a_resume_of_a_config_holding_a_tuple_sees_no_change():
    """The checkpoint's JSON gives a tuple back as a list: every resume of the same config was refused."""
    import json

    c = base_config()
    c.task.files.train = ("a.jsonl", "b.jsonl")
    c.controller.kwargs = {"window": (1, 2)}
    saved = json.loads(json.dumps(c.to_dict()))
    assert saved["task"]["files"]["train"] == ["a.jsonl", "b.jsonl"]
    assert config_changes(saved, c.to_dict()) == []
    c.task.files.train = ("a.jsonl", "c.jsonl")
    assert [x.split(":")[0] for x in config_changes(saved, c.to_dict())] == ["task.files"]
