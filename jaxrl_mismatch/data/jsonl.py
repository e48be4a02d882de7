"""JSONL writing shared by the dataset tools (kept free of TFDS so samplers and filters import fast)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence


def write_jsonl(records: Sequence[Mapping], path: str) -> None:
    """Write records as JSONL atomically (a crash never leaves a half-written file under ``path``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(dict(r), ensure_ascii=False) + "\n")
    os.replace(tmp, path)
