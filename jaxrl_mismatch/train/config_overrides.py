"""Loading a config file and overriding its fields from the command line (`--config.optim.lr=1e-6`).

The text of an override is parsed by the type of the field it replaces, so `--config.steps=1e3` is an error
naming `config.steps` rather than a float where an int belongs; a field the schema lacks is an error with
the nearest known name (`train/config.py`). Nothing here validates values: `train/config_checks.validate`.
"""

from __future__ import annotations

import ast
import math
from typing import Any, Sequence

import ml_collections

from jaxrl_mismatch.train.config import FALSE_WORDS, OPEN_SECTIONS, TRUE_WORDS, ConfigError, flatten, unknown_field
from jaxrl_mismatch.usage import UsageError, call_file_function


def load_config(path: str, overrides: Sequence[tuple[str, str]] = ()) -> ml_collections.ConfigDict:
    """`get_config()` of the Python file `path` (`path:ARG` passes ARG), then `--config.a.b=value` overrides.

    Values are parsed by the type of the field they replace (bool: true/false/1/0/yes/no); a key new to
    an open section (`OPEN_SECTIONS`) is parsed as a Python literal, else kept as a string. A dict given for a
    fixed section (`--config.batch="{'dynamic_sampling': False}"`) sets the fields it names, each parsed by its
    type, and keeps the others; one given for an open section replaces it. A `FrozenConfigDict` is thawed.
    """
    file, _, arg = path.partition(":")
    c = call_file_function(file, "get_config", f"--config {file}", *([arg] if arg else []))
    if not isinstance(c, ml_collections.ConfigDict):
        raise UsageError(f"--config {file}: get_config() returned {type(c).__name__}, not an ml_collections.ConfigDict")
    if isinstance(c, ml_collections.FrozenConfigDict):  # immutable: every override was an AttributeError (exit 1)
        c = c.as_configdict()
    for dotted, text in overrides:
        apply_override(c, dotted, text)
    return c


def parse_overrides(args: Sequence[str], prog: str) -> list[tuple[str, str]]:
    """(`a.b`, text) of each `--config.a.b=text` or `--config.a.b text` in `args` (the command line after the
    flags); UsageError naming `prog` for anything else or a missing value. `train` and the launchers read one way."""
    overrides, it = [], iter(args)
    for item in it:
        if not item.startswith("--config."):
            raise UsageError(f"{prog}: unrecognised argument {item!r} (see --help)")
        key, eq, value = item[len("--config."):].partition("=")
        if not eq:
            value = next(it, None)
            # `--config.run_dir --config.steps=5`: the next flag is no value (a value may start with "--", as
            # model.warmstart_args does, but not with "--config.")
            if value is None or value.startswith("--config."):
                raise UsageError(f"{prog}: --config.{key} needs a value (--config.{key}=VALUE)")
        overrides.append((key, value))
    return overrides


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _parse_as(text: str, old: Any, field: str) -> Any:
    """`text` as a value of `old`'s type; ConfigError naming the field otherwise."""
    def bad(kind: str) -> ConfigError:
        return ConfigError(f"config.{field}: expected {kind}, got {text!r}")

    if isinstance(old, bool):
        if text.lower() in TRUE_WORDS:
            return True
        if text.lower() in FALSE_WORDS:
            return False
        raise bad("true or false")
    if isinstance(old, int):
        try:
            return int(text)
        except ValueError:
            raise bad("an integer") from None
    if isinstance(old, float):
        try:
            value = float(text)
        except ValueError:
            raise bad("a number") from None
        if not math.isfinite(value):
            raise bad("a finite number")
        return value
    if isinstance(old, str):
        return text
    value = _literal(text)
    if isinstance(old, (tuple, list)):
        if not isinstance(value, (tuple, list)):
            raise bad("a list such as [1, 2]")
        return type(old)(value)
    if isinstance(old, (dict, ml_collections.ConfigDict)):
        if not isinstance(value, dict):
            raise bad("a dict such as {'key': 1}")
        if isinstance(old, ml_collections.ConfigDict) and field not in OPEN_SECTIONS:
            return _section_update(old, value, field)
        return ml_collections.ConfigDict(value)
    if isinstance(value, str) and value.lower() in TRUE_WORDS + FALSE_WORDS:
        # None-valued fields: a bare true/false word is a bool (a string 'false' would be truthy, and a resume
        # would see 'false' and False as two configs); numbers stay numbers (literal_eval took '1' as 1).
        return value.lower() in TRUE_WORDS
    return value  # None-valued fields: any literal


def _section_update(old: ml_collections.ConfigDict, value: dict, field: str) -> ml_collections.ConfigDict:
    """A fixed section (`--config.batch="{'dynamic_sampling': False}"`) with the given fields replaced, each parsed
    by its field's type as its own override would be (the string 'false' was stored, and read as true); the fields
    not given keep their values."""
    new = ml_collections.ConfigDict(old.to_dict())
    for key, v in value.items():
        dotted = f"{field}.{key}"
        if not isinstance(key, str) or key not in old:
            raise unknown_field(dotted, [f"{field}.{k}" for k in flatten(old)])
        if isinstance(old[key], str) and not isinstance(v, str):
            raise ConfigError(f"config.{dotted}: expected a string, got {v!r}")
        new[key] = _parse_as(v if isinstance(v, str) else repr(v), old[key], dotted)
    return new


def apply_override(c: ml_collections.ConfigDict, dotted: str, text: str) -> None:
    """Set `config.<dotted>` from the command-line text `text` (see `load_config`)."""
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"config.{dotted}: malformed field name")
    node = c
    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if part not in node:
            raise unknown_field(here, list(flatten(c)))
        node = node[part]
        if not isinstance(node, ml_collections.ConfigDict):
            raise ConfigError(f"config.{here}: is a value, not a section; cannot set config.{dotted}")
    key, section = parts[-1], ".".join(parts[:-1])
    if key in node:
        value = _parse_as(text, node[key], dotted)
    elif section in OPEN_SECTIONS:
        value = _literal(text)
    else:
        raise unknown_field(dotted, list(flatten(c)))
    with node.unlocked():
        try:
            node[key] = value
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config.{dotted}: {e}") from None
