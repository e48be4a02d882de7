"""`jaxrl-mismatch analyze rollouts`: the FP16 paper's §3.5 offline mismatch analysis (Fig. 2) and the
objective-level hacking paper's token-level views (Fig. 3: π_train vs π_infer with their PCC; Fig. 7: ρ by π
probability range); measured tables in `docs/analysis.md`.

Rollouts are sampled through a real rollout server (`RolloutSession.launch`, the path the trainer uses) at
the engine precision; the trainer's own scorer (`models.scoring`, what its θ_old forward runs) scores the very
same tokens at the trainer precision (float32 master weights, computed in that precision:
`precision.policy(p, param_dtype="float32")`, as `train.Learner` builds it) and at the rollout temperature, so
π and μ describe the same distribution. Per (trainer, engine) pair it writes the per-token dump, a summary made
by `metrics.step_metrics` itself, and one figure for all pairs (report/analysis.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Float, Int

from jaxrl_mismatch import precision
from jaxrl_mismatch.metrics import MetricsConfig, bucket_names, step_metrics
from jaxrl_mismatch.models import ModelConfig, load_hf, make_scorer
from jaxrl_mismatch.objectives.ratios import LOG_RATIO_CLAMP
from jaxrl_mismatch.outputs import staged_dir, write_json
from jaxrl_mismatch.rollout.validation import GREEDY_TEMPERATURE, MAX_STOP_TOKEN_IDS, vllm_temperature_problem
from jaxrl_mismatch.jobs._inputs import model_config, task_json
from jaxrl_mismatch.usage import INT32_MAX, UsageError, check_seed, existing_file, int_list, physical_memory_bytes

TRAINER_PRECISIONS = precision.PRESETS  # fp32, bf16, fp16

KIND = "analyze rollouts"  # --out's writer as typed; its marker: outputs.marker_name

DUMP_FIELDS = ("prompt_id", "sample_id", "position", "token", "logp_train", "logp_rollout", "seq_len")


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """`fp32:float32,bf16:bfloat16` → [(trainer precision, engine dtype), ...]; UsageError naming --pairs."""
    pairs = []
    for item in (s.strip() for s in text.split(",")):
        trainer, sep, engine = item.partition(":")
        if not sep or trainer not in TRAINER_PRECISIONS or engine not in precision.DTYPES:
            raise UsageError(f"--pairs: bad pair {item!r}; expected TRAINER:ENGINE with TRAINER in "
                             f"{{{','.join(TRAINER_PRECISIONS)}}} and ENGINE in {{{','.join(precision.DTYPES)}}}, "
                             "e.g. fp32:float32,bf16:bfloat16,fp16:float16")
        if (trainer, engine) in pairs:
            raise UsageError(f"--pairs: {item} is listed twice")
        pairs.append((trainer, engine))
    return pairs


def pair_name(trainer: str, engine: str) -> str:
    return f"{trainer}:{engine}"


def score_rows(model_dir: str, trainer_precision: str, tokens: np.ndarray, attention_mask: np.ndarray, *,
               temperature: float, chunk_size: int = 256, fp32_lm_head: bool = False, block: int = 32) -> np.ndarray:
    """log π(tokens[:, t+1] | tokens[:, :t+1]) at temperature T, 0 where attention_mask[:, :-1] == 0: the
    checkpoint loaded as the trainer loads it (float32 master weights, compute in `trainer_precision`) and
    scored by the trainer's own scorer (`models.scoring.make_scorer`, the θ_old forward of `prepare`), softmax
    (logits / T) — the distribution an engine sampling at T reports (FP16 paper §3.5: "temperature 1.0 and no
    top-p … so that μ is directly comparable to π"). Rows go in fixed blocks of `block` (one compilation)."""
    pol = precision.policy(trainer_precision, fp32_lm_head=fp32_lm_head, param_dtype="float32")
    _, model = load_hf(model_dir, policy=pol)
    graphdef, state = nnx.split(model)
    score = make_scorer(graphdef, chunk_size=chunk_size, temperature=float(temperature))
    b, s = tokens.shape
    out = np.zeros((b, s - 1), np.float32)
    for start in range(0, b, block):
        ids = np.zeros((block, s), np.int32)
        mask = np.zeros((block, s), np.int32)
        mask[:, 0] = 1  # padding rows: one real token, so no row is empty
        k = min(block, b - start)
        ids[:k], mask[:k] = tokens[start:start + k], attention_mask[start:start + k]
        logp, _ = score(state, jnp.asarray(ids), jnp.asarray(mask))
        out[start:start + k] = np.asarray(logp)[:k]
    return out


def token_dump(response_mask: Float[np.ndarray, "batch seq"], targets: Int[np.ndarray, "batch seq"],
               logp_train: Float[np.ndarray, "batch seq"], logp_rollout: Float[np.ndarray, "batch seq"],
               prompt_id: Int[np.ndarray, " batch"], sample_id: Int[np.ndarray, " batch"]) -> dict[str, np.ndarray]:
    """Flat per-token arrays over the response tokens (`DUMP_FIELDS`); `position` counts from 0 within the
    response and `seq_len` is the response length of the token's sequence."""
    m = np.asarray(response_mask) > 0
    rows, cols = np.nonzero(m)
    position = (np.cumsum(m, axis=1) - 1)[rows, cols]
    return {
        "prompt_id": np.asarray(prompt_id, np.int32)[rows],
        "sample_id": np.asarray(sample_id, np.int32)[rows],
        "position": position.astype(np.int32),
        "token": np.asarray(targets, np.int32)[rows, cols],
        "logp_train": np.asarray(logp_train, np.float32)[rows, cols],
        "logp_rollout": np.asarray(logp_rollout, np.float32)[rows, cols],
        "seq_len": m.sum(axis=1).astype(np.int32)[rows],
    }


def response_arrays(dump: dict[str, np.ndarray]
                    ) -> tuple[Float[np.ndarray, "seqs length"], Float[np.ndarray, "seqs length"],
                               Float[np.ndarray, "seqs length"]]:
    """(logp_train, logp_rollout, mask) as `[sequences, longest response]`, responses left-aligned, one row per
    (prompt_id, sample_id) in sorted order — the layout `metrics.step_metrics` takes (padding is masked)."""
    keys = np.stack([dump["prompt_id"], dump["sample_id"]], axis=1)
    seqs, row = np.unique(keys, axis=0, return_inverse=True)
    row = row.reshape(-1)
    length = int(dump["position"].max()) + 1 if len(row) else 1
    shape = (max(len(seqs), 1), length)
    lp_tr, lp_ro, mask = np.zeros(shape, np.float32), np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    lp_tr[row, dump["position"]] = dump["logp_train"]
    lp_ro[row, dump["position"]] = dump["logp_rollout"]
    mask[row, dump["position"]] = 1.0
    return lp_tr, lp_ro, mask


_step_metrics = jax.jit(step_metrics, static_argnames=("cfg",))


def summarize(dump: dict[str, np.ndarray], cfg: MetricsConfig = MetricsConfig()) -> dict[str, float]:
    """`metrics.step_metrics` on the dump (advantages 0: no rewards here, so `diag/surrogate_j` is 0), plus
    `analysis/*`: max/mean |Δ log p|, ρ std per π bucket (OLH Fig. 7a's spread), the sequence log-ratio
    log π(y)/μ(y) = Σ_t log ρ_t (FP16 paper Fig. 2, right), token and sequence counts."""
    lp_tr, lp_ro, mask = response_arrays(dump)
    out = {k: float(v) for k, v in _step_metrics(jnp.asarray(lp_tr), jnp.asarray(lp_ro), jnp.asarray(mask),
                                                  jnp.zeros_like(jnp.asarray(mask)), cfg=cfg).items()}
    d = dump["logp_train"].astype(np.float64) - dump["logp_rollout"].astype(np.float64)
    out["analysis/tokens"] = float(d.size)
    out["analysis/sequences"] = float(mask.any(axis=1).sum())  # (no response at all: one all-padding row)
    out["analysis/logp_abs_diff_max"] = float(np.max(np.abs(d))) if d.size else 0.0
    out["analysis/logp_abs_diff_mean"] = float(np.mean(np.abs(d))) if d.size else 0.0
    _, seq_lr = _seq_log_ratio(dump)
    out["analysis/seq_log_ratio_mean"] = float(seq_lr.mean())
    out["analysis/seq_log_ratio_std"] = float(seq_lr.std())
    out["analysis/seq_log_ratio_abs_max"] = float(np.max(np.abs(seq_lr)))
    p_tr = np.exp(dump["logp_train"].astype(np.float64))
    rho = np.exp(np.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    names = bucket_names(cfg)
    for k, (suffix, lo, hi) in enumerate(names):  # the bucket rule of step_metrics: last bucket closed
        sel = (p_tr >= lo) & ((p_tr <= hi) if k == len(names) - 1 else (p_tr < hi))
        out[f"analysis/rho_std_{suffix}"] = float(rho[sel].std()) if sel.any() else 0.0
    return out


def _seq_log_ratio(dump: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(response lengths, log π(y)/μ(y)) per sequence: the unclamped token log-ratios summed, the sum clamped to
    ±LOG_RATIO_CLAMP — the trainer's sequence ratio (`metrics.step`, `objectives.ratios`)."""
    lp_tr, lp_ro, mask = response_arrays(dump)
    lr = np.clip(np.sum((lp_tr.astype(np.float64) - lp_ro) * mask, axis=1), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return mask.sum(axis=1), lr


# -- inputs --------------------------------------------------------------------------------------------------


def read_prompt_ids(path: str, vocab_size: int, limit: int) -> list[list[int]]:
    """`--prompt-ids` JSONL: one prompt a line, a JSON list of token ids (or {"prompt_ids": [...]})."""
    from jaxrl_mismatch.data.jsonl import iter_jsonl

    prompts = []
    for lineno, obj, _ in iter_jsonl(path, "--prompt-ids"):
        ids = obj.get("prompt_ids") if isinstance(obj, dict) else obj
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)):
            raise UsageError(f"--prompt-ids {path}:{lineno}: expected a non-empty JSON list of token ids in "
                             f"[0, {vocab_size})")
        prompts.append(ids)
        if len(prompts) == limit:
            break
    if not prompts:
        raise UsageError(f"--prompt-ids {path}: no prompts in the file")
    return prompts


def note_fewer_prompts(a: argparse.Namespace, got: int) -> None:
    """A file's first --num-prompts records are all of them when it holds fewer: said, and `a.num_prompts` set to
    the number used, so the settings a job records say what was sampled (they said 100 for 12)."""
    if got < a.num_prompts:
        print(f"analyze: {'--prompt-ids ' + a.prompt_ids if a.prompt_ids else '--file ' + str(a.file)} holds {got} "
              f"prompts, fewer than --num-prompts {a.num_prompts}: sampling all {got}", flush=True)
        a.num_prompts = got


def task_prompts(a: argparse.Namespace) -> tuple[list[list[int]], tuple[int, ...], int]:
    """(prompt ids, stop ids, tokenizer vocab size) of `--num-prompts` prompts of `--task`, rendered through the
    task's template with the checkpoint's tokenizer (the path `perfectible` and the trainer take). The arithmetic
    task draws its problems with `--data-seed` (never `--seed`: other sampling seeds answer the same prompts); a
    file-backed task takes the first `--num-prompts` records of `--file`. A problem with the prompts (more asked
    than the task holds, characters the tokenizer does not know) is a UsageError naming the flag, file and line."""
    from jaxrl_mismatch.data import get_task
    from jaxrl_mismatch.data.batching import PromptError, generation_stop_ids, tokenize_prompts
    from jaxrl_mismatch.data.tokenizer import load_tokenizer

    task = get_task(a.task)
    try:
        tok = load_tokenizer(a.model)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"--model {a.model}: {e} (a checkpoint without a tokenizer takes --prompt-ids)") from None
    if a.task == "arithmetic":
        spec = task_json("--model", a.model)[0]
        try:
            texts = [r["prompt_text"] for r in task.load(a.split, n=a.num_prompts, seed=a.data_seed, **spec)]
        except ValueError as e:
            raise UsageError(f"--num-prompts {a.num_prompts}: task arithmetic (split {a.split}, the spec of "
                             f"{a.model}/task.json): {e}") from None
        where = [f"--task arithmetic: problem {k} (--data-seed {a.data_seed})" for k in range(len(texts))]
    else:
        from jaxrl_mismatch.data.jsonl import read_task_file

        records = read_task_file(a.task, existing_file("--file", a.file), a.num_prompts)[0]
        texts, where = [r["prompt_text"] for r in records], [r["where"] for r in records]
    if not texts:
        raise UsageError(f"--task {a.task}: no prompts")
    template = a.template or task.template
    try:  # the first prompt the tokenizer refuses, by its file and line (or problem index)
        ids = tokenize_prompts(tok, texts, template=template, where=where)
    except PromptError as e:
        raise UsageError(str(e)) from None
    return ids, generation_stop_ids(tok, template), tok.vocab_size


DEFAULT_MAX_TOKENS = 128  # without --max-tokens and without a warm start's task.json naming its own
DEFAULT_DATA_SEED = 0  # the arithmetic task's problems: the same prompts whatever --seed samples with


def prompt_source_args(a: argparse.Namespace) -> None:
    """--prompt-ids or a task's prompts (--task, default arithmetic; --split, default train, arithmetic only;
    --data-seed, arithmetic only; --file, file-backed tasks only; --template), never both, each flag only where it
    is used: a flag the prompts ignore was recorded in the summary as if used. All checked before any work."""
    from jaxrl_mismatch.data import TASKS
    from jaxrl_mismatch.data.templates import TEMPLATES

    data_seed = getattr(a, "data_seed", None)
    task_flags = [f for f, v in (("--task", a.task), ("--split", a.split), ("--file", a.file),
                                 ("--template", a.template), ("--data-seed", data_seed)) if v is not None]
    if a.prompt_ids is not None:
        existing_file("--prompt-ids", a.prompt_ids)
        if task_flags:
            raise UsageError(f"{task_flags[0]} goes with a task's prompts; --prompt-ids gives the prompts itself "
                             "(give one or the other)")
        return
    a.task = a.task or "arithmetic"
    if a.task not in TASKS:
        raise UsageError(f"--task {a.task}: unknown task; valid: {', '.join(sorted(TASKS))}")
    if a.template is not None and a.template not in TEMPLATES:
        raise UsageError(f"--template {a.template}: unknown prompt template; valid: {', '.join(sorted(TEMPLATES))}")
    if a.task == "arithmetic":
        from jaxrl_mismatch.data.arithmetic import check_split

        if a.file is not None:
            raise UsageError(f"--file {a.file}: task 'arithmetic' generates its prompts and reads no file; pass "
                             "--task NAME for a file-backed task")
        a.split = a.split or "train"
        try:
            check_split(a.split)
        except ValueError as e:
            raise UsageError(f"--split {a.split}: {e}") from None
        a.data_seed = check_seed("--data-seed", DEFAULT_DATA_SEED if data_seed is None else data_seed)
        return
    if a.split is not None:
        raise UsageError(f"--split {a.split}: task {a.task!r} reads its prompts from --file (--split picks a split "
                         "of the arithmetic task only); drop --split")
    if data_seed is not None:
        raise UsageError(f"--data-seed {data_seed}: task {a.task!r} takes the first --num-prompts records of --file "
                         "in file order (--data-seed draws the arithmetic task's problems only); drop --data-seed")
    if not a.file:
        raise UsageError(f"--file: task {a.task!r} reads a local JSONL file; pass --file PATH")
    existing_file("--file", a.file)


# -- the run ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PairResult:
    trainer: str
    engine: str
    dump: dict[str, np.ndarray]
    summary: dict[str, float]
    # why the engine dtype gave no rollouts (its log-probs not finite: the model overflows in it); then no dump
    engine_error: str | None = None

    @property
    def name(self) -> str:
        return pair_name(self.trainer, self.engine)

    @property
    def nonfinite(self) -> int:
        """How many of the pair's response tokens have a non-finite trainer log-prob (0: all finite)."""
        return int(self.summary.get("analysis/nonfinite_logp_train", 0))

    @property
    def usable(self) -> bool:
        """Finite on both sides: the pair's metrics are numbers (and it can be plotted)."""
        return self.engine_error is None and not self.nonfinite

    def json(self) -> dict:
        return {"engine_error": self.engine_error} if self.engine_error is not None else self.summary


def pair_result(trainer: str, engine: str, rows, logp_train: np.ndarray, prompt_id: np.ndarray,
                sample_id: np.ndarray) -> PairResult:
    """One pair's dump and summary from the padded rows and the trainer's log-probs. A trainer that overflows
    (fp16, say) gives non-finite log-probs: the pair is kept, `analysis/nonfinite_logp_train` counts them, and
    the metrics they enter are NaN (written as "nan" in JSON, `n/a` in the table), never a number."""
    resp = rows.response_mask > 0
    logp_train = np.where(resp, logp_train, 0.0).astype(np.float32)
    dump = token_dump(rows.response_mask, rows.tokens[:, 1:], logp_train, rows.rollout_logp, prompt_id, sample_id)
    bad = int((~np.isfinite(logp_train[resp])).sum())
    with np.errstate(invalid="ignore", over="ignore"):
        summary = summarize(dump)
    summary["analysis/nonfinite_logp_train"] = float(bad)
    if bad:  # a NaN inside a clipped or bucketed metric can come out as a finite number: none of them is one
        for k in summary:
            if k.startswith(("mismatch/", "analysis/logp_abs_diff", "analysis/seq_log_ratio", "analysis/rho_std")):
                summary[k] = math.nan
    return PairResult(trainer, engine, dump, summary)


TABLE_COLUMNS = (("log_ppl_abs_diff", "mismatch/log_ppl_abs_diff"), ("rho_std", "mismatch/rho_std"),
                 ("max_abs_dlogp", "analysis/logp_abs_diff_max"), ("pcc_pi_mu", "mismatch/prob_pearson"),
                 ("seq_log_ratio_abs_max", "analysis/seq_log_ratio_abs_max"))


def pairs_tables(results: Sequence[PairResult]) -> tuple[str, str]:
    """(terminal table, Markdown) of log_ppl_abs_diff, ρ std, max |Δ log p|, … per (trainer, engine) pair."""
    head = ["pair (trainer:engine)", "tokens"] + [c for c, _ in TABLE_COLUMNS]
    fmt = {"mismatch/prob_pearson": "{:.6f}"}
    head.append("nonfinite_logp")
    num = lambda k, v: fmt.get(k, "{:.3g}").format(v) if math.isfinite(v) else "n/a"  # noqa: E731
    rows = [[r.name, "0"] + ["n/a"] * len(TABLE_COLUMNS) + ["engine"] if r.engine_error is not None else
            [r.name, str(int(r.summary["analysis/tokens"]))]
            + [num(k, r.summary[k]) for _, k in TABLE_COLUMNS] + [str(r.nonfinite)] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) + 2 for i, h in enumerate(head)]
    text = ["".join(h.ljust(w) for h, w in zip(head, widths))]
    text += ["".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(row) + " |" for row in rows]
    by_name = {r.name: r.summary for r in results if r.usable}
    bf16, fp16 = by_name.get("bf16:bfloat16"), by_name.get("fp16:float16")
    if bf16 is not None and fp16 is not None:  # the FP16 paper's claim (§3.5, Fig. 2), measured
        ratios = ", ".join(f"{c} ×{bf16[k] / fp16[k]:.1f}" for c, k in TABLE_COLUMNS[:3] if fp16[k] > 0)
        line = f"bf16:bfloat16 over fp16:float16 — {ratios}"
        text.append(line)
        md += ["", line + "."]
    return "\n".join(text), "\n".join(md) + "\n"


def run_rollouts(a: argparse.Namespace, out: str) -> list[PairResult]:
    """Sample once per engine dtype through a launched rollout server (its log in `out/server_<dtype>`), score
    with every trainer precision paired with it, write each pair's `tokens.npz` + `summary.json` under `out`;
    results in the order of `a.pairs`."""
    from jaxrl_mismatch.data.batching import pad_rows
    from jaxrl_mismatch.rollout import SamplingSpec
    from jaxrl_mismatch.rollout.engine import NonFiniteLogprobsError, check_finite_logprobs
    from jaxrl_mismatch.rollout.session import RolloutSession

    cfg = ModelConfig.from_hf(a.model)
    if a.prompt_ids:
        prompts = read_prompt_ids(a.prompt_ids, cfg.vocab_size, a.num_prompts)
        stop_ids, tok_vocab = tuple(a.stop_ids), None
    else:
        prompts, stop_ids, tok_vocab = task_prompts(a)
    note_fewer_prompts(a, len(prompts))
    longest = max(len(p) for p in prompts)
    limit = cfg.max_position_embeddings
    if limit is not None and longest + a.max_tokens > limit:
        raise UsageError(f"--max-tokens {a.max_tokens}: the longest prompt ({longest} tokens) + max_tokens exceeds "
                         f"the model's max_position_embeddings {limit}")
    spec = SamplingSpec(n=a.n, max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed,
                        stop_token_ids=tuple(stop_ids))
    prompt_id = np.repeat(np.arange(len(prompts)), a.n)
    sample_id = np.tile(np.arange(a.n), len(prompts))
    row_prompts = [prompts[i] for i in prompt_id]
    results: list[PairResult] = []
    for engine in dict.fromkeys(e for _, e in a.pairs):  # one server per engine dtype, in the order given
        t0 = time.perf_counter()
        print(f"analyze: sampling {len(prompts)} prompts × {a.n} (max {a.max_tokens} tokens, T={a.temperature}) "
              f"with the {a.engine} engine in {engine}", flush=True)
        work_dir = os.path.join(out, f"server_{engine}")
        with RolloutSession.launch(work_dir=work_dir, engine=a.engine, model=a.model, dtype=engine) as session:
            session.check_compatible(architecture=cfg.architecture, vocab_size=cfg.vocab_size,
                                     tokenizer_vocab_size=tok_vocab)
            error = None
            try:
                groups = session.generate(prompts, spec)
                check_finite_logprobs(groups)
            except NonFiniteLogprobsError as e:  # the engine's dtype overflows on this model: no pair can be made
                # with it; the other engines' pairs are still measured, and this one is reported
                error = f"the {engine} engine's log-probs of this model are not finite ({e})"
        # The stopped server's push token is no output: the folder gets ordinary permissions when renamed into place.
        with contextlib.suppress(FileNotFoundError):
            os.remove(session.server.token_file)
        if error is not None:
            print(f"analyze: {error}: no pair with the {engine} engine "
                  f"({', '.join(pair_name(t, engine) for t, e in a.pairs if e == engine)})", flush=True)
            results += [PairResult(t, engine, {}, {}, error) for t, e in a.pairs if e == engine]
            continue
        comps = [groups[i][j] for i, j in zip(prompt_id, sample_id)]
        rows = pad_rows(row_prompts, [c.token_ids for c in comps], [c.logprobs for c in comps], pad_id=0)
        t_sample = time.perf_counter() - t0
        for trainer in (t for t, e in a.pairs if e == engine):
            t1 = time.perf_counter()
            logp_train = score_rows(a.model, trainer, rows.tokens, rows.attention_mask, temperature=a.temperature,
                                    chunk_size=a.chunk_size, fp32_lm_head=a.fp32_lm_head)
            res = pair_result(trainer, engine, rows, logp_train, prompt_id, sample_id)
            res.summary["analysis/sample_seconds"] = round(t_sample, 2)
            res.summary["analysis/score_seconds"] = round(time.perf_counter() - t1, 2)
            summary = res.summary
            pair_dir = os.path.join(out, f"{trainer}-{engine}")
            os.makedirs(pair_dir)
            np.savez(os.path.join(pair_dir, "tokens.npz"), **res.dump)
            write_json(os.path.join(pair_dir, "summary.json"), {"trainer": trainer, "engine": engine, **summary})
            if res.nonfinite:
                print(f"analyze: {res.name}: {res.nonfinite} of {int(summary['analysis/tokens'])} trainer log-probs "
                      f"are not finite (overflow in {trainer}?): its mismatch metrics are not finite and are "
                      "reported as such", flush=True)
            else:
                print(f"analyze: {res.name}: {int(summary['analysis/tokens'])} tokens, log_ppl_abs_diff "
                      f"{summary['mismatch/log_ppl_abs_diff']:.3g}, ρ std {summary['mismatch/rho_std']:.3g}, "
                      f"max |Δlog p| {summary['analysis/logp_abs_diff_max']:.3g}", flush=True)
            results.append(res)
    order = {p: k for k, p in enumerate(a.pairs)}
    return sorted(results, key=lambda r: order[(r.trainer, r.engine)])


# -- command line ----------------------------------------------------------------------------------------------


def add_parser(sub) -> None:
    r = sub.add_parser("rollouts",
                       help="score engine rollouts with the trainer at chosen precisions (FP16 paper Fig. 2)")
    r.add_argument("--model", required=True, help="local HF checkpoint (config.json + safetensors [+ tokenizer])")
    r.add_argument("--task", default=None,
                   help="prompt source (data.TASKS) read with the model's tokenizer (default arithmetic)")
    r.add_argument("--file", default=None, help="JSONL of a file-backed task")
    r.add_argument("--split", default=None, help="split of --task (default train)")
    r.add_argument("--template", default=None, help="prompt template (default: the task's)")
    r.add_argument("--prompt-ids", default=None,
                   help="JSONL of token-id prompts (one JSON list a line) instead of --task: no tokenizer needed")
    r.add_argument("--stop-ids", default="", help="with --prompt-ids: comma-separated stop token ids")
    r.add_argument("--engine", choices=("jax", "vllm"), default="jax")
    r.add_argument("--engine-dtype", default=None, help=f"one of {', '.join(precision.DTYPES)} (default float32)")
    r.add_argument("--trainer-precision", default=None, help=f"one of {', '.join(TRAINER_PRECISIONS)} (default fp32)")
    r.add_argument("--pairs", default=None,
                   help="several TRAINER:ENGINE pairs, e.g. fp32:float32,bf16:bfloat16,fp16:float16 (instead of "
                        "--trainer-precision/--engine-dtype)")
    r.add_argument("--fp32-lm-head", action="store_true", help="trainer: LM head and softmax in float32")
    r.add_argument("--num-prompts", type=int, default=64)
    r.add_argument("--n", type=int, default=4, help="samples per prompt")
    r.add_argument("--max-tokens", type=int, default=None, help="response limit (default: task.json's, else 128)")
    r.add_argument("--temperature", type=float, default=1.0,
                   help=f">= {GREEDY_TEMPERATURE:g} (lower is greedy); the trainer scores π at the same T")
    r.add_argument("--seed", type=int, default=0,
                   help="sampling seed of the engine: another seed gives other responses to the same prompts")
    r.add_argument("--data-seed", type=int, default=None,
                   help=f"arithmetic task only: which problems are drawn (default {DEFAULT_DATA_SEED}, whatever --seed)")
    r.add_argument("--chunk-size", type=int, default=256, help="trainer log-prob chunk (sequence positions)")
    r.add_argument("--axes", choices=("prob", "log"), default="prob", help="scatter axes: probabilities or log-probs")
    r.add_argument("--out", required=True, help="new or empty output directory")
    r.add_argument("--force", action="store_true", help="replace an earlier `analyze rollouts` output in --out")


BYTES_PER_SAMPLE_TOKEN = 64  # padded rows, both log-probs, masks and the dump: a generous bound per token


def check_sampled_temperature(temperature: float) -> None:
    """π and μ are compared as sampled distributions, softmax(logits / T), as the trainer scores them: below
    `GREEDY_TEMPERATURE` the engines decode greedily (μ is not that softmax), so such a T is refused, as the
    trainer refuses it for `rollout.temperature`."""
    if not (math.isfinite(temperature) and temperature >= GREEDY_TEMPERATURE):
        raise UsageError(f"--temperature must be >= {GREEDY_TEMPERATURE:g} (below it the engines decode greedily; "
                         f"π and μ are compared as sampled distributions), got {temperature}")


def check_sample_count(num_prompts: int, n: int, max_tokens: int) -> None:
    """--num-prompts, --n, --max-tokens within int32 (what the protocol sends), and the samples' arrays
    (num_prompts · n rows of up to max_tokens tokens) within half the machine's memory: refused before any work
    (3·10⁹ samples was a MemoryError after the prompts were read)."""
    for flag, value in (("--num-prompts", num_prompts), ("--n", n), ("--max-tokens", max_tokens)):
        if value > INT32_MAX:
            raise UsageError(f"{flag} must be <= 2^31 - 1 (the rollout protocol's int32), got {value}")
    need = num_prompts * n * max_tokens * BYTES_PER_SAMPLE_TOKEN
    mem = physical_memory_bytes()
    if mem and need > mem // 2:
        flag = "--num-prompts" if num_prompts >= n else "--n"
        raise UsageError(f"{flag} {num_prompts if flag == '--num-prompts' else n}: {num_prompts} prompts "
                         f"(--num-prompts) × {n} samples (--n) × {max_tokens} tokens (--max-tokens) need about {need / 2**30:.3g} GiB, more than half of this machine's "
                         f"{mem / 2**30:.3g} GiB; lower --n or --num-prompts")
    if num_prompts * n > INT32_MAX:
        raise UsageError(f"--n {n}: {num_prompts} prompts (--num-prompts) × {n} samples is more than 2^31 - 1 "
                         "samples")


def _check_args(a: argparse.Namespace) -> None:
    if a.pairs is not None:
        if a.engine_dtype is not None or a.trainer_precision is not None:
            raise UsageError("--pairs replaces --trainer-precision/--engine-dtype; give one or the other")
        a.pairs = parse_pairs(a.pairs)
    else:
        trainer, engine = a.trainer_precision or "fp32", a.engine_dtype or "float32"
        if trainer not in TRAINER_PRECISIONS:
            raise UsageError(f"--trainer-precision {trainer}: valid: {', '.join(TRAINER_PRECISIONS)}")
        if engine not in precision.DTYPES:
            raise UsageError(f"--engine-dtype {engine}: valid: {', '.join(precision.DTYPES)}")
        a.pairs = [(trainer, engine)]
    cfg = model_config("--model", a.model)
    prompt_source_args(a)
    if a.prompt_ids is None and a.stop_ids:
        raise UsageError("--stop-ids goes with --prompt-ids (a --task stops at its tokenizer's EOS)")
    a.stop_ids = int_list("--stop-ids", a.stop_ids) if a.stop_ids else []
    if bad := [i for i in a.stop_ids if not 0 <= i < cfg.vocab_size]:
        raise UsageError(f"--stop-ids: token id {bad[0]} is outside the model's vocabulary [0, {cfg.vocab_size})")
    a.stop_ids = list(dict.fromkeys(a.stop_ids))  # a repeated id stops nothing more
    if len(a.stop_ids) > MAX_STOP_TOKEN_IDS:  # the rollout server's bound: refused now, not after it started
        raise UsageError(f"--stop-ids: at most {MAX_STOP_TOKEN_IDS} distinct ids, got {len(a.stop_ids)}")
    if a.max_tokens is None:
        a.max_tokens = task_json("--model", a.model)[1] or DEFAULT_MAX_TOKENS
    for flag, value in (("--num-prompts", a.num_prompts), ("--n", a.n), ("--max-tokens", a.max_tokens),
                        ("--chunk-size", a.chunk_size)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    check_sample_count(a.num_prompts, a.n, a.max_tokens)
    check_sampled_temperature(a.temperature)
    check_seed("--seed", a.seed)
    if why := vllm_temperature_problem(a.engine, a.temperature):  # μ at 0.01, π scored at --temperature
        raise UsageError(f"--temperature: {why}")


def run(a: argparse.Namespace) -> int:
    """The subcommand: sample, score every pair, print the table, write the summary, dumps and figure — all into
    a temporary sibling of --out renamed into place (`outputs.staged_dir`; --out checked before any server starts)."""
    _check_args(a)
    with staged_dir("--out", a.out, KIND, force=a.force) as tmp:
        results = run_rollouts(a, tmp)
        text, md = pairs_tables(results)
        print(text, flush=True)
        settings = {k: getattr(a, k) for k in ("model", "task", "split", "file", "template", "data_seed", "prompt_ids",
                                                "stop_ids", "engine", "num_prompts", "n", "max_tokens", "temperature",
                                                "seed", "fp32_lm_head")}
        write_json(os.path.join(tmp, "summary.json"),
                          {"settings": settings, "pairs": {r.name: r.json() for r in results}})
        with open(os.path.join(tmp, "pairs.md"), "w") as f:
            f.write(md)
        from jaxrl_mismatch.report.analysis import plot_pairs

        plotted = [r for r in results if r.usable]  # a figure of NaN is no figure
        if plotted:
            plot_pairs([(r.name, r.dump, r.summary, *_seq_log_ratio(r.dump)) for r in plotted],
                       [s for s, _, _ in bucket_names(MetricsConfig())], os.path.join(tmp, "analysis.png"),
                       axes=a.axes)
    skipped = [r.name for r in results if not r.usable]
    print(f"analyze: wrote summary.json, pairs.md, {'analysis.png and ' if plotted else ''}"
          f"<trainer>-<engine>/tokens.npz in {a.out}"
          + (f" (pairs with non-finite log-probs, not plotted: {', '.join(skipped)})" if skipped else ""),
          flush=True)
    return 0
