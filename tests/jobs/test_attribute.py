"""`jaxrl-mismatch analyze attribute` on a tiny random Qwen3: the engine's KV-cache replay reproduces the engine's
μ, fp32 against fp32 diverges nowhere, bf16 against fp32 does in every layer, each fp32 component reaches the
program, the command writes its outputs safely, and bad input is one line with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_mismatch import precision
from jaxrl_mismatch.jobs import analyze, attribute
from jaxrl_mismatch.models import left_pad, load_hf
from jaxrl_mismatch.models.model import CAPTURED
from jaxrl_mismatch.usage import UsageError
from tests.rollout.conftest import VOCAB, make_tiny_qwen3

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(n=2, max_tokens=6, temperature=1.0, seed=0)


def _pair_rows(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt ids and mask with the rows and width `attribute_pair(**SMALL)` replays (each prompt
    `n` times): the tests that call `engine_path`/`trainer_path` directly then reuse the pair tests' jitted
    prefill, decode and capture programs instead of compiling their own for other shapes."""
    return left_pad([p for p in prompts for _ in range(SMALL["n"])], pad_id=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str, list[list[int]]]:
    root = tmp_path_factory.mktemp("attribute")
    ckpt = make_tiny_qwen3(root / "ckpt", tied=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, size=rng.integers(3, 9)).tolist() for _ in range(4)]
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return str(ckpt), str(path), prompts


def test_fp32_against_fp32_diverges_nowhere(tiny):
    ckpt, _, prompts = tiny
    res = attribute.attribute_pair(ckpt, "fp32", "float32", prompts, components=["lm_head"], **SMALL)
    assert res["replay_vs_engine_logp_max_abs"] < 1e-5  # the replay is the engine's computation
    for layer, row in res["divergence"].items():
        assert set(row) == set(CAPTURED)
        assert max(row.values()) < 1e-5, (layer, row)
    assert res["divergence_model"]["embed"] == 0.0
    for row in res["ablations"].values():
        assert row["mismatch/log_ppl_abs_diff"] < 1e-5 and row["mismatch/rho_std"] < 1e-5


def test_bf16_engine_against_fp32_trainer_diverges_in_every_layer(tiny):
    ckpt, _, prompts = tiny
    res = attribute.attribute_pair(ckpt, "fp32", "bfloat16", prompts, components=["lm_head", "attention", "mlp"],
                                   **SMALL)
    assert res["replay_vs_engine_logp_max_abs"] < 0.05  # same bf16 program pieces, other batch shapes
    for layer, row in res["divergence"].items():
        assert row["attn_out"] > 1e-4 and row["mlp_out"] > 1e-4 and row["block_out"] > 1e-4, (layer, row)
    base = res["ablations"]["none"]
    assert base["mismatch/log_ppl_abs_diff"] > 1e-4 and base["mismatch/rho_std"] > 1e-3
    # each fp32 component changes what is left (the override reaches both programs)
    for c in ("lm_head", "attention", "mlp"):
        assert res["ablations"][c]["mismatch/rho_std"] != base["mismatch/rho_std"], c
    assert res["most_removed"] in ("lm_head", "attention", "mlp")


def test_fp32_lm_head_on_both_sides_removes_the_lm_head_rounding(tiny):
    """With the trainer in fp32, the engine's only bf16 part left when every component is fp32 is its residual
    stream, projections and stored K/V; the LM head's own rounding is what fp32 lm_head removes: the engine's log μ
    moves towards the trainer's on the same hidden states."""
    ckpt, _, prompts = tiny
    ids, pmask = _pair_rows(prompts)
    resp = np.tile(np.arange(5, 5 + SMALL["max_tokens"], dtype=np.int32), (len(ids), 1))
    tokens = np.concatenate([ids, resp], axis=1)
    mask = np.concatenate([pmask, np.ones_like(resp)], axis=1)
    logp = {}
    for name, comps in (("bf16", ()), ("bf16+lm_head", ("lm_head",)), ("fp32", ())):
        dtype = "fp32" if name == "fp32" else "bf16"
        _, model = load_hf(ckpt, policy=precision.policy(dtype, fp32_components=comps))
        logp[name], _ = attribute.trainer_path(model, tokens, mask, 1.0)
    err = {k: float(np.abs(logp[k] - logp["fp32"]).mean()) for k in ("bf16", "bf16+lm_head")}
    assert 0 < err["bf16+lm_head"] < err["bf16"], err


@pytest.mark.parametrize("component", ["attention", "norm", "mlp"])
def test_each_component_override_changes_the_engine_program(tiny, component):
    ckpt, _, prompts = tiny
    ids, pmask = _pair_rows(prompts)
    resp = np.tile(np.asarray([4, 7, 9, 2, 8, 3], np.int32), (len(ids), 1))
    out = {}
    for comps in ((), (component,)):
        pol = precision.policy("bf16", fp32_components=comps)
        _, model = load_hf(ckpt, policy=pol)
        if component == "norm":  # the checkpoint's gains are all 1 (HF init): make the gain multiply round
            for layer in model.layers:
                layer.input_norm.scale[...] = np.linspace(0.7, 1.3, layer.input_norm.scale.shape[0]).astype(
                    pol.param_dtype)
        out[comps], _ = attribute.engine_path(model, ids, pmask, resp, 1.0)
    assert not np.array_equal(out[()], out[(component,)])


def test_policy_refuses_unknown_components():
    with pytest.raises(ValueError, match="fp32_components"):
        precision.policy("bf16", fp32_components=("softmax",))
    assert precision.policy("bf16", fp32_components=("lm_head",)).logits_dtype == jnp.float32
    assert precision.policy("bf16").dtype_of("attention") == jnp.bfloat16
    assert precision.policy("bf16", fp32_components=("attention",)).dtype_of("attention") == jnp.float32


def test_command_writes_json_markdown_and_figure_and_keeps_foreign_dirs(tiny, tmp_path, capsys):
    ckpt, prompts, _ = tiny
    out = tmp_path / "out"
    args = ["attribute", "--model", ckpt, "--prompt-ids", prompts, "--pairs", "fp32:bfloat16", "--components",
            "lm_head", "--num-prompts", "4", "--n", str(SMALL["n"]), "--max-tokens", str(SMALL["max_tokens"]),
            "--out", str(out)]  # the bf16 pair test's shapes: its sampling and replay programs are reused
    assert analyze.main(args) == 0
    data = json.loads((out / "attribution.json").read_text())
    (pair,) = data["pairs"]
    assert set(pair["ablations"]) == {"none", "lm_head"} and len(pair["divergence"]) == 2
    md = (out / "attribution.md").read_text()
    assert "| layer 1 |" in md and "| lm_head |" in md
    assert (out / "attribution.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]
    with pytest.raises(UsageError, match="--force"):  # an earlier output: kept unless --force
        analyze.main(args)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="--out"):
        analyze.main([*args[:-1], str(foreign)])
    assert (foreign / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("args, flag", [
    (["--pairs", "fp32:float64"], "--pairs"),
    (["--components", "softmax"], "--components"),
    (["--components", "router"], "--components"),
    (["--components", "mlp,mlp"], "--components"),
    (["--n", "0"], "--n"),
    (["--max-tokens", "300"], "--max-tokens"),
    (["--temperature", "0"], "--temperature"),
    (["--temperature", "5e-6"], "--temperature must be >= 1e-05"),
    (["--prompt-ids", "/nonexistent.jsonl"], "--prompt-ids"),
])
def test_bad_flags(tiny, tmp_path, args, flag):
    ckpt, prompts, _ = tiny
    base = {"--model": ckpt, "--prompt-ids": prompts, "--out": str(tmp_path / "o")}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    with pytest.raises(UsageError) as e:
        analyze.main(["attribute", *[x for kv in base.items() for x in kv]])
    assert flag in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    """`--task` rendered prompts with the checkpoint's tokenizer and never compared it with the model's vocabulary
    (`analyze rollouts` does, through the server): an id past the embedding table would have been clamped."""
    from flax import nnx

    from jaxrl_mismatch.data.tokenizer import build_arithmetic_tokenizer, save_tokenizer
    from jaxrl_mismatch.models import Transformer, save_hf
    from tests.train.tiny_policy import tiny_config

    tok = build_arithmetic_tokenizer()
    cfg = tiny_config(vocab_size=tok.vocab_size - 6)
    save_hf(Transformer(cfg, precision.policy("fp32"), rngs=nnx.Rngs(0)), cfg, tmp_path / "m")
    save_tokenizer(tok, str(tmp_path / "m"))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt_text": "1+2=", "answer": "3"}) + "\n")
    with pytest.raises(UsageError, match=rf"^--model {tmp_path / 'm'}: tokenizer/model mismatch: the tokenizer has "
                                         rf"{tok.vocab_size} ids but the model's vocab_size is {tok.vocab_size - 6}$"):
        analyze.main(["attribute", "--model", str(tmp_path / "m"), "--task", "arithmetic_prompts", "--file",
                      str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_cli_exits_2_with_one_line(tiny, tmp_path):
    ckpt, prompts, _ = tiny
    p = subprocess.run([sys.executable, "-m", "jaxrl_mismatch.cli", "analyze", "attribute", "--model", ckpt,
                        "--prompt-ids", prompts, "--task", "arithmetic", "--out", str(tmp_path / "o")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--prompt-ids" in lines[0], p.stderr


@pytest.mark.slow
def test_moe_router_and_experts_ablations(tmp_path):
    """On a tiny Qwen3-MoE the default components include the router; fp32 router and fp32 experts each reach the
    programs of both sides (the mismatch left changes)."""
    from tests.models.moe_tiny import make_moe_model

    ckpt = tmp_path / "moe"
    make_moe_model().save_pretrained(ckpt)
    prompts = [[3, 5, 7, 9], [11, 2, 4]]
    res = attribute.attribute_pair(str(ckpt), "fp32", "bfloat16", prompts, components=["router", "mlp"], n=2,
                                   max_tokens=4, temperature=1.0, seed=0)
    assert len(res["divergence"]) == 3 and res["divergence"]["layer 2"]["mlp_out"] > 1e-4
    base = res["ablations"]["none"]["mismatch/rho_std"]
    assert base > 1e-3
    assert res["ablations"]["router"]["mismatch/rho_std"] != base
    assert res["ablations"]["mlp"]["mismatch/rho_std"] != base
    ns = analyze.build_parser().parse_args(["attribute", "--model", str(ckpt), "--prompt-ids", str(tmp_path / "p"),
                                            "--out", str(tmp_path / "o")])
    (tmp_path / "p").write_text("[1, 2, 3]\n")
    attribute.check_args(ns)
    assert ns.components == list(precision.COMPONENTS)
    # one prompt in the file for the default --num-prompts 16: attribution.json's settings recorded 16
    assert ns.num_prompts == 1 and len(ns.prompts) == 1


def test_most_removed_names_a_component_only_when_it_lowered_the_mismatch():
    """Every ablation raising the mismatch (or a zero baseline) named the least bad one as "most removed"."""
    from jaxrl_mismatch.jobs.attribute import most_removed

    def rows(**left):
        return {k: {"mismatch/log_ppl_abs_diff": v} for k, v in left.items()}

    assert most_removed(1.0, rows(attention=0.5, mlp=0.8)) == "attention"
    assert most_removed(1.0, rows(attention=1.2, mlp=1.1)) is None
    assert most_removed(0.0, rows(attention=0.0, mlp=0.0)) is None
    assert most_removed(1.0, {}) is None
