"""`jaxrl-mismatch export`: a trained policy (any checkpoint step) as an HF checkpoint that transformers loads
with the trainer's own log-probs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from jaxrl_mismatch.data.tokenizer import build_arithmetic_tokenizer, save_tokenizer
from jaxrl_mismatch.jobs.export import export
from jaxrl_mismatch.train.batch import RolloutBatch
from jaxrl_mismatch.train.checkpoint import Checkpointer
from jaxrl_mismatch.train.config import base_config
from jaxrl_mismatch.usage import UsageError
from tests.models.hf_tiny import hf_token_logprobs, real_positions
from tests.rollout.conftest import VOCAB, make_tiny_qwen3


BASE_TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _batch(rows: int = 8, seq: int = 12, seed: int = 0) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(rows, seq)).astype(np.int32)
    attention_mask = np.ones_like(tokens)
    response_mask = np.zeros((rows, seq - 1), np.float32)
    response_mask[:, 4:] = 1.0
    adv = rng.normal(size=(rows, 1)).astype(np.float32) * response_mask
    return RolloutBatch(tokens=tokens, attention_mask=attention_mask, response_mask=response_mask, advantages=adv,
                        rollout_logp=np.zeros_like(response_mask))


def _logprobs(learner, tokens, mask):
    from jaxrl_mismatch.models.scoring import make_scorer

    fn = make_scorer(learner._graphdef, learner.mesh, chunk_size=8)
    return np.asarray(fn(learner.state.params, tokens, mask)[0])


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A base checkpoint, then two checkpoints of a learner that took real update steps from it."""
    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    root = tmp_path_factory.mktemp("export")
    base = make_tiny_qwen3(root / "base", tied=False)
    save_tokenizer(build_arithmetic_tokenizer(), str(base))  # a run's base holds its tokenizer (train needs it)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, **BASE_TOKEN_IDS}))
    c = base_config()
    c.model.path, c.run_dir = str(base), str(root / "run")
    c.rollout.group_size, c.batch.prompts_per_step, c.trainer.chunk_size = 2, 4, 8
    c.optim.lr = 3e-2
    learner = Learner(learner_config(c))
    tokens, mask = _batch().tokens, _batch().attention_mask
    lp = {}
    with Checkpointer(str(root / "run" / "checkpoints")) as ckpt:
        for step in (1, 2):
            batch, _ = learner.prepare(_batch(seed=step), seed=step)
            learner.optimize(batch, seed=step)
            ckpt.save(step, learner.state, {"step": step, "config": c.to_dict()}, force=True)
            lp[step] = _logprobs(learner, tokens, mask)
        ckpt.wait()
    return root, base, lp, (tokens, mask)


@pytest.mark.slow
def test_export_matches_transformers_at_every_step(trained_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    root, base, lp, (tokens, mask) = trained_run
    real = real_positions(mask)
    base_lp = hf_token_logprobs(AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32), tokens, mask)
    for step, want in ((2, lp[2]), (1, lp[1])):
        out = tmp_path / f"step{step}"
        got_step = export(str(root / "run"), str(out), step=step if step == 1 else None)
        assert got_step == step
        hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
        theirs = hf_token_logprobs(hf, tokens, mask)
        assert np.max(np.abs(theirs - want)[real]) <= 2e-5
        # The trained weights were exported, not the base checkpoint's.
        assert np.max(np.abs(theirs - base_lp)[real]) > 1e-3
    assert np.max(np.abs(lp[1] - lp[2])) > 1e-4  # the two steps really differ


@pytest.mark.slow
def test_export_bf16_and_bad_inputs(trained_run, tmp_path):
    root, _, _, _ = trained_run
    export(str(root / "run"), str(tmp_path / "bf16"), dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(UsageError, match=r"--step 7: no such checkpoint.*\[1, 2\]"):
        export(str(root / "run"), str(tmp_path / "x"), step=7)
    with pytest.raises(UsageError, match="no checkpoints"):
        export(str(tmp_path), str(tmp_path / "x"))
    with pytest.raises(UsageError, match="--base"):
        export(str(root / "run"), str(tmp_path / "x"), base=str(tmp_path / "nowhere"))


def test_a_scan_layers_run_exports_like_the_unrolled_one(trained_run, tmp_path):
    """A run trained with `trainer.scan_layers` (layers stacked in one parameter tree) could not be exported: the
    export built the unrolled layout and reported a mismatch with its --base."""
    from safetensors.numpy import load_file

    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    _, base, _, _ = trained_run
    c = base_config()
    c.model.path, c.run_dir = str(base), str(tmp_path / "run")
    c.trainer.scan_layers = True
    learner = Learner(learner_config(c))  # the base model's weights, stacked
    with Checkpointer(str(tmp_path / "run" / "checkpoints")) as ckpt:
        ckpt.save(1, learner.state, {"step": 1, "config": c.to_dict()}, force=True)
        ckpt.wait()
    assert export(str(tmp_path / "run"), str(tmp_path / "out")) == 1
    got, want = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(str(base / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_out_inside_the_run_directory_or_empty_is_refused_before_any_work(tmp_path):
    """`--out RUN/checkpoints/new` was written (exit 0) into the run it only reads, and left a folder there that
    made a lock-less run no longer a run (`runlock.is_run_dir`); `--out ""` was called "a parent of the run
    directory". Paths are compared resolved: through a `..`, a link to the run, or a linked checkpoints folder."""
    import os

    from jaxrl_mismatch.train.runlock import is_run_dir

    run = tmp_path / "run"
    (run / "checkpoints" / "1").mkdir(parents=True)
    (run / "checkpoints" / "1" / "commit_success.txt").write_text("ok")
    elsewhere = tmp_path / "ckpts"
    elsewhere.mkdir()
    linked = tmp_path / "linked_run"
    linked.mkdir()
    os.symlink(elsewhere, linked / "checkpoints")
    os.symlink(run, tmp_path / "run_link")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert is_run_dir(str(run))
    for run_dir, out, needle in (
        (run, run / "checkpoints" / "new", "is inside the run directory"),
        (run, run / "new", "is inside the run directory"),
        (run, run / "checkpoints", "is inside the run directory"),
        (run, tmp_path / "other" / ".." / "run" / "x", "is inside the run directory"),
        (run, tmp_path / "run_link" / "checkpoints" / "new", "is inside the run directory"),
        (run, run, "is the run directory"),
        (run, tmp_path, "is a parent of the run directory"),
        (linked, elsewhere / "new", "is inside the run's checkpoints directory"),
    ):
        with pytest.raises(UsageError, match=f"^--out {out}: {needle} .*choose a directory outside it$"):
            export(str(run_dir), str(out))
    with pytest.raises(UsageError, match="^--out: empty path"):
        export(str(run), "")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written
    assert is_run_dir(str(run))


def test_the_export_keeps_the_bases_token_ids_and_needs_its_tokenizer(trained_run, tmp_path):
    """config.json was rebuilt from the model's shape alone: the base's eos/bos/pad ids were dropped (transformers'
    generate() on the export had no EOS to stop at when the base has no generation_config.json). A --base without
    tokenizer.json exported weights and config only, exit 0, a folder nothing could serve."""
    from transformers import AutoConfig

    root, base, _, _ = trained_run
    export(str(root / "run"), str(tmp_path / "out"))
    got = AutoConfig.from_pretrained(tmp_path / "out")
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id) == (1, 2, 0)
    assert (tmp_path / "out" / "tokenizer.json").is_file()

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(base / "config.json", bare / "config.json")
    with pytest.raises(UsageError, match=rf"--base {bare}: no tokenizer.json"):
        export(str(root / "run"), str(tmp_path / "x"), base=str(bare))
    assert not (tmp_path / "x").exists()


def test_a_base_of_the_same_shapes_but_other_settings_is_refused(trained_run, tmp_path):
    """Only shapes were checked: a --base whose rope_theta or norm eps differ from the trained model's exported
    the weights under a config.json that computes something else (exit 0). Checkpoints record the trained config."""
    import dataclasses

    from jaxrl_mismatch.models.config import ModelConfig
    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    _, base, _, _ = trained_run
    c = base_config()
    c.model.path, c.run_dir = str(base), str(tmp_path / "run")
    c.rollout.group_size, c.batch.prompts_per_step, c.trainer.chunk_size = 2, 4, 8
    learner = Learner(learner_config(c))
    trained = json.loads(json.dumps(dataclasses.asdict(ModelConfig.from_hf(str(base)))))
    with Checkpointer(str(tmp_path / "run" / "checkpoints")) as ckpt:
        ckpt.save(1, learner.state, {"step": 1, "config": c.to_dict(), "model_dir": str(base),
                                     "model_config": trained}, force=True)
        ckpt.wait()
    other = shutil.copytree(base, tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    rope = {**cfg.get("rope_parameters", {}), "rope_theta": 1.0}
    (other / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1.0, "rope_parameters": rope,
                                                   "rms_norm_eps": 0.5}))
    with pytest.raises(UsageError, match=rf"^--base {other}: its config.json is not the model the run trained "
                                         r"\(rms_norm_eps: trained 1e-06, base 0.5; rope_theta: trained 10000.0, "
                                         r"base 1.0\)"):
        export(str(tmp_path / "run"), str(tmp_path / "x"), base=str(other))
    assert not (tmp_path / "x").exists()
    export(str(tmp_path / "run"), str(tmp_path / "ok"), base=str(base))  # the run's own base passes
    assert (tmp_path / "ok" / "config.json").is_file()


def test_a_relative_model_path_finds_the_runs_base_from_another_directory(trained_run, tmp_path, monkeypatch, capsys):
    """A run's config.model.path as given ('runs/base') is relative to where train ran: export read it against
    its own directory, failing there ("--base runs/base", a flag never passed) or taking another run's base of
    that name. The trainer records the absolute path in each checkpoint's meta (`model_dir`)."""
    from jaxrl_mismatch.train.learner import Learner
    from jaxrl_mismatch.train.learner_config import learner_config

    _, base, _, _ = trained_run
    c = base_config()
    c.model.path, c.run_dir = str(base), str(tmp_path / "run")
    c.rollout.group_size, c.batch.prompts_per_step, c.trainer.chunk_size = 2, 4, 8
    learner = Learner(learner_config(c))
    c.model.path = "runs/base"  # as the user gave it, where train ran
    with Checkpointer(str(tmp_path / "run" / "checkpoints")) as ckpt:
        ckpt.save(1, learner.state, {"step": 1, "config": c.to_dict(), "model_dir": str(base)}, force=True)
        ckpt.save(2, learner.state, {"step": 2, "config": c.to_dict()}, force=True)  # a run from before the field
        ckpt.save(3, learner.state, {"step": 3, "config": c.to_dict(), "model_dir": str(tmp_path / "gone")},
                  force=True)  # a run moved with its base: the recorded folder is gone
        ckpt.wait()
    elsewhere = tmp_path / "elsewhere"
    decoy = elsewhere / "runs" / "base"
    shutil.copytree(base, decoy)
    cfg = json.loads((decoy / "config.json").read_text())
    (decoy / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 5}))  # another base of that name
    monkeypatch.chdir(elsewhere)
    export(str(tmp_path / "run"), str(tmp_path / "out"), step=1)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 2  # the run's own base
    export(str(tmp_path / "run"), str(tmp_path / "out3"), step=3)  # the recorded base is gone: model.path, warned
    assert json.loads((tmp_path / "out3" / "config.json").read_text())["eos_token_id"] == 5
    assert f"warning: the run's base {tmp_path / 'gone'} is not there" in capsys.readouterr().err
    shutil.rmtree(decoy)
    with pytest.raises(UsageError, match=r"^config.model.path of the run \('runs/base', as train resolved it\) "
                                         r"runs/base: the run's base"):
        export(str(tmp_path / "run"), str(tmp_path / "out2"), step=2)
