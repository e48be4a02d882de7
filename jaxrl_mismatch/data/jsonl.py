"""JSONL reading and writing shared by the dataset tools and `analyze` (kept free of TFDS so samplers and
filters import fast)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence

from jaxrl_mismatch.outputs import staged_file
from jaxrl_mismatch.usage import UsageError, first_line


def write_jsonl(records: Sequence[Mapping], path: str) -> None:
    """Write records as JSONL atomically (a crash never leaves a half-written file under ``path``, and a
    failed write leaves no temporary behind)."""
    write_lines([json.dumps(dict(r), ensure_ascii=False) for r in records], path)


def write_lines(lines: Sequence[str], path: str) -> None:
    """Already-serialised JSONL lines (no newline) to `path`, atomically as `write_jsonl`."""
    with staged_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def with_fields(line: str, fields: Mapping) -> str | None:
    """The JSON object `line` with `fields` appended, its own text kept byte for byte (spacing, escapes, numbers
    a float would round: 12345678901234567890123.0); None when it already has one of them or is no object text."""
    text = line.rstrip()
    if not text.endswith("}") or any(json.dumps(k) in text for k in fields):
        return None
    body = text[:-1].rstrip()
    extra = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items())
    return f"{body}{'' if body.endswith('{') else ', '}{extra}}}"


def json_error(e: ValueError | RecursionError) -> str:
    """What `json.loads` refused, in a few words: a JSONDecodeError's message, else the error's first line (an
    integer longer than Python's 4,300-digit limit is a plain ValueError, nesting past the recursion limit a
    RecursionError; both were tracebacks or messages naming no file)."""
    return e.msg if isinstance(e, json.JSONDecodeError) else first_line(e)


def unpaired_surrogate(obj: object) -> str | None:
    """The first unpaired surrogate escape ("\\ud800") in a parsed JSON value's strings, or None. It is valid JSON
    but no text: the tokenizer (TypeError) and the dataset writer (UnicodeEncodeError) failed on it later, with
    a traceback naming no file or line."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return e.object[e.start:e.end].encode("unicode_escape").decode()
    return None


def iter_jsonl(path: str, flag: str) -> Iterator[tuple[int, object, str]]:
    """(line number, parsed object, the line's text) of each non-blank line of a JSONL file; a line that is not
    JSON is a `UsageError` naming the flag, file and line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(f"{flag} {path}:{lineno}: not UTF-8 (byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as e:  # not JSON, an integer past 4,300 digits, nesting too deep
                raise UsageError(f"{flag} {path}:{lineno}: not JSON ({json_error(e)})") from None
            if (bad := unpaired_surrogate(obj)) is not None:
                raise UsageError(f"{flag} {path}:{lineno}: a string holds the unpaired surrogate escape {bad}, "
                                 "which is not text")
            yield lineno, obj, line


def read_task_file(task: str, path: str, num: int, flag: str = "--file") -> tuple[list[dict], list[dict]]:
    """(uniform records {prompt_text, answer, where}, the original JSON objects) of a file-backed task's JSONL, in
    file order, at most `num` (0: all) — what `perfectible` filters and `analyze rollouts --task` samples. `where`
    is "FLAG path:line", what an error about the record (its prompt's tokens) names. A gold answer the task's
    reward cannot read is refused here, naming file and line (it raised in the reward after a server started)."""
    from jaxrl_mismatch.data import get_task
    from jaxrl_mismatch.data.math_datasets import CONVERTERS, DataFormatError
    from jaxrl_mismatch.data.rewards import check_gold_answer

    fmt = {"arithmetic_prompts": "prompts"}.get(task, task)
    if fmt not in CONVERTERS:
        raise UsageError(f"--task {task}: not a file-backed task; valid: arithmetic, {', '.join(sorted(CONVERTERS))}")
    records, originals = [], []
    for lineno, obj, line in iter_jsonl(path, flag):
        if not isinstance(obj, dict):
            raise UsageError(f"{flag} {path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        try:
            text, answer, _ = CONVERTERS[fmt](obj, f"{path}:{lineno}")
        except DataFormatError as e:
            raise UsageError(f"{flag} {e}") from None
        try:
            check_gold_answer(get_task(task).reward_name, answer)
        except ValueError as e:
            raise UsageError(f"{flag} {path}:{lineno}: {e}") from None
        records.append({"prompt_text": text, "answer": answer, "where": f"{flag} {path}:{lineno}", "text": line})
        originals.append(obj)
        if num and len(records) == num:
            break
    return records, originals
