"""`jaxrl-mismatch perfectible`: build the FP16 paper's "perfectible" sanity dataset with a real policy.

Samples k completions per prompt from the initial policy through a rollout server (a loopback
subprocess unless --address is given), keeps prompts whose accuracy lies in [lo, hi] (paper §4: every
MATH problem, 40 samples, [0.2, 0.8]) and writes them **in the format of the input**, so the training
config that names the input's task reads the output unchanged (`--config` takes the model, task,
template and sampling settings from that config, which makes the filter sample exactly as the run will).
File-backed inputs are copied line by line with `initial_accuracy` / `num_samples` added; the synthetic
arithmetic task is written as `prompts` JSONL for the `arithmetic_prompts` task.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any, Sequence

import grpc

from jaxrl_mismatch.data import get_task
from jaxrl_mismatch.data.batching import PromptError, generation_stop_ids, response_text, tokenize_prompts
from jaxrl_mismatch.data.jsonl import read_task_file, with_fields, write_lines
from jaxrl_mismatch.data.perfectible import filter_perfectible
from jaxrl_mismatch.data.tokenizer import load_tokenizer
from jaxrl_mismatch.data.templates import TEMPLATES
from jaxrl_mismatch.rollout import SamplingSpec
from jaxrl_mismatch.rollout.engine import ENGINE_DTYPES
from jaxrl_mismatch.rollout.client import EngineMismatchError, RolloutError
from jaxrl_mismatch.rollout.protocol import MAX_MESSAGE_BYTES, RESPONSE_OVERHEAD_BYTES, Limits, prompt_response_bytes
from jaxrl_mismatch.rollout.session import RolloutSession
from jaxrl_mismatch.rollout.validation import vllm_temperature_problem
from jaxrl_mismatch.outputs import check_out_file
from jaxrl_mismatch.jobs._inputs import model_config, task_json
from jaxrl_mismatch.usage import (INT32_MAX, ArgumentParser, UsageError, check_seed, existing_dir, existing_file,
                                  host_port)

PROG = "jaxrl-mismatch perfectible"


def _config_field(c, label: str, field: str, kinds: tuple[type, ...]) -> Any:
    """`field` ("a.b") of the config `c`; one line naming it when the config lacks it or it is of another type
    (a partial config's missing `model.path` was an AttributeError, exit 1)."""
    node = c
    for part in field.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, IndexError):
            raise UsageError(f"{label}: missing field {field}") from None
    mapping = Mapping in kinds and hasattr(node, "keys") and hasattr(node, "get")  # a ConfigDict is no Mapping
    if not (isinstance(node, kinds) or mapping) or (isinstance(node, bool) and bool not in kinds):
        names = " or ".join("None" if k is type(None) else "a mapping" if k is Mapping else k.__name__
                            for k in kinds)
        raise UsageError(f"{label}: {field} must be {names}, got {node!r}")
    return node


def parse_args(argv: Sequence[str]):
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="training config whose model/task/template/sampling to use")
    p.add_argument("--model", default=None, help="local HF checkpoint dir of the initial policy (with tokenizer)")
    p.add_argument("--task", default=None, help="task name (data.TASKS); default: the config's, else arithmetic")
    p.add_argument("--split", default=None, help="split to filter (default: the config's train split, else train)")
    p.add_argument("--file", default=None, help="JSONL of the split for file-backed tasks (default: the config's)")
    p.add_argument("--num", type=int, default=0, help="first N records only (0 = all; synthetic tasks: how many to generate, default 512)")
    p.add_argument("--template", default=None, help="prompt template (default: the config's, else the task's)")
    p.add_argument("--k", type=int, default=40, help="samples per prompt (paper: 40)")
    p.add_argument("--lo", type=float, default=0.2)
    p.add_argument("--hi", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=None, help="response limit (default: the config's rollout.max_tokens)")
    p.add_argument("--temperature", type=float, default=None, help="default: the config's, else 1.0")
    p.add_argument("--engine", choices=("jax", "vllm"), default=None)
    p.add_argument("--dtype", choices=ENGINE_DTYPES, default=None)
    p.add_argument("--address", default=None, help="host:port of a running rollout server (else start one)")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for the --address server to be ready (default 600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output JSONL (a new file, or an existing one with --force)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out file that an earlier perfectible run wrote (nothing else)")
    a = p.parse_args(argv)
    file_flag, split_flag, template_flag, temperature_flag = a.file, a.split, a.template, a.temperature
    a.asked = {"--engine": a.engine, "--dtype": a.dtype}  # given on the command line: checked against --address
    c = None
    if a.config:
        from jaxrl_mismatch.train.config_overrides import load_config

        c = load_config(a.config)
    label = f"--config {(a.config or '').partition(':')[0]}"

    def pick(flag, field: str, kinds: tuple[type, ...], default):
        """The flag if given, else the config's `field` (one line naming it when missing or mistyped), else
        `default`."""
        if flag is not None:
            return flag
        return _config_field(c, label, field, kinds) if c is not None else default

    a.model = pick(a.model, "model.path", (str,), None)
    a.task = pick(a.task, "task.name", (str,), "arithmetic")
    a.split = pick(a.split, "task.train_split", (str,), "train")
    if a.file is None and c is not None and a.task != "arithmetic":
        files = _config_field(c, label, "task.files", (Mapping,))
        a.file = files.get(a.split)
        if a.file is not None and not isinstance(a.file, str):
            raise UsageError(f"{label}: task.files.{a.split} must be a path, got {a.file!r}")
    a.template = pick(a.template, "task.template", (str, type(None)), None) or None
    a.max_tokens = pick(a.max_tokens, "rollout.max_tokens", (int,), None)
    a.temperature = pick(a.temperature, "rollout.temperature", (int, float), 1.0)
    # the run's truncation and prompt bound too: it samples with them, and refuses a prompt over the bound
    a.top_p = _config_field(c, label, "rollout.top_p", (int, float)) if c is not None else 1.0
    a.top_k = _config_field(c, label, "rollout.top_k", (int,)) if c is not None else 0
    a.max_prompt_len = _config_field(c, label, "task.max_prompt_len", (int,)) if c is not None else None
    a.engine = pick(a.engine, "rollout.engine", (str,), "jax")
    a.dtype = pick(a.dtype, "rollout.dtype", (str,), "float32")
    for flag, field, value, valid in (("--engine", "rollout.engine", a.engine, ("jax", "vllm")),
                                      ("--dtype", "rollout.dtype", a.dtype, ENGINE_DTYPES)):
        if value not in valid:  # only a config's value can be another (argparse checks the flags' choices)
            raise UsageError(f"{label}: {field} {value!r} is not one of {', '.join(valid)} (or pass {flag})")
    if not a.model:
        raise UsageError(f"{PROG}: --model is required (or --config naming model.path)")
    existing_dir("--model", a.model)
    if a.max_tokens is None:
        raise UsageError(f"{PROG}: --max-tokens is required (or --config naming rollout.max_tokens)")
    for flag, value, low in (("--k", a.k, 1), ("--max-tokens", a.max_tokens, 1), ("--num", a.num, 0)):
        if value < low:
            raise UsageError(f"{PROG}: {flag} must be >= {low}, got {value}")
        if value > INT32_MAX:  # the rollout protocol sends n and max_tokens as int32
            raise UsageError(f"{PROG}: {flag} must be <= 2^31 - 1 ({INT32_MAX}), got {value}")
    if a.template is not None and a.template not in TEMPLATES:
        where = "--template" if template_flag is not None else f"{label}: task.template"
        raise UsageError(f"{where} {a.template}: unknown prompt template; valid: {', '.join(sorted(TEMPLATES))}")
    if not 0.0 <= a.lo <= a.hi <= 1.0:
        raise UsageError(f"{PROG}: need 0 <= --lo <= --hi <= 1, got {a.lo}, {a.hi}")
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        where = "--temperature" if temperature_flag is not None else f"{label}: rollout.temperature"
        raise UsageError(f"{where} must be a number >= 0, got {a.temperature}")
    check_seed("--seed", a.seed)
    if a.task not in _tasks():
        raise UsageError(f"--task {a.task}: unknown task; valid: {', '.join(_tasks())}")
    if a.task == "arithmetic":
        from jaxrl_mismatch.data.arithmetic import check_split

        try:
            check_split(a.split)
        except ValueError as e:
            raise UsageError(f"--split {a.split}: {e}") from None
        if file_flag is not None:
            raise UsageError(f"--file {file_flag}: task 'arithmetic' generates its prompts and reads no file; pass "
                             "--task NAME (or --config) for a file-backed task")
    elif file_flag is not None and split_flag is not None:  # the split only picks the config's file: ignored
        raise UsageError(f"--split {split_flag}: --file {file_flag} gives the prompts itself (--split picks a "
                         "file of --config's task.files, or a split of the arithmetic task); drop --split")
    elif not a.file:
        if split_flag is not None and c is not None:
            raise UsageError(f"--split {split_flag}: {label} names no file for it in task.files; pass --file PATH "
                             "or another --split")
        raise UsageError(f"--file: task {a.task!r} reads a local JSONL file; pass --file PATH")
    else:
        existing_file("--file", a.file)
    if not (math.isfinite(a.ready_timeout) and a.ready_timeout > 0):
        raise UsageError(f"--ready-timeout must be a number > 0, got {a.ready_timeout}")
    if a.address:
        host_port("--address", a.address)
    check_out(a)
    # its own server loads --model: a damaged checkpoint is refused before it starts
    a.model_cfg = None if a.address else model_config("--model", a.model)
    return a


OUTPUT_FIELDS = ("initial_accuracy", "num_samples")  # what perfectible adds to every record it keeps


def check_out(a) -> None:
    """UsageError unless --out may receive the kept prompts: a new path, or with --force an earlier output of
    perfectible. Checked at start-up and again just before the write (sampling can take hours)."""
    # (exists, not lexists: samefile follows a link, and a dangling one is refused by check_out_file below)
    if a.file and os.path.exists(a.out) and os.path.exists(a.file) and os.path.samefile(a.out, a.file):
        raise UsageError(f"--out {a.out}: is the input --file; write the kept prompts to a new file")
    # Only a regular file is opened here: a link, a FIFO (reading it blocks) or a device is refused by check_out_file.
    regular = os.path.isfile(a.out) and not os.path.islink(a.out)
    if a.force and regular and not _has_content(a.out):
        raise UsageError(f"--out {a.out}: is an empty file, and nothing in it shows it is an earlier output of "
                         "perfectible (--force replaces only that); remove it yourself or choose a new path")
    if a.force and regular and not _is_perfectible_output(a.out):
        raise UsageError(f"--out {a.out}: --force replaces only an earlier output of perfectible (every line a JSON "
                         f"object with {OUTPUT_FIELDS[0]!r} and {OUTPUT_FIELDS[1]!r}); this file is not one, "
                         "choose a new path")
    check_out_file("--out", a.out, ours=lambda _: False, what="", force=a.force)


def _output_lines(records: list[dict], originals: list[dict], kept: list[dict]) -> list[str]:
    """The kept records as output lines: a file's own line (`read_task_file`'s "text") with the two fields appended,
    its bytes kept (they were re-encoded: spacing, escapes and a big number's digits changed); the synthetic task's
    records, and a line that already holds one of the fields, as JSON."""
    lines = []
    for r in kept:
        fields = {"initial_accuracy": r["initial_accuracy"], "num_samples": r["num_samples"]}
        text = records[r["line"]].get("text")
        line = with_fields(text, fields) if text is not None else None
        lines.append(line if line is not None else json.dumps({**originals[r["line"]], **fields}, ensure_ascii=False))
    return lines


def _write_out(a, out: list[str]) -> None:
    """The kept prompts' lines to --out, re-checked first: a file that appeared there while sampling is never
    replaced; the result then goes to a new sibling named in the error instead of being lost."""
    try:
        check_out(a)
    except (UsageError, OSError) as e:  # whatever the check met there, the results are not lost
        aside = f"{a.out}.new-{time.time_ns()}"
        write_lines(out, aside)
        why = e if isinstance(e, UsageError) else f"--out {a.out}: {e}"
        raise UsageError(f"{why} (it changed while sampling); the {len(out)} kept prompts are in {aside}") from None
    write_lines(out, a.out)


def _has_content(path: str) -> bool:
    """Whether the file holds anything but whitespace (unreadable: treated as content, refused as not ours)."""
    try:
        with open(path, "rb") as f:
            return any(line.strip() for line in f)
    except OSError:
        return True


def _is_perfectible_output(path: str) -> bool:
    """Whether `path` is a file an earlier run wrote: JSON lines, at least one, each an object with the fields added
    here. An empty file is not: nothing in it says whose it is (a run that kept no prompt writes one too, and
    says so), and `--force` replaces only what is provably perfectible's."""
    records = 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    if not (isinstance(rec, dict) and all(k in rec for k in OUTPUT_FIELDS)):
                        return False
                    records += 1
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8 or not JSON (a JSONDecodeError, a number
        return False                                # over Python's digit limit, nesting too deep): not ours
    return records > 0


def check_request(a, longest: int, max_model_len: int, limits: Limits, served_by: str) -> None:
    """UsageError naming --max-tokens or --k when the Generate requests this run sends could not be served: the
    longest prompt plus --max-tokens past the context (`max_model_len`), --k x --max-tokens past the server's
    per-request completion tokens, or one prompt's --k samples past the message size. Each was found by the
    server after it started (an INVALID_ARGUMENT RolloutError, exit 1) or by the client as a ValueError naming
    the trainer's config fields (`rollout.group_size`)."""
    if max_model_len > 0 and longest + a.max_tokens > max_model_len:
        fix = (f"at most {max_model_len - longest}" if longest < max_model_len else
               "none fits: the prompt alone fills it")
        raise UsageError(f"--max-tokens {a.max_tokens}: the longest prompt ({longest} tokens) + --max-tokens exceeds "
                         f"the context of {max_model_len} positions ({served_by}); --max-tokens can be {fix}")
    per_prompt = a.k * a.max_tokens
    if per_prompt > limits.max_request_completion_tokens:
        raise UsageError(f"--k {a.k}: --k x --max-tokens = {per_prompt} completion tokens for one prompt, over the "
                         f"rollout server's limit of {limits.max_request_completion_tokens} per request; lower --k "
                         "or --max-tokens")
    size = prompt_response_bytes(longest, SamplingSpec(n=a.k, max_tokens=a.max_tokens),
                                 limits.routing_bytes_per_token)
    if size > MAX_MESSAGE_BYTES - RESPONSE_OVERHEAD_BYTES:
        raise UsageError(f"--k {a.k}: one prompt's --k samples (--max-tokens {a.max_tokens} each) could take {size} "
                         f"bytes, over the rollout protocol's {MAX_MESSAGE_BYTES}-byte message; lower --k or "
                         "--max-tokens")
    if why := vllm_temperature_problem(a.engine, a.temperature):
        raise UsageError(f"--temperature {a.temperature:g}: {why}")


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    task = get_task(a.task)
    if a.task == "arithmetic":
        spec: dict[str, Any] = task_json("--model", a.model)[0]
        try:  # more unique problems than the split holds: the generator's ValueError was exit 1
            records = task.load(a.split, n=a.num or 512, seed=a.seed, **spec)
        except ValueError as e:
            raise UsageError(f"--num {a.num or 512}: {e}") from None
        originals = [{"prompt_text": r["prompt_text"], "answer": r["answer"]} for r in records]
    else:
        records, originals = read_task_file(a.task, existing_file("--file", a.file), a.num)
        if not records:  # it started a server and wrote an empty --out ("kept 0 of 0")
            raise UsageError(f"--file {a.file}: holds no records; nothing to filter")
    try:
        tok = load_tokenizer(a.model)
    except (ValueError, OSError) as e:
        raise UsageError(f"--model {a.model}: {e}") from None
    template = a.template or task.template
    stop_ids = generation_stop_ids(tok, template)
    try:  # before a server starts: a prompt the tokenizer cannot take is one line naming its file and line
        where = [r["where"] for r in records] if a.task != "arithmetic" else None
        ids = tokenize_prompts(tok, [r["prompt_text"] for r in records], template=template, where=where,
                               max_prompt_len=a.max_prompt_len)
    except PromptError as e:  # (a prompt over the config's task.max_prompt_len, which train would refuse, too)
        raise UsageError(str(e) if where else f"--task arithmetic (--seed {a.seed}): {e}") from None
    longest = max(len(p) for p in ids)
    if not a.address:  # the server it starts serves --model's whole context, with the default request limits
        check_request(a, longest, a.model_cfg.max_position_embeddings, Limits(),
                      f"--model {a.model}: max_position_embeddings")
    calls = {"n": 0}
    work = None
    if a.address:
        print(f"perfectible: waiting up to {a.ready_timeout:.0f} s for the rollout server at {a.address}", flush=True)
        try:
            session = RolloutSession.attach(a.address, token=None, ready_timeout_s=a.ready_timeout)
        except RolloutError as e:
            raise UsageError(f"--address {a.address}: no rollout server ready there within "
                             f"{a.ready_timeout:.0f} s ({e})") from None
        try:
            info = session.info()
            for flag, served in (("--engine", info.engine), ("--dtype", info.dtype)):
                if a.asked[flag] is not None and a.asked[flag] != served:
                    raise UsageError(f"{flag} {a.asked[flag]}: the server at {a.address} runs {served}; the prompts "
                                     f"would be filtered with another {flag[2:]} than asked (drop {flag} or start "
                                     "that server)")
            a.engine = info.engine
            check_request(a, longest, info.max_model_len, session.limits, f"the server at {a.address}")
            # as train and analyze: a server of another model sampled ids outside --model's tokenizer, and every
            # prompt was kept at accuracy 0
            cfg = model_config("--model", a.model, weights=False) if os.path.isfile(
                os.path.join(a.model, "config.json")) else None
            try:
                session.check_compatible(architecture=cfg.architecture if cfg else info.architecture,
                                         vocab_size=cfg.vocab_size if cfg else info.vocab_size,
                                         tokenizer_vocab_size=tok.vocab_size)
            except EngineMismatchError as e:
                raise UsageError(f"--address {a.address}: serves another model than --model {a.model} ({e})") \
                    from None
        except BaseException:
            session.close()
            raise
    else:  # its own server's token, log and ready file: a folder of ours, removed once the run ends
        work = tempfile.mkdtemp(prefix=".perfectible-server-", dir=_existing_parent(a.out))
    keep_log = False
    try:
        if work is not None:
            session = RolloutSession.launch(work_dir=work, engine=a.engine, model=a.model, dtype=a.dtype)
        with session:
            def sample_fn(prompts: list[str], n: int) -> list[list[str]]:
                ids = tokenize_prompts(tok, prompts, template=template)
                calls["n"] += 1
                spec = SamplingSpec(n=n, max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                                    top_k=a.top_k, seed=a.seed * 7919 + calls["n"], stop_token_ids=stop_ids)
                # the text the trainer's reward reads (TaskData.reward); a malformed response scores 0 there: ""
                return [[response_text(tok, c.token_ids, stop_ids) or "" for c in group]
                        for group in session.generate(ids, spec)]

            kept = filter_perfectible([r["prompt_text"] for r in records], [r["answer"] for r in records],
                                      sample_fn, task.reward, k=a.k, lo=a.lo, hi=a.hi, batch_size=64,
                                      extras=[{"line": i} for i in range(len(records))])
        _write_out(a, _output_lines(records, originals, kept))
    except RolloutError as e:
        # The server itself failed: its log says why, so its folder is kept and named. Anything else (a refused
        # request, Ctrl-C, an error here) leaves nothing behind.
        if work is not None and e.code == grpc.StatusCode.INVALID_ARGUMENT:
            raise
        if work is not None and os.path.exists(os.path.join(work, "rollout_server.log")):
            keep_log = True
            e.args = (f"{e} (server log kept: {os.path.join(work, 'rollout_server.log')})", *e.args[1:])
        raise
    finally:
        if work is not None and not keep_log:
            shutil.rmtree(work, ignore_errors=True)
    fmt = "prompts (task arithmetic_prompts)" if a.task == "arithmetic" else f"{a.task} (same as the input)"
    note = ("; it is empty, so nothing marks it as perfectible's and --force will not replace it (remove it "
            "first to rerun)") if not kept else ""
    print(f"perfectible: kept {len(kept)} of {len(records)} prompts with accuracy in [{a.lo}, {a.hi}] over {a.k} "
          f"samples → {a.out}, format {fmt}{note}", flush=True)
    return 0


def _existing_parent(path: str) -> str:
    """The nearest existing folder above `path`: its parents are made only when the output is written."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    return parent


def _tasks() -> list[str]:
    from jaxrl_mismatch.data import TASKS

    return sorted(TASKS)
