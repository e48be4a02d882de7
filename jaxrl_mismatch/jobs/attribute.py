"""`jaxrl-mismatch analyze attribute`: where the training–inference mismatch comes from, layer by layer and op by op.

For the same rows (prompts + responses the built-in engine sampled, `rollout.JaxEngine` at the engine dtype):

- the **engine path** replays the rows teacher-forced through the engine's own program pieces (`kv_cache.prefill`,
  then one `kv_cache.decode_step` per response token, the engine's dtype, its KV cache, and `jax_engine.step_logprobs`
  for log μ), and
- the **trainer path** scores them as the θ_old forward of train/step.py does (`models.scoring`: one full
  forward at the trainer precision, float32 master weights),

both with `Block`s sowing their input norm, attention, post-attention norm, MLP and block outputs as
`nnx.Intermediate` (`model.capture_intermediates`). Per layer and component it reports the relative divergence
‖a − b‖₂ / ‖b‖₂ (a = engine, b = trainer, over the real tokens of all rows; the embedding and the response
log-probs too).

Ablation matrix: the rows are re-scored with one component at a time in float32 on both sides
(`precision.COMPONENTS`: LM head, attention scores/softmax, RMSNorm, MLP, MoE router) and the mismatch left is
computed by the trainer's own `metrics.step_metrics` (`mismatch/log_ppl_abs_diff`, `mismatch/rho_std`; through
`analyze_rollouts.summarize`). The trainer's master weights are the checkpoint's values rounded to the engine's
parameter dtype — the weights the engine holds after a sync — so the table attributes *compute* precision, not the
rounding of stored weights.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from jaxrl_mismatch import precision
from jaxrl_mismatch.jobs import analyze_rollouts
from jaxrl_mismatch.models import kv_cache, load_hf, make_scorer
from jaxrl_mismatch.models.model import CAPTURED, capture_intermediates, positions_from_mask
from jaxrl_mismatch.models.sharding import tree_path
from jaxrl_mismatch.outputs import staged_dir, write_json
from jaxrl_mismatch.rollout.engine import NonFiniteLogprobsError, SamplingSpec
from jaxrl_mismatch.rollout.validation import GREEDY_TEMPERATURE
from jaxrl_mismatch.rollout.jax_engine import _POLICY, JaxEngine, step_logprobs
from jaxrl_mismatch.jobs._inputs import model_config
from jaxrl_mismatch.usage import UsageError, check_seed

KIND = "analyze attribute"  # --out's writer as typed; its marker: outputs.marker_name
METRICS = ("mismatch/log_ppl_abs_diff", "mismatch/rho_std")
BASELINE = "none"


def add_parser(sub) -> None:
    p = sub.add_parser("attribute",
                       help="per-layer/per-op divergence of the engine's vs the trainer's forward, and fp32 ablations")
    p.add_argument("--model", required=True, help="local HF checkpoint (config.json + safetensors)")
    p.add_argument("--prompt-ids", default=None, help="JSONL of token-id prompts (one JSON list a line)")
    p.add_argument("--task", default=None, help="instead of --prompt-ids: prompts of this task (data.TASKS), "
                                                "rendered with the checkpoint's tokenizer")
    p.add_argument("--file", default=None, help="JSONL of a file-backed --task")
    p.add_argument("--split", default=None, help="split of --task (default train)")
    p.add_argument("--template", default=None, help="prompt template of --task (default: the task's)")
    p.add_argument("--pairs", default="fp32:bfloat16",
                   help="TRAINER:ENGINE pairs, e.g. fp32:bfloat16,fp16:float16 (default fp32:bfloat16)")
    p.add_argument("--components", default=None,
                   help=f"ablations, comma-separated from {','.join(precision.COMPONENTS)} (default: all that apply; "
                        "router only for MoE)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=2, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="response length (no stop tokens: every row is full)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help=f">= {GREEDY_TEMPERATURE:g} (lower is greedy); the trainer scores π at the same T")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed of the engine: another seed gives other responses to the same prompts")
    p.add_argument("--data-seed", type=int, default=None,
                   help="--task arithmetic only: which problems are drawn (default 0, whatever --seed)")
    p.add_argument("--out", required=True, help="new or empty output directory")
    p.add_argument("--force", action="store_true", help="replace an earlier `analyze attribute` output in --out")


def check_args(a: argparse.Namespace) -> None:
    """Validate every flag before any work; UsageError (one line, exit 2) naming the flag."""
    a.pairs = analyze_rollouts.parse_pairs(a.pairs)
    cfg = model_config("--model", a.model)
    if (a.prompt_ids is None) == (a.task is None):
        raise UsageError("--prompt-ids or --task: give exactly one of them")
    analyze_rollouts.prompt_source_args(a)
    for flag, value in (("--num-prompts", a.num_prompts), ("--n", a.n), ("--max-tokens", a.max_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    analyze_rollouts.check_sample_count(a.num_prompts, a.n, a.max_tokens)
    analyze_rollouts.check_sampled_temperature(a.temperature)
    check_seed("--seed", a.seed)
    a.is_moe = bool(cfg.is_moe)
    default = [c for c in precision.COMPONENTS if c != "router" or a.is_moe]
    if a.components is None:
        a.components = default
    else:
        a.components = [c.strip() for c in a.components.split(",") if c.strip()]
        bad = [c for c in a.components if c not in precision.COMPONENTS]
        if bad or not a.components:
            raise UsageError(f"--components: unknown {bad or 'empty list'}; valid: {','.join(precision.COMPONENTS)}")
        if "router" in a.components and not a.is_moe:
            raise UsageError(f"--components router: {a.model} is a dense model (no MoE router)")
        if len(set(a.components)) != len(a.components):
            raise UsageError("--components: a component is listed twice")
    if a.prompt_ids is not None:
        a.prompts = analyze_rollouts.read_prompt_ids(a.prompt_ids, cfg.vocab_size, a.num_prompts)
    else:
        a.prompts, _, tokenizer_vocab = analyze_rollouts.task_prompts(a)
        if tokenizer_vocab > cfg.vocab_size:  # an id past the embedding table would be clamped by the gather
            raise UsageError(f"--model {a.model}: tokenizer/model mismatch: the tokenizer has {tokenizer_vocab} ids "
                             f"but the model's vocab_size is {cfg.vocab_size}")
    analyze_rollouts.note_fewer_prompts(a, len(a.prompts))  # attribution.json's settings: the number used
    longest = max(len(p) for p in a.prompts) + a.max_tokens
    if longest > cfg.max_position_embeddings:
        raise UsageError(f"--max-tokens {a.max_tokens}: the longest prompt + response ({longest}) exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")


# -- the two paths -------------------------------------------------------------------------------------------------


def _flat_intermediates(state: nnx.State) -> dict[str, Array]:
    """`nnx.capture`'s intermediates → {"layers.<i>.<name>": array} (each sow holds a 1-tuple)."""
    flat = {}
    for path, value in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
        keys = tree_path(path).split("/")
        flat[".".join(keys[:-1] if keys[-1] == "0" else keys)] = value
    return flat


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _engine_prefill(graphdef, state, prompt_ids, prompt_mask, cache):
    model = nnx.merge(graphdef, state)
    (logits, cache), inter = nnx.capture(kv_cache.prefill, nnx.Intermediate)(model, prompt_ids, prompt_mask, cache)
    return logits, cache, _flat_intermediates(inter)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _engine_decode(graphdef, state, token, cache):
    model = nnx.merge(graphdef, state)
    (logits, cache), inter = nnx.capture(kv_cache.decode_step, nnx.Intermediate)(model, token, cache)
    return logits, cache, _flat_intermediates(inter)


def engine_path(model, prompt_ids: np.ndarray, prompt_mask: np.ndarray, response: np.ndarray, temperature: float
                ) -> tuple[Float[np.ndarray, "rows resp"], dict[str, np.ndarray]]:
    """Teacher-forced replay through the engine's prefill + decode steps: (log μ of each response token, the
    intermediates `[rows, prompt + resp - 1, hidden]` at the input positions the trainer's forward sees)."""
    capture_intermediates(model, True)
    graphdef, state = nnx.split(model)
    rows, plen = prompt_ids.shape
    r = response.shape[1]
    cache = kv_cache.init_cache(model.cfg, rows, plen + r, model.policy.dtype_of("attention"))
    logits, cache, inter = _engine_prefill(graphdef, state, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), cache)
    parts = {k: [np.asarray(v)] for k, v in inter.items()}
    logps = []
    for t in range(r):
        lp_all = step_logprobs(logits, jnp.float32(temperature), 0, 1.0, filtering=False)
        logps.append(np.take_along_axis(np.asarray(lp_all), response[:, t:t + 1], axis=1)[:, 0])
        if t == r - 1:
            break
        logits, cache, inter = _engine_decode(graphdef, state, jnp.asarray(response[:, t]), cache)
        for k, v in inter.items():
            parts[k].append(np.asarray(v))
    capture_intermediates(model, False)
    return np.stack(logps, axis=1), {k: np.concatenate(v, axis=1) for k, v in parts.items()}


@functools.partial(jax.jit, static_argnames=("capturing",))
def _trainer_capture(capturing, state, tokens, mask):
    inputs, input_mask = tokens[:, :-1], mask[:, :-1]
    forward = nnx.capture(lambda m: m(inputs, positions_from_mask(input_mask), input_mask), nnx.Intermediate)
    _, inter = forward(nnx.merge(capturing, state))
    return _flat_intermediates(inter)


@functools.cache
def _scorer(graphdef: nnx.GraphDef, temperature: float):
    """The trainer's scorer for one model structure and temperature, jitted once per command: pairs that share a
    trainer program (fp32 against bf16 and against fp16, say) trace and compile it once, not once per call."""
    return make_scorer(graphdef, chunk_size=256, temperature=temperature)


def trainer_path(model, tokens: np.ndarray, mask: np.ndarray, temperature: float
                 ) -> tuple[Float[np.ndarray, "rows seq"], dict[str, np.ndarray]]:
    """The trainer's θ_old forward on the whole rows: (log π of every next token from the trainer's scorer
    `models.scoring.make_scorer` — the program `analyze rollouts` scores with, no capture in it — and the
    intermediates `[rows, seq - 1, hidden]` of the same forward, captured in a program of its own)."""
    graphdef, state = nnx.split(model)
    capture_intermediates(model, True)
    capturing = nnx.graphdef(model)
    capture_intermediates(model, False)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    logp, _ = _scorer(graphdef, float(temperature))(state, tokens, mask)
    inter = _trainer_capture(capturing, state, tokens, mask)
    return np.asarray(logp), {k: np.asarray(v) for k, v in inter.items()}


def relative_divergence(a: np.ndarray, b: np.ndarray, valid: np.ndarray) -> float:
    """‖a − b‖₂ / ‖b‖₂ over the valid positions (float64); 0 when both are 0."""
    a64 = np.asarray(a, np.float64)[valid]
    b64 = np.asarray(b, np.float64)[valid]
    num, den = np.linalg.norm(a64 - b64), np.linalg.norm(b64)
    return float(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def divergence_table(eng: dict[str, np.ndarray], tr: dict[str, np.ndarray], valid: np.ndarray, num_layers: int
                     ) -> dict[str, dict[str, float]]:
    """{layer name: {component: ‖a−b‖/‖b‖}} for every block (`model.CAPTURED`)."""
    out = {}
    for i in range(num_layers):
        out[f"layer {i}"] = {c: relative_divergence(eng[f"layers.{i}.{c}"], tr[f"layers.{i}.{c}"], valid)
                             for c in CAPTURED}
    return out


# -- one pair ------------------------------------------------------------------------------------------------------


def _rows(prompts: list[list[int]], completions) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Left-padded prompt ids/mask, the responses, engine log μ, and the prompt index of each row."""
    flat = [(i, c) for i, cs in enumerate(completions) for c in cs]
    ids, pmask = kv_cache.left_pad([prompts[i] for i, _ in flat], width=max(len(p) for p in prompts))
    resp = np.asarray([c.token_ids for _, c in flat], np.int32)
    mu = np.asarray([c.logprobs for _, c in flat], np.float32)
    return ids, pmask, resp, mu, np.asarray([i for i, _ in flat], np.int32)


def _round_to(state: nnx.State, dtype) -> nnx.State:
    """Master weights as the engine holds them after a sync: rounded to its parameter dtype, kept in float32."""
    return jax.tree.map(lambda x: x.astype(dtype).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        state)


def _load_pair(model_dir: str, trainer: str, engine: str, components):
    eng_pol = precision.policy(_POLICY[engine], fp32_components=components)
    _, eng_model = load_hf(model_dir, policy=eng_pol)
    tr_pol = precision.policy(trainer, param_dtype="float32", fp32_components=components)
    _, tr_model = load_hf(model_dir, policy=tr_pol)
    graphdef, params, rest = nnx.split(tr_model, nnx.Param, ...)
    tr_model = nnx.merge(graphdef, _round_to(params, eng_pol.param_dtype), rest)
    return eng_model, tr_model


def attribute_pair(model_dir: str, trainer: str, engine: str, prompts: list[list[int]], *, components, n: int,
                   max_tokens: int, temperature: float, seed: int) -> dict:
    """Sample with the engine, then the per-layer divergence and the ablation matrix of one (trainer, engine) pair.

    An engine dtype the model overflows in gives no samples: the pair is then `{"trainer", "engine",
    "engine_error"}` (reported, and the other pairs still run)."""
    try:
        completions = JaxEngine(model_dir, dtype=engine).generate(
            prompts, SamplingSpec(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed))
    except NonFiniteLogprobsError as e:  # the engine's dtype overflows on this model: the pair has no samples
        return {"trainer": trainer, "engine": engine,
                "engine_error": f"the {engine} engine's log-probs of this model are not finite ({e})"}
    ids, pmask, resp, mu_engine, prompt_idx = _rows(prompts, completions)
    tokens = np.concatenate([ids, resp], axis=1)
    mask = np.concatenate([pmask, np.ones_like(resp)], axis=1)
    plen = ids.shape[1]
    valid = mask[:, :-1] > 0  # input positions of the trainer's forward
    response_mask = np.zeros(valid.shape, np.float32)
    response_mask[:, plen - 1:] = 1.0
    sample_id = np.arange(len(ids), dtype=np.int32)

    result = {"trainer": trainer, "engine": engine, "rows": int(len(ids)), "response_tokens": int(resp.size)}
    ablations = {}
    for setting in [BASELINE, *components]:
        comps = () if setting == BASELINE else (setting,)
        eng_model, tr_model = _load_pair(model_dir, trainer, engine, comps)
        mu, eng_inter = engine_path(eng_model, ids, pmask, resp, temperature)
        logp, tr_inter = trainer_path(tr_model, tokens, mask, temperature)
        pi = np.zeros_like(logp)
        pi[:, plen - 1:] = logp[:, plen - 1:]
        mu_full = np.zeros_like(logp)
        mu_full[:, plen - 1:] = mu
        summary = analyze_rollouts.summarize(analyze_rollouts.token_dump(
            response_mask, tokens[:, 1:], pi, mu_full, prompt_idx, sample_id))
        resp_pi, resp_mu = logp[:, plen - 1:], mu
        ablations[setting] = {k: summary[k] for k in METRICS}
        ablations[setting]["nonfinite_logp"] = {"trainer": int((~np.isfinite(resp_pi)).sum()),
                                                "engine": int((~np.isfinite(resp_mu)).sum())}
        if setting == BASELINE:
            num_layers = eng_model.cfg.num_hidden_layers
            result["divergence"] = divergence_table(eng_inter, tr_inter, valid, num_layers)
            result["divergence_model"] = {
                "embed": relative_divergence(*_embed_pair(eng_model, tr_model, tokens), valid),
                "logp (response)": relative_divergence(mu, logp[:, plen - 1:], np.ones_like(mu, bool)),
            }
            result["replay_vs_engine_logp_max_abs"] = float(np.max(np.abs(mu - mu_engine)))
    result["ablations"] = ablations
    result["most_removed"] = finish_ablations(ablations)
    return result


def _finite(row: dict) -> bool:
    """Whether an ablation's log-probs and mismatch are all finite (an fp16 side that overflows is not)."""
    bad = row.get("nonfinite_logp", {})
    return not any(bad.values()) and math.isfinite(row["mismatch/log_ppl_abs_diff"])


def finish_ablations(ablations: dict[str, dict]) -> str | None:
    """Sets each row's `removed_frac` (1 − left / baseline; None where either side is not finite, or the baseline
    is 0: there is no fraction to remove) and returns `most_removed` over the finite ablations. A non-finite
    baseline removes nothing and is lowered by nothing: it is reported, never turned into 0 %."""
    base_row = ablations[BASELINE]
    base = base_row["mismatch/log_ppl_abs_diff"]
    for row in ablations.values():
        left = row["mismatch/log_ppl_abs_diff"]
        ok = _finite(base_row) and _finite(row) and base > 0
        row["removed_frac"] = float(1.0 - left / base) if ok else None
    if not _finite(base_row):
        return None
    return most_removed(base, {k: v for k, v in ablations.items() if k != BASELINE and _finite(v)})


def most_removed(base: float, fixes: dict[str, dict]) -> str | None:
    """The fp32 component that left the least mismatch, when it left less than the baseline `base`; None when no
    ablation lowered it (every one raised it, or the pair has none to remove): naming the least bad of them as
    the one that "removes most" would credit a component that removed nothing."""
    if not fixes:
        return None
    best = min(fixes, key=lambda k: fixes[k]["mismatch/log_ppl_abs_diff"])
    return best if fixes[best]["mismatch/log_ppl_abs_diff"] < base else None


def _nonfinite_text(row: dict) -> str:
    bad = row.get("nonfinite_logp", {})
    return ", ".join(f"{v} {k}" for k, v in bad.items() if v) or "0"


def _num(v: float) -> str:
    return f"{v:.3e}" if math.isfinite(v) else "n/a"


def _embed_pair(eng_model, tr_model, tokens):
    x = jnp.asarray(tokens[:, :-1])
    return np.asarray(eng_model.embed(x)), np.asarray(tr_model.embed(x))


# -- output --------------------------------------------------------------------------------------------------------


def tables(results: list[dict]) -> str:
    """Markdown: per pair, the divergence table (layers × components) and the ablation matrix."""
    lines = []
    for res in results:
        name = f"{res['trainer']}:{res['engine']}"
        if "engine_error" in res:
            lines += [f"## {name}", "", f"No samples: {res['engine_error']}.", ""]
            continue
        lines += [f"## {name} ({res['rows']} rows, {res['response_tokens']} response tokens)", "",
                  "Relative divergence ‖engine − trainer‖ / ‖trainer‖:", "",
                  "| layer | " + " | ".join(CAPTURED) + " |", "|---" * (len(CAPTURED) + 1) + "|"]
        for layer, row in res["divergence"].items():
            lines.append(f"| {layer} | " + " | ".join(f"{row[c]:.3e}" for c in CAPTURED) + " |")
        lines += ["", " · ".join(f"{k}: {v:.3e}" for k, v in res["divergence_model"].items()), "",
                  "Ablation (component in float32 on both sides):", "",
                  "| fp32 component | log_ppl_abs_diff | rho_std | mismatch removed | non-finite log-probs |",
                  "|---|---|---|---|---|"]
        for setting, row in res["ablations"].items():
            frac = row["removed_frac"]
            lines.append(f"| {setting} | {_num(row['mismatch/log_ppl_abs_diff'])} | {_num(row['mismatch/rho_std'])} "
                         f"| {'n/a' if frac is None else f'{100 * frac:.1f} %'} | {_nonfinite_text(row)} |")
        base_row = res["ablations"][BASELINE]
        if not _finite(base_row):
            lines += ["", f"The baseline's log-probs are not finite ({_nonfinite_text(base_row)}): its mismatch is "
                          "not a number, so no ablation is compared with it."]
        elif res["most_removed"]:
            lines += ["", f"Most mismatch removed by fp32 **{res['most_removed']}**."]
        elif len(res["ablations"]) > 1:
            lines += ["", "No fp32 component with finite log-probs lowered the mismatch."]
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> str:
    """Heat map of the divergence (layers × components) and a bar chart of the ablation matrix, one row per pair
    (`results` holds pairs with samples only)."""
    from jaxrl_mismatch.report.plot import save_figure  # sets the Agg backend before pyplot loads

    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.6 * len(results)), squeeze=False)
    for (ax_h, ax_b), res in zip(axes, results):
        name = f"{res['trainer']}:{res['engine']}"
        layers = list(res["divergence"])
        grid = np.array([[res["divergence"][l][c] for c in CAPTURED] for l in layers])
        im = ax_h.imshow(np.log10(np.maximum(grid, 1e-12)), aspect="auto", cmap="viridis")
        ax_h.set_xticks(range(len(CAPTURED)), CAPTURED, rotation=30, ha="right", fontsize=8)
        ax_h.set_yticks(range(len(layers)), layers, fontsize=8)
        ax_h.set_title(f"{name}: log10 ‖engine − trainer‖/‖trainer‖", fontsize=9)
        fig.colorbar(im, ax=ax_h)
        settings = list(res["ablations"])
        vals = [res["ablations"][s]["mismatch/log_ppl_abs_diff"] for s in settings]
        ax_b.bar(settings, vals, color=["grey"] + ["C0"] * (len(settings) - 1))
        ax_b.set_ylabel("mismatch/log_ppl_abs_diff")
        ax_b.set_title(f"{name}: mismatch left with one component in fp32", fontsize=9)
        ax_b.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def run(a: argparse.Namespace) -> int:
    check_args(a)
    with staged_dir("--out", a.out, KIND, force=a.force) as tmp:
        results = []
        for trainer, engine in a.pairs:
            t0 = time.perf_counter()
            res = attribute_pair(a.model, trainer, engine, a.prompts, components=a.components, n=a.n,
                                 max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            if "engine_error" in res:
                print(f"attribute: {trainer}:{engine}: {res['engine_error']}: no samples, the other pairs go on",
                      flush=True)
                results.append(res)
                continue
            base_row = res["ablations"][BASELINE]
            best = res["most_removed"]
            if not _finite(base_row):
                print(f"attribute: {trainer}:{engine}: non-finite log-probs ({_nonfinite_text(base_row)}); "
                      "log_ppl_abs_diff n/a", flush=True)
            else:
                print(f"attribute: {trainer}:{engine}: log_ppl_abs_diff {_num(base_row['mismatch/log_ppl_abs_diff'])}; "
                      + (f"fp32 {best} leaves {_num(res['ablations'][best]['mismatch/log_ppl_abs_diff'])}" if best
                         else "no fp32 component lowers it"), flush=True)
            results.append(res)
        md = tables(results)
        print(md, flush=True)
        settings = {k: getattr(a, k) for k in ("model", "prompt_ids", "task", "split", "file", "template",
                                                "data_seed", "num_prompts", "n", "max_tokens", "temperature", "seed",
                                                "components")}
        write_json(os.path.join(tmp, "attribution.json"), {"settings": settings, "pairs": results})
        with open(os.path.join(tmp, "attribution.md"), "w") as f:
            f.write("# analyze attribute\n\n" + md)
        sampled = [r for r in results if "engine_error" not in r]
        if sampled:
            plot(sampled, os.path.join(tmp, "attribution.png"))
    print(f"attribute: wrote attribution.json, attribution.md{', attribution.png' if sampled else ''} in {a.out}",
          flush=True)
    return 0


__all__ = ["add_parser", "attribute_pair", "check_args", "divergence_table", "engine_path", "relative_divergence",
           "run", "trainer_path"]
