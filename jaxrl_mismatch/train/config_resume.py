"""What a resumed run may change: the config diff checked against the one saved in the checkpoint.

A run restarted with another config trains something other than the run it continues; `Trainer` refuses it
unless `--accept-config-changes` says so. Fields that only change length, logging, plumbing or memory
(`RESUME_MAY_CHANGE`) are not reported.
"""

from __future__ import annotations

import dataclasses

from jaxrl_mismatch.objectives.policy import objective_config
from jaxrl_mismatch.train.config import FALSE_WORDS, TRUE_WORDS, base_config, flatten

# Fields a resumed run may change without changing what it trains (length, logging, plumbing, memory knobs).
RESUME_MAY_CHANGE = (
    "steps", "resume", "run_dir", "log", "checkpoint", "eval.every", "distributed", "model.warmstart_if_missing",
    "model.warmstart_args", "rollout.address", "rollout.token_file", "rollout.startup_timeout_s",
    "rollout.generate_timeout_s", "rollout.push_timeout_s", "rollout.restart_on_failure", "trainer.mesh",
    "rollout.num_servers", "rollout.stall_timeout_s", "rollout.weight_transport", "rollout.retry_s",
    "trainer.chunk_size", "trainer.remat", "trainer.remat_policy", "trainer.attention_impl", "trainer.packing",
)
_OBJECTIVE_KEYS = ("objective.preset", "objective.overrides")


def _objective(flat: dict) -> dict | None:
    """The objective `objective.preset` and `objective.overrides` make (`objective_config`), None if they do not."""
    overrides = flat.get("objective.overrides") or {}
    try:
        return dataclasses.asdict(objective_config(flat.get("objective.preset", "grpo"), **dict(overrides)))
    except (TypeError, ValueError):
        return None


def config_changes(saved: dict, current: dict) -> list[str]:
    """`field: old → new` for every field that differs and changes what a resumed run trains. A field the saved
    config lacks (added to the schema after the run started) counts only when it is not at its default."""
    old, new, base = flatten(saved), flatten(current), flatten(base_config())
    for flat in (old, new):  # a None-valued field given as text true/false (runs before the parse took words)
        for path, value in flat.items():
            if base.get(path, 0) is None and isinstance(value, str) and value.lower() in TRUE_WORDS + FALSE_WORDS:
                flat[path] = value.lower() in TRUE_WORDS
    # trainer.exact_forward None (its default, also for runs from before the field) follows rollout.exact:
    # compare what each run does, so `None → False` with rollout.exact False is no change.
    for flat in (old, new):
        if flat.get("trainer.exact_forward") is None:
            flat["trainer.exact_forward"] = bool(flat.get("rollout.exact", False))
    # The objective is compared as resolved: an override restating its preset's value (`correction_cap=3.0` where
    # the cap is 3.0) trains the same run and was refused; a real change is still named by preset and overrides.
    if (resolved := _objective(old)) is not None and resolved == _objective(new):
        for flat in (old, new):
            for k in _OBJECTIVE_KEYS:
                flat.pop(k, None)
    # Gradient accumulation gives the same minibatch gradient in smaller pieces, except the MoE load-balancing loss,
    # a product of two means computed per microbatch (docs/models.md).
    if not any(flat.get("objective.router_aux_coef", 0.0) for flat in (old, new)):
        for flat in (old, new):
            flat.pop("batch.microbatches", None)
    if "task.data_seed" not in old and "seed" in old:
        old["task.data_seed"] = old["seed"]  # a run from before the field drew its problems from `seed`
    if new.get("task.name", "arithmetic") != "arithmetic":  # a file task reads neither: its files' records are used
        for flat in (old, new):
            flat.pop("task.num_train", None)
            flat.pop("task.data_seed", None)
    out = []
    for path in sorted(set(old) | set(new)):
        if any(path == p or path.startswith(p + ".") for p in RESUME_MAY_CHANGE):
            continue
        if path not in old and path in base and new.get(path) == base[path]:
            continue  # a field added after the run started, at its default: the run trains as before
        a, b = old.get(path, "<unset>"), new.get(path, "<unset>")
        if _as_saved(a) != _as_saved(b):
            out.append(f"{path}: {a!r} → {b!r}")
    return out


def _as_saved(value):
    """`value` as the checkpoint's JSON gives it back: tuples are lists there (task.files.train = ("a", "b") read
    as a change from ["a", "b"] on every resume of the same config)."""
    if isinstance(value, (list, tuple)):
        return [_as_saved(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_saved(v) for k, v in value.items()}
    return value
