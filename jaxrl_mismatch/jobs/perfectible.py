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
from typing import Any, Sequence

from jaxrl_mismatch.data import get_task
from jaxrl_mismatch.data.batching import generation_stop_ids, response_text, tokenize_prompts
from jaxrl_mismatch.data.jsonl import read_task_file, write_jsonl
from jaxrl_mismatch.data.perfectible import filter_perfectible
from jaxrl_mismatch.data.tokenizer import load_tokenizer
from jaxrl_mismatch.rollout import SamplingSpec
from jaxrl_mismatch.rollout.engine import ENGINE_DTYPES
from jaxrl_mismatch.rollout.client import RolloutError
from jaxrl_mismatch.rollout.session import RolloutSession
from jaxrl_mismatch.outputs import check_out_file
from jaxrl_mismatch.jobs._inputs import model_config, task_json
from jaxrl_mismatch.usage import ArgumentParser, UsageError, check_seed, existing_dir, existing_file, host_port

PROG = "jaxrl-mismatch perfectible"


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
    file_flag = a.file
    a.asked = {"--engine": a.engine, "--dtype": a.dtype}  # given on the command line: checked against --address
    c = None
    if a.config:
        from jaxrl_mismatch.train.config_overrides import load_config

        c = load_config(a.config)
    pick = lambda flag, from_config, default: flag if flag is not None else (from_config(c) if c is not None else default)  # noqa: E731
    a.model = pick(a.model, lambda c: c.model.path, None)
    a.task = pick(a.task, lambda c: c.task.name, "arithmetic")
    a.split = pick(a.split, lambda c: c.task.train_split, "train")
    a.file = pick(a.file, lambda c: c.task.files.get(a.split), None)
    a.template = pick(a.template, lambda c: c.task.template or None, None)
    a.max_tokens = pick(a.max_tokens, lambda c: c.rollout.max_tokens, None)
    a.temperature = pick(a.temperature, lambda c: c.rollout.temperature, 1.0)
    a.engine = pick(a.engine, lambda c: c.rollout.engine, "jax")
    a.dtype = pick(a.dtype, lambda c: c.rollout.dtype, "float32")
    if a.model is None:
        raise UsageError(f"{PROG}: --model is required (or --config naming model.path)")
    existing_dir("--model", a.model)
    if a.max_tokens is None:
        raise UsageError(f"{PROG}: --max-tokens is required (or --config naming rollout.max_tokens)")
    for flag, value, low in (("--k", a.k, 1), ("--max-tokens", a.max_tokens, 1), ("--num", a.num, 0)):
        if value < low:
            raise UsageError(f"{PROG}: {flag} must be >= {low}, got {value}")
    if not 0.0 <= a.lo <= a.hi <= 1.0:
        raise UsageError(f"{PROG}: need 0 <= --lo <= --hi <= 1, got {a.lo}, {a.hi}")
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        raise UsageError(f"--temperature must be a number >= 0, got {a.temperature}")
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
    elif not a.file:
        raise UsageError(f"--file: task {a.task!r} reads a local JSONL file; pass --file PATH")
    else:
        existing_file("--file", a.file)
    if not (math.isfinite(a.ready_timeout) and a.ready_timeout > 0):
        raise UsageError(f"--ready-timeout must be a number > 0, got {a.ready_timeout}")
    if a.address:
        host_port("--address", a.address)
    if a.file and os.path.lexists(a.out) and os.path.exists(a.file) and os.path.samefile(a.out, a.file):
        raise UsageError(f"--out {a.out}: is the input --file; write the kept prompts to a new file")
    if a.force and os.path.lexists(a.out) and not os.path.isdir(a.out) and not _is_perfectible_output(a.out):
        raise UsageError(f"--out {a.out}: --force replaces only an earlier output of perfectible (every line a JSON "
                         f"object with {OUTPUT_FIELDS[0]!r} and {OUTPUT_FIELDS[1]!r}); this file is not one, "
                         "choose a new path")
    check_out_file("--out", a.out, ours=lambda _: False, what="", force=a.force)
    if not a.address:  # its own server loads --model: a damaged checkpoint is refused before it starts
        model_config("--model", a.model)
    return a


OUTPUT_FIELDS = ("initial_accuracy", "num_samples")  # what perfectible adds to every record it keeps


def _is_perfectible_output(path: str) -> bool:
    """Whether `path` is a file an earlier run wrote: JSON lines, each an object with the fields added here (an
    empty file is one too: a run that kept no prompt writes it)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    if not (isinstance(rec, dict) and all(k in rec for k in OUTPUT_FIELDS)):
                        return False
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    task = get_task(a.task) if a.task in _tasks() else None
    if task is None:
        raise UsageError(f"--task {a.task}: unknown task; valid: {', '.join(_tasks())}")
    if a.task == "arithmetic":
        spec: dict[str, Any] = task_json("--model", a.model)[0]
        records = task.load(a.split, n=a.num or 512, seed=a.seed, **spec)
        originals = [{"prompt_text": r["prompt_text"], "answer": r["answer"]} for r in records]
    else:
        if not a.file:
            raise UsageError(f"--file: task {a.task!r} reads a local JSONL file; pass --file PATH")
        records, originals = read_task_file(a.task, existing_file("--file", a.file), a.num)
    try:
        tok = load_tokenizer(a.model)
    except (ValueError, OSError) as e:
        raise UsageError(f"--model {a.model}: {e}") from None
    template = a.template or task.template
    stop_ids = generation_stop_ids(tok, template)
    calls = {"n": 0}
    work = None
    if a.address:
        print(f"perfectible: waiting up to {a.ready_timeout:.0f} s for the rollout server at {a.address}", flush=True)
        try:
            session = RolloutSession.attach(a.address, token=None, ready_timeout_s=a.ready_timeout)
        except RolloutError as e:
            raise UsageError(f"--address {a.address}: no rollout server ready there within "
                             f"{a.ready_timeout:.0f} s ({e})") from None
        info = session.info()
        for flag, served in (("--engine", info.engine), ("--dtype", info.dtype)):
            if a.asked[flag] is not None and a.asked[flag] != served:
                session.close()
                raise UsageError(f"{flag} {a.asked[flag]}: the server at {a.address} runs {served}; the prompts "
                                 f"would be filtered with another {flag[2:]} than asked (drop {flag} or start that server)")
    else:  # its own server's token, log and ready file: a folder of ours, removed once the output is written
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        work = tempfile.mkdtemp(prefix=".perfectible-server-", dir=os.path.dirname(os.path.abspath(a.out)))
        session = RolloutSession.launch(work_dir=work, engine=a.engine, model=a.model, dtype=a.dtype)
    with session:
        def sample_fn(prompts: list[str], n: int) -> list[list[str]]:
            ids = tokenize_prompts(tok, prompts, template=template)
            calls["n"] += 1
            spec = SamplingSpec(n=n, max_tokens=a.max_tokens, temperature=a.temperature,
                                seed=a.seed * 7919 + calls["n"], stop_token_ids=stop_ids)
            # the text the trainer's reward reads (TaskData.reward); a malformed response scores 0 there: "" here
            return [[response_text(tok, c.token_ids, stop_ids) or "" for c in group]
                    for group in session.generate(ids, spec)]

        kept = filter_perfectible([r["prompt_text"] for r in records], [r["answer"] for r in records], sample_fn,
                                  task.reward, k=a.k, lo=a.lo, hi=a.hi, batch_size=64,
                                  extras=[{"line": i} for i in range(len(records))])
    out = [{**originals[r["line"]], "initial_accuracy": r["initial_accuracy"], "num_samples": r["num_samples"]}
           for r in kept]
    write_jsonl(out, a.out)
    if work is not None:  # kept on a failure: its server log says what went wrong
        shutil.rmtree(work, ignore_errors=True)
    fmt = "prompts (task arithmetic_prompts)" if a.task == "arithmetic" else f"{a.task} (same as the input)"
    print(f"perfectible: kept {len(kept)} of {len(records)} prompts with accuracy in [{a.lo}, {a.hi}] over {a.k} "
          f"samples → {a.out}, format {fmt}", flush=True)
    return 0


def _tasks() -> list[str]:
    from jaxrl_mismatch.data import TASKS

    return sorted(TASKS)
