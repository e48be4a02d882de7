"""What the job subcommands read from a user's model folder, checked before any work: a damaged config.json,
safetensors file or task.json is one line naming the flag and the file (exit 2), as `train` does for
`config.model.path`; without these checks each surfaced later, as an exit 1 from deep inside a job, or after a
rollout server had started."""

from __future__ import annotations

import os

from typing import TYPE_CHECKING

from jaxrl_mismatch.data.arithmetic import read_task_json
from jaxrl_mismatch.usage import RepeatedOptionError, UsageError, existing_dir

if TYPE_CHECKING:
    from jaxrl_mismatch.models.config import ModelConfig


def model_config(flag: str, path: str, *, weights: bool = True) -> ModelConfig:
    """The `ModelConfig` of the HF checkpoint folder `path` given by `flag`; with `weights`, its safetensors files
    are checked to open and to hold the tensors, of the shapes, that config.json's model has
    (`hf_io.check_model_files`). (Imported here: `--help` of a job imports no JAX.)"""
    from jaxrl_mismatch.models.config import ModelConfig
    from jaxrl_mismatch.models.hf_io import ModelFilesError, check_model_files

    existing_dir(flag, path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"{flag} {path}: no config.json; expected a Hugging Face checkpoint directory")
    try:
        cfg = ModelConfig.from_hf(path)
    except Exception as e:  # noqa: BLE001 - any unreadable config is the user's folder
        raise UsageError(f"{flag} {path}: cannot read config.json ({type(e).__name__}: {e})") from None
    if weights:
        try:
            check_model_files(path, cfg)
        except ModelFilesError as e:
            raise UsageError(f"{flag} {path}: {e}") from None
    return cfg


def task_json(flag: str, path: str) -> tuple[dict, int | None]:
    """(arithmetic spec, max_new_tokens) of the warm-started checkpoint `path`'s task.json (`read_task_json`)."""
    try:
        return read_task_json(path)
    except ValueError as e:
        raise UsageError(f"{flag} {path}: {e}") from None


def check_warmstart_args(c) -> None:
    """When `train` will warm-start (`model.warmstart_if_missing`, no config.json at `model.path`): the folder
    may take it and `model.warmstart_args` pass the warm start's own parser, and the problems asked for fit the
    task it will write — all before any work (an unbalanced quote or `--steps 0` surfaced as exit 1 from the
    warm start). Here, not in `train/config_checks.py`: the parser is the `warmstart` job's (layer 5)."""
    import shlex

    from jaxrl_mismatch.data.arithmetic import ArithmeticSpec
    from jaxrl_mismatch.jobs import warmstart
    from jaxrl_mismatch.outputs import check_out_dir
    from jaxrl_mismatch.train.config import ConfigError
    from jaxrl_mismatch.train.config_checks import check_task_capacity

    if not c.model.warmstart_if_missing or os.path.isfile(os.path.join(c.model.path, "config.json")):
        return
    try:  # as `jobs/train._warmstart` will: only into a new or empty directory (or an earlier warm start's)
        check_out_dir("config.model.path", c.model.path, "warmstart", force=False)
    except UsageError as e:
        raise ConfigError(str(e)) from None
    try:
        args = warmstart.parse_args(["--out", c.model.path, *shlex.split(c.model.warmstart_args)])
        spec = ArithmeticSpec(min_operands=args.min_operands, max_operands=args.max_operands,
                              max_value=args.max_value, mul_prob=args.mul_prob)
    except RepeatedOptionError as e:  # an --out (any spelling) among the options repeats the one given above
        if e.dest == "out":
            raise ConfigError("config.model.warmstart_args: sets the warm start's --out; it writes to "
                              "config.model.path, which train then loads") from None
        raise ConfigError(f"config.model.warmstart_args: {e}") from None
    except (UsageError, ValueError) as e:
        raise ConfigError(f"config.model.warmstart_args: {e}") from None
    except SystemExit:  # --help (or an abbreviation): argparse printed it and exited 0, and train trained nothing
        raise ConfigError(f"config.model.warmstart_args: {c.model.warmstart_args!r} asks for the warm start's help "
                          "(see `jaxrl-mismatch warmstart --help`); give it the warm start's options") from None
    if c.task.name == "arithmetic":
        check_task_capacity(c, spec)
