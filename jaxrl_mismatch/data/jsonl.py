"""JSONL writing shared by the dataset tools (kept free of TFDS so samplers and filters import fast)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from jaxrl_mismatch.outputs import staged_file


def write_jsonl(records: Sequence[Mapping], path: str) -> None:
    """Write records as JSONL atomically (a crash never leaves a half-written file under ``path``, and a
    failed write leaves no temporary behind)."""
    with staged_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(dict(r), ensure_ascii=False) + "\n")
