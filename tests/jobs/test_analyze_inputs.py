"""`analyze rollouts|attribute|bf16-softmax`: task flags the prompts would ignore are refused, prompt problems are
usage errors, sizes are bounded before any work, --seed keeps the prompts, and non-finite log-probs are reported
as such (strict JSON, `n/a`), never as a number."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from jaxrl_mismatch.jobs import analyze, analyze_rollouts, analyze_softmax, attribute
from jaxrl_mismatch.outputs import write_json
from jaxrl_mismatch.usage import UsageError
from tests.rollout.conftest import make_tiny_qwen3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("inputs") / "ckpt", tied=False))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("inputs_prompts") / "ok.jsonl"
    path.write_text('{"prompt_text": "1+2=", "answer": "3"}\n')
    return str(path)


def _refused(argv: list[str], flag: str) -> str:
    with pytest.raises(UsageError) as e:
        analyze.main(argv)
    msg = str(e.value)
    assert msg.startswith(flag) and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("cmd", ["rollouts", "attribute"])
@pytest.mark.parametrize("extra, flag", [
    (["--task", "arithmetic", "--file", "/nonexistent.jsonl"], "--file /nonexistent.jsonl"),
    (["--task", "prompts", "--file", "{ok}", "--split", "nosuchsplit"], "--split nosuchsplit"),
    (["--task", "prompts", "--file", "{ok}", "--data-seed", "3"], "--data-seed 3"),
    (["--task", "prompts"], "--file"),
    (["--task", "arithmetic", "--template", "nosuch"], "--template nosuch"),
    (["--task", "arithmetic", "--data-seed", "-1"], "--data-seed"),
    (["--task", "arithmetic", "--n", "3000000000"], "--n"),
    (["--task", "arithmetic", "--num-prompts", "3000000000"], "--num-prompts"),
    (["--task", "arithmetic", "--num-prompts", "100000000", "--n", "1000"], "--n"),
])
def test_task_flags_refused_before_any_work(ckpt, prompts_file, tmp_path, cmd, extra, flag):
    extra = [prompts_file if x == "{ok}" else x for x in extra]
    msg = _refused([cmd, "--model", ckpt, *extra, "--out", str(tmp_path / "o")], flag)
    if flag == "--template nosuch":
        assert "arithmetic" in msg and "raw" in msg  # the known templates are listed
    assert not (tmp_path / "o").exists()


def test_prompt_problems_are_usage_errors(tiny_base_model, tmp_path):
    """More prompts than the task holds, and a prompt the tokenizer cannot encode (file and line named): exit 2."""
    base = str(tiny_base_model)
    _refused(["rollouts", "--model", base, "--num-prompts", "100000000", "--n", "1", "--max-tokens", "1",
              "--out", str(tmp_path / "o")], "--num-prompts 100000000")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_text": "1+2=", "answer": "3"}\n\n{"prompt_text": "héllo=", "answer": "3"}\n')
    for cmd in ("rollouts", "attribute"):
        msg = _refused([cmd, "--model", base, "--task", "arithmetic_prompts", "--file", str(bad),
                        "--out", str(tmp_path / "o")], f"--file {bad}:3")
        assert "outside the tokenizer's vocabulary" in msg
    assert not (tmp_path / "o").exists()


def test_seed_does_not_change_the_prompts(tiny_base_model):
    """--seed samples; the arithmetic problems come from --data-seed (default 0) whatever --seed is."""
    def prompts(**kw):
        a = argparse.Namespace(model=str(tiny_base_model), task=None, split=None, file=None, template=None,
                               prompt_ids=None, num_prompts=8, **kw)
        analyze_rollouts.prompt_source_args(a)
        return analyze_rollouts.task_prompts(a)[0]

    assert prompts(seed=0, data_seed=None) == prompts(seed=1, data_seed=None)
    assert prompts(seed=0, data_seed=None) != prompts(seed=0, data_seed=1)


# -- non-finite log-probs ----------------------------------------------------------------------------------------


def _rows():
    from jaxrl_mismatch.data.batching import pad_rows

    prompt_id, sample_id = np.repeat(np.arange(2), 2), np.tile(np.arange(2), 2)
    comps = [[3, 4, 5], [6, 7], [8], [9, 10]]
    logps = [[-0.5] * len(c) for c in comps]
    return pad_rows([[1, 2]] * 4, comps, logps, pad_id=0), prompt_id, sample_id


def test_rollouts_pair_with_nonfinite_logprobs_is_kept_and_reported(tmp_path):
    rows, prompt_id, sample_id = _rows()
    ok = analyze_rollouts.pair_result("fp32", "float32", rows, rows.rollout_logp - 0.01, prompt_id, sample_id)
    nan_logp = rows.rollout_logp.copy()
    nan_logp[rows.response_mask > 0] = np.array([np.nan, -np.inf, -0.5, -0.5, -0.5, -0.5, -0.5, -0.5])
    bad = analyze_rollouts.pair_result("fp16", "float16", rows, nan_logp, prompt_id, sample_id)
    assert ok.nonfinite == 0 and bad.nonfinite == 2
    assert np.isnan(bad.summary["mismatch/log_ppl_abs_diff"]) and np.isfinite(ok.summary["mismatch/log_ppl_abs_diff"])
    text, md = analyze_rollouts.pairs_tables([ok, bad])
    line = next(ln for ln in text.splitlines() if ln.startswith("fp16:float16"))
    assert "n/a" in line and line.split()[-1] == "2" and "0.0" not in line
    path = tmp_path / "s.json"
    write_json(str(path), {"pairs": {r.name: r.summary for r in (ok, bad)}})
    data = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert data["pairs"]["fp16:float16"]["mismatch/log_ppl_abs_diff"] == "nan"
    assert data["pairs"]["fp16:float16"]["analysis/nonfinite_logp_train"] == 2


def test_attribute_nonfinite_baseline_is_not_zero_percent(tmp_path):
    nan = float("nan")
    ablations = {"none": {"mismatch/log_ppl_abs_diff": nan, "mismatch/rho_std": nan,
                          "nonfinite_logp": {"trainer": 5, "engine": 0}},
                 "attention": {"mismatch/log_ppl_abs_diff": 1e-3, "mismatch/rho_std": 1e-2,
                               "nonfinite_logp": {"trainer": 0, "engine": 0}}}
    assert attribute.finish_ablations(ablations) is None
    assert ablations["none"]["removed_frac"] is None and ablations["attention"]["removed_frac"] is None
    res = {"trainer": "fp16", "engine": "float16", "rows": 2, "response_tokens": 8, "divergence": {},
           "divergence_model": {"embed": 0.0}, "ablations": ablations, "most_removed": None}
    md = attribute.tables([res])
    assert "| none | n/a | n/a | n/a | 5 trainer |" in md and "0.0 %" not in md
    assert "No fp32 component" not in md and "not finite" in md
    path = tmp_path / "a.json"
    write_json(str(path), {"pairs": [res], "inf": float("inf")})
    data = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert data["pairs"][0]["ablations"]["none"]["mismatch/log_ppl_abs_diff"] == "nan" and data["inf"] == "inf"
    finite = {"none": {"mismatch/log_ppl_abs_diff": 2e-3, "mismatch/rho_std": 0.0, "nonfinite_logp": {"trainer": 0}},
              "mlp": {"mismatch/log_ppl_abs_diff": 1e-3, "mismatch/rho_std": 0.0, "nonfinite_logp": {"trainer": 0}}}
    assert attribute.finish_ablations(finite) == "mlp" and finite["mlp"]["removed_frac"] == pytest.approx(0.5)


# -- bf16-softmax ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, flag", [
    (["--seeds", "2147483648"], "--seeds"),
    (["--seeds", "0,0"], "--seeds"),
    (["--scale", "1e38"], "--scale"),
    (["--scale", "100000", "--dtype", "float16"], "--scale"),
    (["--vocab", "1000000000"], "--vocab"),
    (["--tokens", "3000000000"], "--tokens"),
])
def test_bf16_softmax_refuses_what_it_cannot_compute(tmp_path, args, flag):
    _refused(["bf16-softmax", "--out", str(tmp_path / "o"), *args], flag)
    assert not (tmp_path / "o").exists()


def test_bf16_softmax_table_sizes_the_seed_column():
    rows = [{"seed": s, "mean": 1.0, "std": 0.0048, "max": 1.02, "min": 0.98, "kl_vocab_mean": 0.0}
            for s in (0, 2147483647)]
    setting = {"vocab": 2048, "scale": 1.5, "tokens": 50000, "dtype": "bfloat16", "logits": "per-token"}
    for comparison in (None, analyze_softmax.compare_with_paper(rows)):
        text, _ = analyze_softmax.softmax_tables({"setting": setting, "seeds": rows, "comparison": comparison})
        line = next(ln for ln in text.splitlines() if ln.startswith("2147483647"))
        assert line.split()[:2] == ["2147483647", "1.0000"], line


def test_more_stop_ids_than_the_server_takes_are_refused_before_it_starts(ckpt, tmp_path):
    """The rollout server takes at most 64 stop ids; 65 passed the flag check and failed after the server had
    started (exit 1). Refused with the flag now; repeated ids count once."""
    from jaxrl_mismatch.rollout.validation import MAX_STOP_TOKEN_IDS

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('[3, 4, 5]\n')
    ids = ",".join(str(i) for i in range(1, MAX_STOP_TOKEN_IDS + 2))
    msg = _refused(["rollouts", "--model", ckpt, "--prompt-ids", str(prompts), "--stop-ids", ids,
                    "--out", str(tmp_path / "o")], "--stop-ids")
    assert f"at most {MAX_STOP_TOKEN_IDS} distinct ids, got {MAX_STOP_TOKEN_IDS + 1}" in msg
    assert not (tmp_path / "o").exists()


def test_an_engine_dtype_that_overflows_is_reported_and_the_other_pairs_run(tmp_path, capsys):
    """An engine whose log-probs are not finite (the model overflows in fp16) ended `analyze attribute` (exit 1
    with a traceback, then exit 2 with a usage line), and the pairs already measured were lost with the staged
    output. Now that pair is reported as such and the other pairs run and are written (real engines: an LM head
    scaled past fp16's range, the float16 pair first)."""
    from jaxrl_mismatch.jobs import analyze
    from tests.rollout.conftest import make_fp16_overflowing_qwen3

    model = str(make_fp16_overflowing_qwen3(tmp_path / "big_head"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[3, 4, 5]\n[6, 7]\n")
    assert analyze.main(["attribute", "--model", model, "--prompt-ids", str(prompts), "--pairs",
                         "fp32:float16,fp32:float32", "--components", "lm_head", "--n", "1", "--max-tokens", "4",
                         "--out", str(tmp_path / "o")]) == 0
    assert ("attribute: fp32:float16: the float16 engine's log-probs of this model are not finite (non-finite "
            "logprob nan at prompt 0, sample 0, position 0 (weight version 0)): no samples") in capsys.readouterr().out
    data = json.loads((tmp_path / "o" / "attribution.json").read_text())
    assert [p["engine"] for p in data["pairs"]] == ["float16", "float32"]
    assert set(data["pairs"][0]) == {"trainer", "engine", "engine_error", "seconds"}
    measured = data["pairs"][1]["ablations"]["none"]
    assert measured["nonfinite_logp"] == {"trainer": 0, "engine": 0} and measured["mismatch/log_ppl_abs_diff"] < 1e-3
    md = (tmp_path / "o" / "attribution.md").read_text()
    assert "## fp32:float16\n\nNo samples: the float16 engine's log-probs" in md and "## fp32:float32 (2 rows" in md
    assert (tmp_path / "o" / "attribution.png").is_file()
