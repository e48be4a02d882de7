"""`jaxrl-mismatch perfectible`: build the FP16 paper's "perfectible" sanity dataset with a real policy.

Samples k completions per prompt from the initial policy through a rollout server (the same engine and
sampling settings an RL run uses; a loopback subprocess unless --address is given), keeps prompts whose
accuracy lies in [lo, hi] (paper §4: 40 samples, [0.2, 0.8]) and writes them as a `prompts`-format JSONL
that the `prompts` / `arithmetic_prompts` tasks load.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from jaxrl_mismatch.data import get_task
from jaxrl_mismatch.data.batching import tokenize_prompts
from jaxrl_mismatch.data.perfectible import filter_perfectible, save_perfectible
from jaxrl_mismatch.data.tokenizer import load_tokenizer
from jaxrl_mismatch.rollout import RolloutClient, SamplingSpec
from jaxrl_mismatch.train.server_proc import ManagedServer


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jaxrl-mismatch perfectible", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF checkpoint dir of the initial policy (with tokenizer)")
    p.add_argument("--task", default="arithmetic", help="task name (data.TASKS)")
    p.add_argument("--split", default="train")
    p.add_argument("--file", default=None, help="JSONL of the split for file-backed tasks (gsm8k, math, dapo, ...)")
    p.add_argument("--data-dir", default=None, help="where file-backed tasks build their TFDS dataset")
    p.add_argument("--num", type=int, default=512, help="synthetic tasks: number of problems; others: first N records")
    p.add_argument("--template", default=None, help="prompt template (default: the task's)")
    p.add_argument("--k", type=int, default=40, help="samples per prompt (paper: 40)")
    p.add_argument("--lo", type=float, default=0.2)
    p.add_argument("--hi", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--engine", choices=("jax", "vllm"), default="jax")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--address", default=None, help="host:port of a running rollout server (else start one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output JSONL")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    task = get_task(a.task)
    if a.task == "arithmetic":
        import json

        spec = {}
        if os.path.exists(os.path.join(a.model, "task.json")):
            with open(os.path.join(a.model, "task.json")) as f:
                spec = json.load(f).get("spec", {})
        records = task.load(a.split, n=a.num, seed=a.seed, **spec)
    else:
        if not a.file:
            raise SystemExit(f"perfectible: task {a.task!r} needs --file")
        records = task.load(a.split, files={a.split: a.file}, data_dir=a.data_dir or os.path.dirname(a.out) or ".")
        records = records[: a.num]
    tok = load_tokenizer(a.model)
    template = a.template or task.template
    server = None
    if a.address:
        target, token = a.address, None
    else:
        server = ManagedServer(engine=a.engine, model_dir=a.model, dtype=a.dtype,
                               work_dir=os.path.join(os.path.dirname(os.path.abspath(a.out)), ".perfectible_server"))
        target, token = server.start(), server.token
    calls = {"n": 0}
    try:
        client = RolloutClient(target, token=token, max_staleness=None)

        def sample_fn(prompts: list[str], n: int) -> list[list[str]]:
            ids = tokenize_prompts(tok, prompts, template=template)
            calls["n"] += 1
            spec = SamplingSpec(n=n, max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed * 7919 + calls["n"],
                                stop_token_ids=(tok.eos_id,))
            return [[tok.decode(c.token_ids) for c in group] for group in client.generate(ids, spec)]

        # As many prompts per Generate request as the server's completion-token limit allows.
        batch = max(1, min(64, client.request_limits().max_request_completion_tokens // (a.k * a.max_tokens)))
        kept = filter_perfectible([r["prompt_text"] for r in records], [r["answer"] for r in records], sample_fn,
                                  task.reward, k=a.k, lo=a.lo, hi=a.hi, batch_size=batch)
        client.close()
    finally:
        if server is not None:
            server.stop()
    save_perfectible(kept, a.out)
    print(f"perfectible: kept {len(kept)} of {len(records)} prompts with accuracy in [{a.lo}, {a.hi}] "
          f"over {a.k} samples → {a.out}", flush=True)
    return 0
