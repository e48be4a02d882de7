"""`jaxrl-mismatch analyze rollouts` (jobs/analyze_rollouts.py): the dump and its summary, the offline rollout
analysis end to end through real rollout servers, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_mismatch.jobs import analyze, analyze_rollouts
from jaxrl_mismatch.metrics import MetricsConfig, step_metrics
from jaxrl_mismatch.outputs import marker_name
from jaxrl_mismatch.usage import UsageError
from tests.rollout.conftest import VOCAB, make_tiny_qwen3


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
    dump = analyze_rollouts.token_dump(rows.response_mask, rows.tokens[:, 1:], logp_train, rows.rollout_logp,
                              prompt_id, sample_id)
    assert len(dump["token"]) == sum(len(c) for c in comps)
    assert dump["token"].tolist() == [t for c in comps for t in c]
    assert dump["seq_len"].tolist() == [len(c) for c in comps for _ in c]
    summary = analyze_rollouts.summarize(dump)
    want = step_metrics(jnp.asarray(logp_train.astype(np.float32)), jnp.asarray(rows.rollout_logp),
                        jnp.asarray(rows.response_mask), jnp.zeros_like(jnp.asarray(rows.response_mask)),
                        cfg=MetricsConfig())
    for k, v in want.items():
        np.testing.assert_allclose(summary[k], float(v), rtol=2e-5, atol=1e-7, err_msg=k)
    d = np.abs(dump["logp_train"] - dump["logp_rollout"])
    assert summary["analysis/logp_abs_diff_max"] == pytest.approx(float(d.max()))


def test_a_dump_without_response_tokens_counts_no_sequences():
    """Every completion empty (each row sampled EOS first): `analysis/sequences` was 1.0 (the one all-padding row the
    arrays are padded to) beside `analysis/tokens` 0."""
    mask = np.zeros((4, 6), np.float32)
    zeros = np.zeros((4, 6), np.float32)
    dump = analyze_rollouts.token_dump(mask, np.ones((4, 6), np.int32), zeros, zeros, np.arange(4), np.zeros(4, int))
    summary = analyze_rollouts.summarize(dump)
    assert summary["analysis/tokens"] == 0.0 and summary["analysis/sequences"] == 0.0


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
                       "--pairs", "fp32:float32,bf16:bfloat16,fp16:float16", "--num-prompts", "100", "--n", "4",
                       "--max-tokens", "48", "--seed", "1", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "bf16:bfloat16 over fp16:float16" in printed
    # the file holds 12 prompts: all sampled, said, and the settings record 12 (they said 100)
    assert f"--prompt-ids {prompts} holds 12 prompts, fewer than --num-prompts 100: sampling all 12" in printed
    settings = json.loads((out / "summary.json").read_text())["settings"]
    assert settings["num_prompts"] == 12 and settings["n"] == 4
    for f in ("summary.json", "pairs.md", "analysis.png"):
        assert (out / f).is_file(), f
    summary = json.loads((out / "summary.json").read_text())["pairs"]
    assert list(summary) == ["fp32:float32", "bf16:bfloat16", "fp16:float16"]
    for name, s in summary.items():
        trainer, engine = name.split(":")
        d, lp_tr, lp_ro, mask = _from_dump(out / f"{trainer}-{engine}" / "tokens.npz")
        assert set(d) == set(analyze_rollouts.DUMP_FIELDS)
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
    assert len(table) == 4 and all(line.count("|") == 9 for line in table)  # header + 3 pairs, 8 columns
    assert all(line.rstrip(" |").endswith(" 0") for line in table[1:])  # nonfinite_logp: every log-prob finite
    # the folder is the command's own (outputs.staged_dir): marked, server logs inside, no temporary sibling left
    assert (out / marker_name(analyze_rollouts.KIND)).is_file() and (out / "server_float16").is_dir()
    assert not list(out.glob("server_*/rollout_token"))  # the stopped servers' push tokens are not left behind
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with pytest.raises(UsageError, match="--force"):  # an earlier output: kept unless --force
        analyze.main(["rollouts", "--model", str(ckpt), "--prompt-ids", str(prompts), "--out", str(out)])
    before = (out / "summary.json").read_bytes()
    with pytest.raises(UsageError, match="--max-tokens"):  # --force accepted; failing mid-write keeps it whole
        analyze.main(["rollouts", "--model", str(ckpt), "--prompt-ids", str(prompts), "--max-tokens", "300",
                      "--force", "--out", str(out)])
    assert (out / "summary.json").read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.slow
def test_an_engine_dtype_that_overflows_is_reported_and_the_other_pairs_kept(tiny_model, tmp_path, capsys):
    """An engine dtype the model overflows in (here fp16: LM-head weights × 3e4 put the logits past 65,504) gives
    no rollouts. It ended the whole command (exit 2), throwing away the pairs already measured and those after;
    now its pairs are reported as such and the other engines' are measured and written, exit 0."""
    from tests.rollout.conftest import make_fp16_overflowing_qwen3

    ckpt = make_fp16_overflowing_qwen3(tmp_path / "big_head")
    out = tmp_path / "out"
    rc = analyze.main(["rollouts", "--model", str(ckpt), "--prompt-ids", str(tiny_model[1]), "--pairs",
                       "fp32:float16,fp32:float32", "--num-prompts", "4", "--n", "2", "--max-tokens", "8",
                       "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "analyze: the float16 engine's log-probs of this model are not finite (non-finite logprob" in printed
    summary = json.loads((out / "summary.json").read_text())["pairs"]
    assert list(summary) == ["fp32:float16", "fp32:float32"]  # the order asked for
    assert summary["fp32:float16"] == {"engine_error": summary["fp32:float16"]["engine_error"]}
    assert "not finite" in summary["fp32:float16"]["engine_error"]
    ok = summary["fp32:float32"]  # measured after the failed engine, and finite
    assert ok["analysis/tokens"] > 0 and ok["analysis/nonfinite_logp_train"] == 0
    assert 0 <= ok["mismatch/log_ppl_abs_diff"] < 1e-3
    assert (out / "fp32-float32" / "tokens.npz").is_file() and not (out / "fp32-float16").exists()
    assert (out / "analysis.png").is_file()  # the finite pair is plotted
    table = [line for line in (out / "pairs.md").read_text().splitlines() if line.startswith("| fp32:")]
    assert table[0].startswith("| fp32:float16 | 0 | n/a") and table[0].rstrip(" |").endswith("engine")
    assert table[1].rstrip(" |").endswith(" 0")


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
    (["--temperature", "1e-6"], "--temperature must be >= 1e-05 (below it the engines decode greedily"),
    (["--n", "0"], "--n"),
    (["--num-prompts", "-1"], "--num-prompts"),
    (["--stop-ids", "3"], "--stop-ids"),
    (["--prompt-ids", "/nonexistent.jsonl"], "--prompt-ids"),
    (["--axes", "polar"], "--axes"),
    (["--split", "nosuch"], "--split nosuch"),
])
def test_rollouts_bad_flags(ckpt_dir, tmp_path, args, flag):
    with pytest.raises(UsageError) as e:
        analyze.main(["rollouts", "--model", ckpt_dir, "--out", str(tmp_path / "o"), *args])
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_rollouts_refuses_an_out_folder_it_did_not_write(ckpt_dir, tmp_path):
    """Checked before any server starts: one line naming --out, the folder and its file unchanged."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "analysis.png").write_text("my notes")
    for force in ([], ["--force"]):  # --force replaces only an earlier `analyze rollouts` output
        with pytest.raises(UsageError) as e:
            analyze.main(["rollouts", "--model", ckpt_dir, "--out", str(out), *force])
        message = str(e.value)
        assert message.startswith(f"--out {out}: is a non-empty directory not written by "
                                  "`jaxrl-mismatch analyze rollouts`") and "\n" not in message
    assert (out / "analysis.png").read_text() == "my notes" and [p.name for p in out.iterdir()] == ["analysis.png"]
    assert [p.name for p in tmp_path.iterdir()] == ["o"]  # no server work directory, no temporary sibling
    (tmp_path / "file").write_text("mine")  # --out names a file: refused in one line, not a FileExistsError
    with pytest.raises(UsageError, match=f"--out {tmp_path / 'file'}: is a file"):
        analyze.main(["rollouts", "--model", ckpt_dir, "--out", str(tmp_path / "file")])


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


def test_sequence_log_ratio_is_the_trainers():
    """log π(y)/μ(y) sums the unclamped token log-ratios and clamps the sum (metrics.step, objectives.ratios):
    tokens +25, −10, 0 give 15; each token clamped to ±20 first gave 10 (a review's case)."""
    from jaxrl_mismatch.jobs.analyze_rollouts import _seq_log_ratio

    dump = {"prompt_id": np.zeros(3, np.int32), "sample_id": np.zeros(3, np.int32), "position": np.arange(3),
            "logp_train": np.array([-1.0, -12.0, -0.5], np.float32),
            "logp_rollout": np.array([-26.0, -2.0, -0.5], np.float32)}
    lengths, lr = _seq_log_ratio(dump)
    assert lengths.tolist() == [3] and lr.tolist() == pytest.approx([15.0])
