"""The perfectible filter (FP16 paper §4) with a deterministic stand-in for the policy's sampler."""

import json

import pytest

from jaxrl_mismatch.data import arithmetic as A
from jaxrl_mismatch.data.perfectible import filter_perfectible, save_perfectible


def _fake_sampler(correct_counts):
    """Test double for the policy: prompt i gets correct_counts[i] right answers out of n, in order."""
    calls = []

    def sample_fn(prompts, n):
        calls.append((list(prompts), n))
        out = []
        for p in prompts:
            i = int(p.split(":")[0])
            ans = i + 100
            out.append([f"x#{ans}" if j < correct_counts[i] else f"x#{ans + 1}" for j in range(n)])
        return out

    return sample_fn, calls


def test_keeps_band_inclusive_and_records_accuracy():
    counts = [0, 1, 2, 5, 8, 9, 10, 3]  # of k=10: acc 0, .1, .2, .5, .8, .9, 1, .3
    prompts = [f"{i}:prompt" for i in range(len(counts))]
    answers = [str(i + 100) for i in range(len(counts))]
    sample_fn, calls = _fake_sampler(counts)
    kept = filter_perfectible(prompts, answers, sample_fn, A.reward, k=10, batch_size=3,
                              extras=[{"id": i} for i in range(len(counts))])
    assert [r["prompt_text"] for r in kept] == ["2:prompt", "3:prompt", "4:prompt", "7:prompt"]
    assert [r["initial_accuracy"] for r in kept] == [0.2, 0.5, 0.8, 0.3]
    assert all(r["num_samples"] == 10 for r in kept) and [r["id"] for r in kept] == [2, 3, 4, 7]
    assert [len(p) for p, _ in calls] == [3, 3, 2] and all(n == 10 for _, n in calls)


def test_format_bonus_does_not_count_as_correct():
    def sample_fn(prompts, n):
        return [["1+1=3#3"] * n for _ in prompts]  # well formed, wrong

    reward = lambda c, a: A.reward(c, a, format_bonus=0.3)  # noqa: E731
    assert filter_perfectible(["1+1="], ["2"], sample_fn, reward, k=4, lo=0.0, hi=0.1)[0]["initial_accuracy"] == 0.0


def test_sampler_contract_violations_raise():
    with pytest.raises(ValueError, match="for 1 prompts, asked for 2"):
        filter_perfectible(["a", "b"], ["1", "2"], lambda p, n: [["#1"] * n], A.reward, k=2)
    with pytest.raises(ValueError, match="3 completions for prompt 0, asked for 2"):
        filter_perfectible(["a"], ["1"], lambda p, n: [["#1"] * 3], A.reward, k=2)
    with pytest.raises(ValueError, match="2 prompts but 1 answers"):
        filter_perfectible(["a", "b"], ["1"], lambda p, n: [], A.reward)


def test_saved_subset_builds_as_a_tfds_dataset(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    from jaxrl_mismatch.data import get_task

    sample_fn, _ = _fake_sampler([4, 8, 2])
    kept = filter_perfectible([f"{i}:q" for i in range(3)], ["100", "101", "102"], sample_fn, A.reward, k=8)
    assert [r["initial_accuracy"] for r in kept] == [0.5, 0.25]  # 8/8 dropped
    path = save_perfectible(kept, str(tmp_path / "perfectible" / "train.jsonl"))
    task = get_task("arithmetic_prompts")
    recs = task.load("train", files={"train": path}, data_dir=str(tmp_path / "tfds"))
    assert [(r["prompt_text"], r["answer"]) for r in recs] == [("0:q", "100"), ("2:q", "102")]
    assert json.loads(recs[0]["extra"]) == {"initial_accuracy": 0.5, "num_samples": 8}
    assert task.reward("x#102", recs[1]["answer"]) == 1.0


def test_force_replaces_only_an_earlier_perfectible_output(tmp_path):
    """`--force` used to replace any file at `--out`, the input `--file` included; now only one this command wrote
    (every line with the fields it adds), and `--out` may never be the input."""
    from jaxrl_mismatch.jobs.perfectible import parse_args
    from jaxrl_mismatch.usage import UsageError

    model = tmp_path / "model"
    model.mkdir()
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt_text": "1+1=", "answer": "2"}) + "\n")
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"mine": 1}\n')
    base = ["--model", str(model), "--max-tokens", "8", "--task", "prompts", "--file", str(data)]
    for out, needle in ((notes, "--force replaces only an earlier output of perfectible"), (data, "is the input --file")):
        with pytest.raises(UsageError, match=f"--out {out}: {needle}"):
            parse_args([*base, "--out", str(out), "--force"])
    with pytest.raises(UsageError, match="already exists; choose a new path or pass --force"):
        parse_args([*base, "--out", str(notes)])
    assert notes.read_text() == '{"mine": 1}\n' and json.loads(data.read_text())["answer"] == "2"
    earlier = tmp_path / "kept.jsonl"
    earlier.write_text(json.dumps({"prompt_text": "1+1=", "answer": "2", "initial_accuracy": 0.5, "num_samples": 8}) + "\n")
    # (--address: no server of its own, so the empty --model folder is not checked for config and weights)
    assert parse_args([*base, "--out", str(earlier), "--force", "--address", "127.0.0.1:1"]).force
