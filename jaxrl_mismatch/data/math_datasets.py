"""TFDS builders over local JSONL files in the GSM8K, MATH and DAPO-Math-17k formats.

Why TFDS: a built dataset is a versioned, checksummed set of ``array_record`` files with random
access (``builder.as_data_source(split)``), readable by grain and by ``tfds.data_source`` on every host
of a pod without TensorFlow. Why local JSONL: no network at run time; users convert once
(``pandas.read_parquet(p).to_json(out, orient="records", lines=True)`` for the HF parquet releases).

Every format is mapped to one uniform record::

    {"prompt_text": str, "answer": str, "index": int, "extra": str (JSON)}

``prompt_text`` is the question as the dataset states it (no template: apply one from
:mod:`templates` when building prompts), ``answer`` the gold final answer compared by
:func:`rewards.math_reward`, ``index`` the record's 0-based position in its split, the split's files
taken in the order given (records come back in hashed-key order; sort by ``index`` for file order, as
``BuiltDataset.records`` does), ``extra`` any other fields.

Formats (one JSON object per line):

- ``gsm8k``: ``{"question", "answer"}``; the gold answer is the text after ``####`` in ``answer``.
- ``math``: ``{"problem", "solution"}`` (Hendrycks MATH); the gold answer is the ``answer`` field when
  present (MATH-500 has one; a string or a number), else the last ``\\boxed{}`` of ``solution``.
- ``dapo``: DAPO-Math-17k (``BytedTsinghua-SIA/DAPO-Math-17k``, the verl RL format), as we understand
  it: ``{"data_source", "prompt": [{"role": "user", "content": ...}], "ability",
  "reward_model": {"ground_truth": ..., "style": "rule-lax"}, "extra_info": {"index": ...}}``. The
  prompt is the content of the last ``user`` message *including* DAPO's own instruction ("... the
  last line of your response should be of the form Answer: $Answer ..."); use template ``dapo``. A
  plain-string ``prompt`` is accepted too.
- ``prompts``: our own uniform ``{"prompt_text", "answer", ...}`` (e.g. the perfectible subset).

A builder's config name is a fingerprint of the records it stores (each split's records as this code
converts them), so editing a JSONL file, or a change to a converter, builds a new dataset instead of
silently reading the stale one. A build holds a file lock in ``data_dir``: two processes that build the
same dataset at once (the processes of a multi-host job, two runs sharing ``task.data_dir``) build it once.
"""

from __future__ import annotations

import dataclasses
import decimal
import fcntl
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from jaxrl_mismatch.data.jsonl import json_error, unpaired_surrogate
from jaxrl_mismatch.data.rewards import gsm8k_final_answer, last_boxed

Record = dict[str, object]


class _ExpectedConfigNotice(logging.Filter):
    """Drops TFDS's "Using custom data configuration" warning: every dataset here is built from a custom config (the
    user's files), so it says nothing, and it came before a one-line data error on stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Using custom data configuration")


logging.getLogger("absl").addFilter(_ExpectedConfigNotice())


class DataFormatError(ValueError):
    """A JSONL line that does not match its declared format; the message names file, line and field."""


def _field(obj: Mapping, key: str, where: str, fmt: str, kind: type | tuple[type, ...] = str) -> object:
    if key not in obj:
        raise DataFormatError(f"{where}: missing field {key!r} ({fmt} format needs it; found {sorted(obj)})")
    value = obj[key]
    if not isinstance(value, kind):
        raise DataFormatError(f"{where}: field {key!r} should be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _text(obj: Mapping, key: str, where: str, fmt: str) -> str:
    """A prompt field: a string with something in it. An empty prompt reached the rollout server (no tokens at
    all where the tokenizer adds no BOS) and failed the run there; a blank one asks the policy nothing."""
    value = _field(obj, key, where, fmt)
    if not value.strip():
        raise DataFormatError(f"{where}: field {key!r} is empty")
    return value


def _answer_text(value: object, where: str, key: str) -> str:
    """A gold answer given as a JSON scalar, as text: a non-empty string, or a number (`5`, `0.5`). A boolean, a
    NaN or an infinity, a list or an object is no answer any reward reads (`true` became the answer "True"). A
    number is written out positionally (`1e20` as 100000000000000000000)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataFormatError(f"{where}: field {key!r} should be a string or a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise DataFormatError(f"{where}: field {key!r} is {value}, not an answer")
    if not str(value).strip():  # the reward raises on it, at whatever step first samples the prompt
        raise DataFormatError(f"{where}: field {key!r} is empty")
    if isinstance(value, float):  # positional: math-verify read str(1e20) = "1e+20" as Euler's number e + 20
        return format(decimal.Decimal(repr(value)), "f")
    return str(value)


def _convert_gsm8k(obj: Mapping, where: str) -> tuple[str, str, dict]:
    question = _text(obj, "question", where, "gsm8k")
    solution = _field(obj, "answer", where, "gsm8k")
    try:
        answer = gsm8k_final_answer(solution)
    except ValueError as e:
        raise DataFormatError(f"{where}: field 'answer': {e}") from None
    return question, answer, {k: v for k, v in obj.items() if k != "question"}


def _convert_math(obj: Mapping, where: str) -> tuple[str, str, dict]:
    """The `answer` field wins when it holds one (a string or a number, as MATH-500's); a missing, null or blank
    `answer` falls back to the last \\boxed{} of `solution`. A number was ignored for the solution's box (and
    without a solution the record was refused); any other type is refused by name."""
    problem = _text(obj, "problem", where, "math")
    given = obj.get("answer")
    if given is not None and not (isinstance(given, str) and not given.strip()):
        answer = _answer_text(given, where, "answer").strip()
    else:
        solution = _field(obj, "solution", where, "math")
        answer = last_boxed(solution)
        if answer is None or not answer.strip():
            raise DataFormatError(f"{where}: field 'solution' has no complete \\boxed{{...}} final answer")
    return problem, answer, {k: v for k, v in obj.items() if k != "problem"}


def _convert_dapo(obj: Mapping, where: str) -> tuple[str, str, dict]:
    prompt = _field(obj, "prompt", where, "dapo", (list, str))
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        if not users or not isinstance(users[-1].get("content"), str):
            raise DataFormatError(f"{where}: field 'prompt' has no user message with string 'content'")
        prompt = users[-1]["content"]
    if not prompt.strip():
        raise DataFormatError(f"{where}: field 'prompt' is empty")
    rm = _field(obj, "reward_model", where, "dapo", Mapping)
    truth = rm.get("ground_truth")
    if isinstance(truth, list) and len(truth) == 1:  # some verl exports wrap it in a list
        truth = truth[0]
    if truth is None or isinstance(truth, (list, Mapping)):
        raise DataFormatError(f"{where}: field 'reward_model.ground_truth' missing or not a scalar answer")
    truth = _answer_text(truth, where, "reward_model.ground_truth")
    return prompt, truth.strip(), {k: v for k, v in obj.items() if k not in ("prompt", "reward_model")}


def _convert_prompts(obj: Mapping, where: str) -> tuple[str, str, dict]:
    text = _text(obj, "prompt_text", where, "prompts")
    answer = _answer_text(_field(obj, "answer", where, "prompts", object), where, "answer")
    return text, answer, {k: v for k, v in obj.items() if k not in ("prompt_text", "answer")}


CONVERTERS: dict[str, Callable[[Mapping, str], tuple[str, str, dict]]] = {
    "gsm8k": _convert_gsm8k,
    "math": _convert_math,
    "dapo": _convert_dapo,
    "prompts": _convert_prompts,
}


def read_jsonl(path: str, fmt: str) -> Iterator[Record]:
    """Parse ``path`` in format ``fmt`` into uniform records, raising :class:`DataFormatError` with
    ``path:line`` on the first bad line (empty lines are skipped)."""
    if fmt not in CONVERTERS:
        raise ValueError(f"unknown data format {fmt!r}; valid: {sorted(CONVERTERS)}")
    convert = CONVERTERS[fmt]
    for lineno, where, line in _lines(path):
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:  # see jsonl.json_error
            at = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
            raise DataFormatError(f"{where}: not valid JSON ({json_error(e)}{at})") from None
        if not isinstance(obj, dict):
            raise DataFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if (bad := unpaired_surrogate(obj)) is not None:
            raise DataFormatError(f"{where}: a string holds the unpaired surrogate escape {bad}, which is not text")
        text, answer, extra = convert(obj, where)
        yield {"prompt_text": text, "answer": answer, "index": lineno - 1, "extra": json.dumps(extra, sort_keys=True)}


def _lines(path: str) -> Iterator[tuple[int, str, str]]:
    """(line number, "path:line", text) of each non-blank line, one record each (`read_jsonl`); a line that is
    not UTF-8 is a DataFormatError naming file and line."""
    try:
        f = open(path, "rb")
    except OSError as e:  # unreadable (permissions), a directory, ...: the file named, one line
        raise DataFormatError(f"{path}: cannot read it ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataFormatError(f"{where}: not UTF-8 (byte {e.start} of the line)") from None
            if line.strip():
                yield lineno, where, line


def _fingerprint(fmt: str, records: Mapping[str, Sequence[Record]]) -> str:
    """The config name of a build: a hash of what it stores, so a converter that now reads a file differently
    (another gold answer, another numbering) builds anew instead of reading the records an older one wrote."""
    h = hashlib.sha256(fmt.encode())
    for split in sorted(records):
        h.update(json.dumps(split).encode())
        for rec in records[split]:
            h.update(json.dumps(rec, sort_keys=True).encode())
    return "rec_" + h.hexdigest()[:16]


_SPLIT_NAME = re.compile(r"^\w+$", re.ASCII)


def _normalise_files(files: Mapping[str, str | Sequence[str]]) -> dict[str, list[str]]:
    out = {}
    for split, paths in files.items():
        if not isinstance(split, str) or not _SPLIT_NAME.match(split):  # checked before anything is built
            raise ValueError(f"split {split!r}: a split name is letters, digits and _ (TFDS reads '[', ':', '+' "
                             "and spaces as slicing; the whole dataset was built before it was refused)")
        paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        if not paths:
            raise ValueError(f"split {split!r}: no JSONL files given")
        for p in paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"split {split!r}: JSONL file {p} does not exist")
        out[split] = [os.fspath(p) for p in paths]
    if not out:
        raise ValueError("no splits given: pass files={'train': 'path.jsonl', ...}")
    return out


class _LocalDatasetInfo(tfds.core.DatasetInfo):
    """A ``DatasetInfo`` that never looks for pre-computed info on GCS: these datasets are built from local files.

    TFDS's ``initialize_from_bucket`` (called on the first build, before ``dataset_info.json`` exists) makes a
    ``tempfile.mkdtemp("tfds")`` folder before it finds GCS disabled, and never removes it: one empty folder left
    in the system temp directory per dataset built. There is nothing on GCS to load, so nothing is done.
    """

    def initialize_from_bucket(self) -> None:
        return None


class _JsonlBuilderMixin:
    """Shared body of the four builders (a mixin, so TFDS registers only the concrete classes)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "uniform {prompt_text, answer, index, extra} records from local JSONL"}
    FORMAT = ""
    # TFDS locates checksum files next to a builder's code through importlib resources, which needs the
    # `importlib_resources` backport for non-TFDS packages; we download nothing, so point at this file.
    code_path = epath.Path(__file__)

    def __init__(self, *, files: Mapping[str, Sequence[str]], records: Mapping[str, Sequence[Record]], data_dir: str,
                 **kwargs):
        """`records`: each split's converted records (`build` reads and checks them); the config name is their
        `_fingerprint`."""
        self._files, self._records = files, records
        config = tfds.core.BuilderConfig(name=_fingerprint(self.FORMAT, records),
                                         description=f"{self.FORMAT} JSONL: {dict(files)}")
        super().__init__(data_dir=data_dir, config=config, file_format="array_record", **kwargs)

    def _info(self):
        return _LocalDatasetInfo(
            builder=self,
            description=f"{self.FORMAT} problems from local JSONL files, as uniform prompt/answer records.",
            features=tfds.features.FeaturesDict(
                {
                    "prompt_text": tfds.features.Text(),
                    "answer": tfds.features.Text(),
                    "index": tfds.features.Scalar(dtype=np.int64),
                    "extra": tfds.features.Text(),
                }
            ),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # local files only
        return {split: self._generate_examples(recs) for split, recs in self._records.items()}

    def _generate_examples(self, records):
        # The records `build` read and checked (and fingerprinted): the files are read once.
        for rec in records:
            yield str(rec["index"]), rec


class Gsm8kJsonl(_JsonlBuilderMixin, tfds.core.GeneratorBasedBuilder):
    """GSM8K-format JSONL (``question``, ``answer`` with ``#### N``); TFDS name ``gsm8k_jsonl``."""

    FORMAT = "gsm8k"


class MathJsonl(_JsonlBuilderMixin, tfds.core.GeneratorBasedBuilder):
    """MATH-format JSONL (``problem``, ``solution`` with ``\\boxed{}``); TFDS name ``math_jsonl``."""

    FORMAT = "math"


class DapoMathJsonl(_JsonlBuilderMixin, tfds.core.GeneratorBasedBuilder):
    """DAPO-Math-17k-format JSONL (chat ``prompt``, ``reward_model.ground_truth``); TFDS name ``dapo_math_jsonl``."""

    FORMAT = "dapo"


class PromptsJsonl(_JsonlBuilderMixin, tfds.core.GeneratorBasedBuilder):
    """Our uniform ``{prompt_text, answer}`` JSONL (e.g. a perfectible subset); TFDS name ``prompts_jsonl``."""

    FORMAT = "prompts"


BUILDERS: dict[str, type] = {b.FORMAT: b for b in (Gsm8kJsonl, MathJsonl, DapoMathJsonl, PromptsJsonl)}


def builder_class(fmt: str) -> type:
    """The TFDS builder class of a data format."""
    if fmt not in BUILDERS:
        raise ValueError(f"unknown data format {fmt!r}; valid: {sorted(BUILDERS)}")
    return BUILDERS[fmt]


@dataclasses.dataclass(frozen=True)
class BuiltDataset:
    """A prepared dataset: the TFDS builder, its splits, and each split's record locations in file order
    ("path:line", from `build`'s validation pass: what an error about a record names)."""

    builder: object
    splits: tuple[str, ...]
    locations: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        """``builder/config`` — what ``tfds.data_source(name, data_dir=..., split=...)`` takes on any host."""
        return f"{self.builder.name}/{self.builder.builder_config.name}"

    def data_source(self, split: str):
        """Random-access source (``len``, ``[i]``) of raw TFDS examples (text fields as bytes)."""
        if split not in self.splits:
            raise ValueError(f"split {split!r} not in dataset (has {self.splits})")
        return self.builder.as_data_source(split)

    def records(self, split: str) -> list[Record]:
        """All records of ``split`` decoded to ``str``, sorted by source ``index`` (file order)."""
        src = self.data_source(split)
        out = [_decode(src[i]) for i in range(len(src))]
        return sorted(out, key=lambda r: r["index"])


def _decode(ex: Mapping) -> Record:
    def s(v):
        return v.decode("utf-8") if isinstance(v, bytes) else str(v)

    return {"prompt_text": s(ex["prompt_text"]), "answer": s(ex["answer"]), "index": int(ex["index"]), "extra": s(ex["extra"])}


def read_records(fmt: str, files: Mapping[str, str | Sequence[str]], *,
                 check_answer: Callable[[str], object] | None = None
                 ) -> tuple[dict[str, list[str]], dict[str, list[Record]]]:
    """Every split's uniform records in file order, and the ``path:line`` each was read from; nothing is written.

    Bad lines raise :class:`DataFormatError` naming the file, line and field: so do a file without records, and a
    gold answer ``check_answer`` (the task's reward's reading of one, `rewards.check_gold_answer`) raises on.
    `build` reads through it, and `train` calls it before any other work (a warm start, the model's load).
    """
    files = _normalise_files(files)
    locations: dict[str, list[str]] = {}
    records: dict[str, list[Record]] = {}
    for split, paths in files.items():
        locations[split], records[split] = [], []
        for p in paths:
            n = 0
            for rec in read_jsonl(p, fmt):
                n += 1
                locations[split].append(f"{p}:{rec['index'] + 1}")
                # `index` numbers the split's records across its files, in the order given: sorting by it is
                # file order (a per-file line number interleaved the files' lines and tied between them).
                records[split].append({**rec, "index": len(records[split])})
                if check_answer is not None:
                    try:
                        check_answer(rec["answer"])
                    except ValueError as e:  # the reward raised it at the first step that sampled the prompt
                        raise DataFormatError(f"{p}:{rec['index'] + 1}: {e}") from None
            if not n:  # TFDS failed on it after building had begun: "No examples were yielded"
                raise DataFormatError(f"{p}: no records (the file is empty or holds only blank lines)")
    return locations, records


def build(fmt: str, files: Mapping[str, str | Sequence[str]], data_dir: str, *,
          check_answer: Callable[[str], object] | None = None) -> BuiltDataset:
    """Build (once; later calls reuse it) the ``array_record`` dataset of ``files`` under ``data_dir``.

    ``files`` maps split name → JSONL path(s). Every line is validated (`read_records`) before anything is
    written: a clear error, no half-built dataset.
    """
    files = _normalise_files(files)
    cls = builder_class(fmt)
    locations, records = read_records(fmt, files, check_answer=check_answer)
    # No TFDS progress bars: building a JSONL task takes seconds, and on stderr they came before (and buried) the
    # one line a bad prompt found after the build is reported in; the trainer logs its own progress.
    tfds.disable_progress_bar()
    os.makedirs(data_dir, exist_ok=True)
    # One build at a time per dataset: TFDS renames its finished build into place, and a second build racing the
    # first failed at that rename (FileExistsError). The builder is made under the lock, so a process that waited
    # finds the first one's build and reads it.
    fd = os.open(os.path.join(data_dir, f".{cls.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        builder = cls(files=files, records=records, data_dir=data_dir)
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(verify_ssl=False))
    finally:
        os.close(fd)  # releases the lock
    return BuiltDataset(builder=builder, splits=tuple(files), locations=locations)


def load_records(fmt: str, files: Mapping[str, str | Sequence[str]], data_dir: str, split: str, *,
                 check_answer: Callable[[str], object] | None = None) -> list[Record]:
    """Build if needed (`build`) and return ``split``'s uniform records in file order, each with ``where``: the
    ``path:line`` it was read from (what an error about the record names)."""
    built = build(fmt, files, data_dir, check_answer=check_answer)
    recs = built.records(split)
    for rec, where in zip(recs, built.locations[split]):
        rec["where"] = where
    return recs
