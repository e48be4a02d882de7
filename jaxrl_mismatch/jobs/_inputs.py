"""What the job subcommands read from a user's model folder, checked before any work: a damaged config.json,
safetensors file or task.json is one line naming the flag and the file (exit 2), as `train` does for
`config.model.path`; without these checks each surfaced later, as an exit 1 from deep inside a job, or after a
rollout server had started."""

from __future__ import annotations

import os

from typing import TYPE_CHECKING

from jaxrl_mismatch.data.arithmetic import read_task_json
from jaxrl_mismatch.usage import UsageError, existing_dir

if TYPE_CHECKING:
    from jaxrl_mismatch.models.config import ModelConfig


def model_config(flag: str, path: str, *, weights: bool = True) -> ModelConfig:
    """The `ModelConfig` of the HF checkpoint folder `path` given by `flag`; with `weights`, its safetensors files
    are checked to open too (`hf_io.check_model_files`). (Imported here: `--help` of a job imports no JAX.)"""
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
            check_model_files(path)
        except ModelFilesError as e:
            raise UsageError(f"{flag} {path}: {e}") from None
    return cfg


def task_json(flag: str, path: str) -> tuple[dict, int | None]:
    """(arithmetic spec, max_new_tokens) of the warm-started checkpoint `path`'s task.json (`read_task_json`)."""
    try:
        return read_task_json(path)
    except ValueError as e:
        raise UsageError(f"{flag} {path}: {e}") from None
