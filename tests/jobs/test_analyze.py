"""`jaxrl-mismatch analyze`: the BF16 softmax simulation against the objective-level hacking paper's Table 2,
the offline rollout analysis end to end through real rollout servers, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxrl_mismatch.jobs import analyze
from jaxrl_mismatch.metrics import MetricsConfig, step_metrics
from jaxrl_mismatch.usage import UsageError
from tests.rollout.conftest import VOCAB, make_tiny_qwen3

REPO = Path(__file__).resolve().parents[2]


def _sim(seed, *, vocab=64, tokens=500, dtype="bfloat16", scale=1.5, shared=False):
    p_ref, p_low, kl = analyze.simulate_softmax(jnp.asarray(seed, jnp.uint32), jnp.float32(scale), vocab=vocab,
                                                tokens=tokens, dtype=dtype, shared_logits=shared)
    return np.asarray(p_ref), np.asarray(p_low), np.asarray(kl)


# -- Q_bf16 / Q_fp16 (eq. 45) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, np_dtype", [("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)])
def test_quantize_equals_the_dtype_cast(dtype, np_dtype):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=20000) * 3.0,                       # logits
                        np.exp(rng.uniform(-30.0, 0.0, 20000)),             # probabilities, fp16 subnormals included
                        [2.0**-14, 2.0**-24, 1.5 * 2.0**-24, 2.5 * 2.0**-24, 1e-9, 0.0]]).astype(np.float32)
    want = x.astype(np_dtype).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: analyze.quantize(v, dtype))(x))
    np.testing.assert_array_equal(got, want)


def test_low_precision_softmax_survives_jit_fusion():
    """The rounding of eq. 45 is still there inside one fused program (an astype round trip was not)."""
    z = 1.5 * np.random.default_rng(1).normal(size=(4, 2048)).astype(np.float32)
    p_low, p_ref = jax.jit(lambda v: (analyze.low_precision_softmax(v, "bfloat16"), jax.nn.softmax(v, axis=-1)))(z)
    p_low, p_ref = np.asarray(p_low), np.asarray(p_ref)
    np.testing.assert_array_equal(p_low, p_low.astype(ml_dtypes.bfloat16).astype(np.float32))  # bf16 values
    # Q(z) moves the logits by up to 2^-9 relative: a probability ratio spread far above output rounding alone.
    rel = np.abs(p_ref / p_low - 1.0)
    assert rel.max() > 2.0**-8
    np.testing.assert_allclose(p_low, p_ref, rtol=0.03)


# -- the simulation -------------------------------------------------------------------------------------------


def test_simulation_is_deterministic_per_seed_and_independent_of_token_count():
    a, b = _sim(3), _sim(3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    c = _sim(4)
    assert not np.array_equal(a[0], c[0])
    # token t depends on (seed, t) only: 1500 tokens (two lax.map chunks) start with the 500 above
    long = _sim(3, tokens=1500)
    np.testing.assert_array_equal(long[0][:500], a[0])
    np.testing.assert_array_equal(long[1][:500], a[1])
    assert analyze.ratio_stats(*a[:2]) == analyze.ratio_stats(*b[:2])


def test_fp32_ratio_is_exactly_one_and_fp16_spreads_less_than_bf16():
    p_ref, p_low, kl = _sim(0, vocab=256, tokens=4000, dtype="float32")
    np.testing.assert_array_equal(p_ref, p_low)
    assert np.all(np.abs(kl) < 1e-6)  # float32 rounding of the renormalisation only
    bf16 = analyze.ratio_stats(*_sim(0, vocab=256, tokens=4000, dtype="bfloat16")[:2])
    fp16 = analyze.ratio_stats(*_sim(0, vocab=256, tokens=4000, dtype="float16")[:2])
    # 3 more mantissa bits: 8x finer rounding; the ratio's spread shrinks by about that much
    assert 5.0 < bf16["std"] / fp16["std"] < 12.0
    assert fp16["max"] - 1 < (bf16["max"] - 1) / 4
    # sampling from p̃: E[p/p̃] = Σ p over p̃'s support / Σ p̃ ≈ 1 — no bias beyond sampling noise
    for stats in (bf16, fp16):
        assert abs(stats["mean"] - 1.0) < 5 * stats["std"] / np.sqrt(4000)


def test_shared_logits_draw_every_token_from_one_row():
    p_ref, p_low, kl = _sim(0, vocab=32, tokens=2000, shared=True)
    assert kl.shape == (1,)
    assert len(np.unique(p_ref)) <= 32 and len(np.unique(p_ref)) > 10


def test_paper_setting_matches_table2_within_the_seed_spread():
    """OLH App. C.1 at the paper's setting (V = 2048, z ~ N(0, 1.5²), 5·10⁴ tokens, 5 seeds)."""
    result = analyze.run_softmax_simulation(vocab=2048, scale=1.5, tokens=50_000, seeds=[0, 1, 2, 3, 4])
    cmp_ = result["comparison"]
    assert cmp_ is not None and set(cmp_) == {"mean", "std", "max", "min"}
    assert all(v["within"] for v in cmp_.values()), cmp_
    rows = result["seeds"]
    assert all(abs(r["std"] - 0.0048) < 0.00015 for r in rows)
    assert all(1.0175 < r["max"] < 1.0205 and 0.9795 < r["min"] < 0.9825 for r in rows)
    # one logit row per seed (the other reading of App. C.1) does not reproduce the max/min
    shared = analyze.run_softmax_simulation(vocab=2048, scale=1.5, tokens=50_000, seeds=[0], shared_logits=True)
    assert shared["comparison"] is None
    assert shared["seeds"][0]["max"] < 1.017


def test_bf16_softmax_command_writes_json_markdown_and_figure(tmp_path, capsys):
    out = tmp_path / "sim"
    assert analyze.main(["bf16-softmax", "--vocab", "128", "--tokens", "800", "--seeds", "0,1", "--out",
                         str(out)]) == 0
    data = json.loads((out / "bf16_softmax.json").read_text())
    assert [r["seed"] for r in data["seeds"]] == [0, 1]
    assert data["comparison"] is None  # not the paper's setting
    assert data["paper_table2"]["rows"][0][:2] == [1234, 1.0]
    md = (out / "bf16_softmax.md").read_text()
    assert "| ours | 0 |" in md and "| paper |" not in md
    assert (out / "bf16_softmax.png").stat().st_size > 10_000
    assert "not the paper's setting" in capsys.readouterr().out


# -- dump → metrics ----------------------------------------------------------------------------------------------


def test_dump_summary_equals_step_metrics_on_the_padded_batch():
    """The dump's left-aligned [sequences, length] arrays give the metrics of the right-padded RL batch."""
    from jaxrl_mismatch.data.batching import pad_rows

    rng = np.random.default_rng(0)
    n_prompts, n = 5, 3
    prompts = [rng.integers(1, 50, size=rng.integers(2, 7)).tolist() for _ in range(n_prompts)]
    comps = [rng.integers(1, 50, size=rng.integers(1, 12)).tolist() for _ in range(n_prompts * n)]
    logps = [(-rng.exponential(1.0, size=len(c))).tolist() for c in comps]
    prompt_id, sample_id = np.repeat(np.arange(n_prompts), n), np.tile(np.arange(n), n_prompts)
    rows = pad_rows([prompts[i] for i in prompt_id], comps, logps, pad_id=0)
    logp_train = (rows.rollout_logp + rng.normal(scale=0.05, size=rows.rollout_logp.shape)) * rows.response_mask
    dump = analyze.token_dump(rows.response_mask, rows.tokens[:, 1:], logp_train, rows.rollout_logp,
                              prompt_id, sample_id)
    assert len(dump["token"]) == sum(len(c) for c in comps)
    assert dump["token"].tolist() == [t for c in comps for t in c]
    assert dump["seq_len"].tolist() == [len(c) for c in comps for _ in c]
    summary = analyze.summarize(dump)
    want = step_metrics(jnp.asarray(logp_train.astype(np.float32)), jnp.asarray(rows.rollout_logp),
                        jnp.asarray(rows.response_mask), jnp.zeros_like(jnp.asarray(rows.response_mask)),
                        cfg=MetricsConfig())
    for k, v in want.items():
        np.testing.assert_allclose(summary[k], float(v), rtol=2e-5, atol=1e-7, err_msg=k)
    d = np.abs(dump["logp_train"] - dump["logp_rollout"])
    assert summary["analysis/logp_abs_diff_max"] == pytest.approx(float(d.max()))


# -- end to end through real rollout servers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("analyze")
    ckpt = make_tiny_qwen3(root / "ckpt", tied=False)
    rng = np.random.default_rng(0)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(rng.integers(1, VOCAB, size=rng.integers(3, 9)).tolist()) + "\n"
                               for _ in range(12)))
    return ckpt, prompts


def _from_dump(path: Path) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """The test's own reconstruction of [sequences, length] arrays from tokens.npz."""
    d = dict(np.load(path))
    seqs = sorted(set(zip(d["prompt_id"].tolist(), d["sample_id"].tolist())))
    index = {s: k for k, s in enumerate(seqs)}
    length = int(d["seq_len"].max())
    lp_tr, lp_ro, mask = (np.zeros((len(seqs), length), np.float32) for _ in range(3))
    for p, s, t, a, b in zip(d["prompt_id"], d["sample_id"], d["position"], d["logp_train"], d["logp_rollout"]):
        r = index[(int(p), int(s))]
        lp_tr[r, t], lp_ro[r, t], mask[r, t] = a, b, 1.0
    return d, lp_tr, lp_ro, mask


@pytest.mark.slow
def test_rollouts_three_precision_pairs_end_to_end(tiny_model, tmp_path, capsys):
    ckpt, prompts = tiny_model
    out = tmp_path / "out"
    rc = analyze.main(["rollouts", "--model", str(ckpt), "--prompt-ids", str(prompts), "--stop-ids", "5,7",
                       "--pairs", "fp32:float32,bf16:bfloat16,fp16:float16", "--num-prompts", "12", "--n", "4",
                       "--max-tokens", "48", "--seed", "1", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "bf16:bfloat16 over fp16:float16" in printed
    for f in ("summary.json", "pairs.md", "analysis.png"):
        assert (out / f).is_file(), f
    summary = json.loads((out / "summary.json").read_text())["pairs"]
    assert list(summary) == ["fp32:float32", "bf16:bfloat16", "fp16:float16"]
    for name, s in summary.items():
        trainer, engine = name.split(":")
        d, lp_tr, lp_ro, mask = _from_dump(out / f"{trainer}-{engine}" / "tokens.npz")
        assert set(d) == set(analyze.DUMP_FIELDS)
        assert s["analysis/tokens"] == len(d["token"]) > 200
        assert s["analysis/sequences"] == 48
        # variable lengths (stop ids), each sequence's positions 0..len-1
        assert len(np.unique(d["seq_len"])) > 3
        lengths = mask.sum(axis=1)
        assert np.array_equal(mask, (np.arange(mask.shape[1])[None, :] < lengths[:, None]).astype(np.float32))
        want = step_metrics(jnp.asarray(lp_tr), jnp.asarray(lp_ro), jnp.asarray(mask),
                            jnp.zeros_like(jnp.asarray(mask)), cfg=MetricsConfig())
        for k, v in want.items():
            # atol: float32 statistics of ratios equal to 1 up to rounding (the fp32 pair: χ² ~ 3e-7) are known
            # to about one float32 ulp; another summation order moves them by ~1e-8.
            np.testing.assert_allclose(s[k], float(v), rtol=1e-5, atol=1e-7, err_msg=f"{name} {k}")
        assert s["analysis/logp_abs_diff_max"] == pytest.approx(float(np.max(np.abs(d["logp_train"] - d["logp_rollout"]))))
        assert np.all(d["logp_rollout"] <= 0) and np.all(np.isfinite(d["logp_train"]))
    fp32, bf16, fp16 = (summary[k] for k in ("fp32:float32", "bf16:bfloat16", "fp16:float16"))
    assert fp32["analysis/logp_abs_diff_max"] < 1e-4
    # FP16 paper §3.5: fp16 on both sides is several times closer than bf16 on both sides
    assert bf16["mismatch/log_ppl_abs_diff"] > 2 * fp16["mismatch/log_ppl_abs_diff"] > 0
    assert bf16["mismatch/rho_std"] > 2 * fp16["mismatch/rho_std"]
    assert fp16["mismatch/log_ppl_abs_diff"] > 10 * fp32["mismatch/log_ppl_abs_diff"]
    md = (out / "pairs.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 4 and all(line.count("|") == 8 for line in table)  # header + 3 pairs, 7 columns


@pytest.mark.slow
def test_rollouts_task_prompts_through_the_tokenizer(tiny_base_model, tmp_path):
    """`--task arithmetic` with the warm start's own checkpoint and tokenizer (EOS stops the responses)."""
    base = tiny_base_model
    out = tmp_path / "out"
    assert analyze.main(["rollouts", "--model", str(base), "--task", "arithmetic", "--num-prompts", "6", "--n", "2",
                         "--trainer-precision", "fp32", "--engine-dtype", "float32", "--axes", "log",
                         "--out", str(out)]) == 0
    d = dict(np.load(out / "fp32-float32" / "tokens.npz"))
    assert sorted(set(d["prompt_id"].tolist())) == list(range(6))
    assert np.max(np.abs(d["logp_train"] - d["logp_rollout"])) < 1e-4
    assert (out / "analysis.png").is_file()


# -- bad input: one line naming the flag --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt_dir(tiny_model) -> str:
    return str(tiny_model[0])


@pytest.mark.parametrize("args, flag", [
    (["--pairs", "fp32:float64"], "--pairs"),
    (["--pairs", "fp32"], "--pairs"),
    (["--pairs", "fp32:float32,fp32:float32"], "--pairs"),
    (["--pairs", "fp32:float32", "--engine-dtype", "bfloat16"], "--pairs"),
    (["--trainer-precision", "fp8"], "--trainer-precision"),
    (["--engine-dtype", "int8"], "--engine-dtype"),
    (["--temperature", "0"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--n", "0"], "--n"),
    (["--num-prompts", "-1"], "--num-prompts"),
    (["--stop-ids", "3"], "--stop-ids"),
    (["--prompt-ids", "/nonexistent.jsonl"], "--prompt-ids"),
    (["--axes", "polar"], "--axes"),
])
def test_rollouts_bad_flags(ckpt_dir, tmp_path, args, flag):
    with pytest.raises(UsageError) as e:
        analyze.main(["rollouts", "--model", ckpt_dir, "--out", str(tmp_path / "o"), *args])
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_rollouts_bad_model_and_prompt_files(ckpt_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    for model, flag in (("/nonexistent", "--model"), (str(tmp_path / "empty"), "--model")):
        with pytest.raises(UsageError, match=flag):
            analyze.main(["rollouts", "--model", model, "--out", str(tmp_path / "o")])
    bad = tmp_path / "bad.jsonl"
    for text in ("[1, 2, 500]\n", "not json\n", "[]\n", "\n"):
        bad.write_text(text)
        with pytest.raises(UsageError) as e:
            analyze.main(["rollouts", "--model", ckpt_dir, "--prompt-ids", str(bad), "--out", str(tmp_path / "o")])
        assert "--prompt-ids" in str(e.value) and "\n" not in str(e.value)
    good = tmp_path / "good.jsonl"
    good.write_text("[1, 2, 3]\n")
    with pytest.raises(UsageError, match="--max-tokens"):  # 3 + 300 > max_position_embeddings 256
        analyze.main(["rollouts", "--model", ckpt_dir, "--prompt-ids", str(good), "--max-tokens", "300",
                      "--out", str(tmp_path / "o")])
    with pytest.raises(UsageError, match="--model"):  # a random checkpoint has no tokenizer for --task
        analyze.main(["rollouts", "--model", ckpt_dir, "--task", "arithmetic", "--out", str(tmp_path / "o")])


@pytest.mark.parametrize("args, flag", [
    (["--seeds", "a,b"], "--seeds"),
    (["--seeds", "-1"], "--seeds"),
    (["--vocab", "1"], "--vocab"),
    (["--tokens", "0"], "--tokens"),
    (["--scale", "-1"], "--scale"),
    (["--dtype", "int8"], "--dtype"),
    (["--logits", "some"], "--logits"),
])
def test_bf16_softmax_bad_flags(tmp_path, args, flag):
    with pytest.raises(UsageError) as e:
        analyze.main(["bf16-softmax", "--out", str(tmp_path / "o"), *args])
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_cli_prints_one_line_and_exits_2(tmp_path):
    for argv in (["analyze"], ["analyze", "bf16-softmax", "--vocab", "0", "--out", str(tmp_path)]):
        p = subprocess.run([sys.executable, "-m", "jaxrl_mismatch.cli", *argv], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
