"""The benchmark scripts' flags beyond `--out` (tests/test_benchmark_writes.py): counts bounded by int32 and by the
machine's memory, choices listed, a model folder that is no usable model, the device of update_step_gpu.py, a
failed part, async_rollouts' results stem and the paths its children get, and `--help`. Each is refused in one line
naming the flag, exit 2, before anything is measured; none of these tests measures anything."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _args
from benchmarks._paths import write_json
from jaxrl_mismatch import usage

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"


def _run(script: str, *args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def _one_line(r: subprocess.CompletedProcess, start: str, code: int = 2) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and lines[0].startswith(start), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    return lines[0]


# -- counts: int32 and memory ---------------------------------------------------------------------------------------


def test_counts_are_bounded_by_int32():
    assert _args.positive_int(str(_args.INT32_MAX)) == _args.INT32_MAX
    assert _args.nonneg_int("0") == 0
    for text, parse in (("2147483648", _args.positive_int), ("99999999999", _args.nonneg_int)):
        with pytest.raises(argparse.ArgumentTypeError, match=r"in \d\.\.2147483647 \(int32\)"):
            parse(text)


def test_check_fits_refuses_an_array_larger_than_memory_in_one_line(capsys):
    ap = _args.ArgumentParser(prog="x.py")
    _args.check_fits(ap, "--vocab", 1024, "a small array")  # fits: nothing happens
    with pytest.raises(SystemExit) as e:
        _args.check_fits(ap, "--vocab × --hidden", 2 * usage.physical_memory_bytes(), "the LM head")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: x.py: --vocab × --hidden: the LM head alone needs ") and "of memory" in err


@pytest.mark.parametrize("script, args, needle", [
    # a count past int32: an OverflowError / MemoryError after the flags were accepted
    ("exact_head_barrier.py", ["--vocab", "1000000000000"], "argument --vocab: expected an integer in 1..2147483647"),
    # within int32, but the [hidden, vocab] head alone is terabytes: a MemoryError before
    ("exact_head_barrier.py", ["--vocab", "2000000000"], "--vocab × --hidden: the float32 [--hidden, --vocab] LM head"),
    ("metrics_overhead.py", ["--vocab", "99999999999"], "argument --vocab: expected an integer in 1..2147483647"),
    # an unknown preset: a ValueError traceback before
    ("metrics_overhead.py", ["--preset", "bogus"], "argument --preset: invalid choice: 'bogus' (choose from 'grpo'"),
    # one token per sequence leaves nothing to predict: a ZeroDivisionError traceback inside the measurement
    ("moe_expert_parallel.py", ["--seq", "1"], "--seq must be in [2, 512], got 1"),
    ("moe_expert_parallel.py", ["--rows", "12"], "--rows must be a multiple of 8, got 12"),
    # finite in float64, inf in float32: a torch traceback after the model was built (--lr), a run at T = inf
    # recorded as 1e99 (--temperature)
    ("update_step.py", ["--lr", "1e99"], "argument --lr: expected a number in float32's range"),
    ("exact_head_barrier.py", ["--temperature", "1e99"], "argument --temperature: expected a number in float32's"),
    ("exact_head_barrier.py", ["--temperature", "1e-50"], "argument --temperature: expected a number in float32's"),
    # cuDNN's traceback from the part, exit 1, after the model was built (the trainer refuses the same in one line)
    ("update_step_gpu.py", ["--device", "cpu", "--shape", "tiny", "--attention-impl", "cudnn"],
     "argument --attention-impl: 'cudnn' cannot run: it needs a GPU (--device cpu)"),
])
def test_a_count_or_choice_out_of_range_is_one_line(script, args, needle, tmp_path):
    line = _one_line(_run(script, *args, "--out", str(tmp_path / "r.json")), f"error: {script}: ")
    assert needle in line
    assert list(tmp_path.iterdir()) == []


# -- --model: a folder that is no usable model -------------------------------------------------------------------------

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 32, "hidden_size": 128,
         "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "max_position_embeddings": 640, "attention_bias": False}


@pytest.fixture
def bad_models(tmp_path) -> dict[str, tuple[Path, str]]:
    """(folder, what the one line says) of each kind of unusable --model."""
    from safetensors.numpy import save_file
    import numpy as np

    foo = tmp_path / "foo"  # a config.json that is no model's
    foo.mkdir()
    (foo / "config.json").write_text('{"foo": 1}')
    bare = tmp_path / "bare"  # a saved model without its tokenizer (its weights are the ones config.json needs)
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(QWEN3))
    from flax import nnx

    from jaxrl_mismatch.models.config import ModelConfig
    from jaxrl_mismatch.models.hf_io import abstract_model, hf_tensor_shapes
    from jaxrl_mismatch.precision import DTypePolicy

    params = nnx.split(abstract_model(ModelConfig.from_hf(str(bare)), DTypePolicy()), nnx.Param)[1]
    save_file({n: np.zeros(shape, np.float32) for n, (shape, _) in hf_tensor_shapes(params).items()},
              str(bare / "model.safetensors"))
    afile = tmp_path / "afile"
    afile.write_text("not a model\n")
    return {"foo": (foo, "cannot read config.json"), "bare": (bare, "no tokenizer.json at"),
            "file": (afile, "is a file")}


@pytest.mark.parametrize("script, kinds", [("async_profile.py", ("foo", "bare")), ("async_rollouts.py", ("bare", "file"))])
def test_an_unusable_model_is_one_line_naming_model_before_measuring(script, kinds, bad_models, tmp_path):
    for path, says in (bad_models[k] for k in kinds):
        r = _run(script, "--model", str(path), "--out", str(tmp_path / "out" / "r"))
        assert says in _one_line(r, f"error: --model {path}: ")
    r = _run(script, "--model", str(tmp_path / "none"), "--out", str(tmp_path / "out" / "r"))
    assert "configs/tiny_cpu.py" in _one_line(r, f"error: --model {tmp_path / 'none'}: does not exist; ")
    assert not (tmp_path / "out").exists()


def test_mismatch_sources_names_model_not_the_warm_starts_out(bad_models, tmp_path):
    """A file at --model was "error: --out ...: is a file ... --force" (the warm start's own flags)."""
    path, _ = bad_models["file"]
    line = _one_line(_run("mismatch_sources.py", "--model", str(path), "--out", str(tmp_path / "r.json")),
                     f"error: --model {path}: is a file")
    assert "--out" not in line and "--force" not in line
    path, says = bad_models["bare"]
    assert says in _one_line(_run("mismatch_sources.py", "--model", str(path), "--out", str(tmp_path / "r.json")),
                             f"error: --model {path}: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "bare", "foo"]


# -- async_rollouts: the results stem, and absolute paths for the trainer it starts ---------------------------------


def test_async_rollouts_results_stem_keeps_dotted_names_and_refuses_a_folder(tmp_path):
    from benchmarks.async_rollouts import result_path

    assert result_path("--out", str(tmp_path / "res_v1.2")) == tmp_path / "res_v1.2.json"  # was res_v1.json
    assert result_path("--out", str(tmp_path / "res.json")) == tmp_path / "res.json"
    assert result_path("--out", str(tmp_path / "res.md")) == tmp_path / "res.json"
    assert result_path("--out", "docs/results/async_rollouts") == Path("docs/results/async_rollouts.json")
    (tmp_path / "adir").mkdir()
    for out in (tmp_path / "adir", f"{tmp_path / 'new'}/"):  # wrote adir.json beside the folder
        line = _one_line(_run("async_rollouts.py", "--out", str(out)), f"error: --out {out}: names a directory")
        assert "STEM.json" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]


class _Started(Exception):
    pass


def test_async_rollouts_gives_the_trainer_an_absolute_model_and_records_only_what_ran(tmp_path, monkeypatch, capsys):
    """The trainer runs with cwd=REPO: a --model relative to the caller's folder is made absolute first."""
    import benchmarks.async_rollouts as ar

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ar, "check_model", lambda *a, **k: None)  # tests above cover the check itself
    monkeypatch.setattr(ar.os, "cpu_count", lambda: 2)  # the loop part pins two cores
    seen = {}

    def fake_run(cmd, **kw):
        seen.update(cmd=cmd, cwd=kw.get("cwd"))
        return subprocess.CompletedProcess(cmd, 1, "", "stopped by the test")

    monkeypatch.setattr(ar.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["async_rollouts.py", "--model", "m", "--part", "loop", "--out", "r"])
    with pytest.raises(SystemExit, match="sync run failed"):
        ar.main()
    assert seen["cwd"] == ar.REPO and f"--config.model.path={tmp_path / 'm'}" in seen["cmd"]

    # --part bypass: no loop ran, so the result records no --steps / --warmup (and no error over them)
    monkeypatch.setattr(ar, "bypass_saving", lambda a, work: {"prepare_s_recompute": 2.0, "prepare_s_bypass": 1.0,
                                                              "saving_s": 1.0, "saving_frac_of_prepare": 0.5,
                                                              "repeats": a.bypass_repeats})
    monkeypatch.setattr(sys, "argv", ["async_rollouts.py", "--model", "m", "--part", "bypass", "--steps", "1",
                                      "--warmup", "5", "--out", "res_v1.2"])
    assert ar.main() == 0
    result = json.loads((tmp_path / "res_v1.2.json").read_text())
    assert result["part"] == "bypass" and "steps" not in result and "warmup" not in result
    assert result["model"] == str(tmp_path / "m") and (tmp_path / "res_v1.2.md").is_file()
    out = capsys.readouterr().out
    assert out.endswith("wrote res_v1.2.json\nwrote res_v1.2.md\n")


def test_async_profile_child_checks_no_out_and_gets_an_absolute_model(tmp_path, monkeypatch, capsys):
    """The per-mode child was started without --out, so it checked the repository's default path (and could refuse
    a run whose --out pointed elsewhere): it checks nothing now, and the parent passes it an absolute --model."""
    import benchmarks.async_profile as apf

    monkeypatch.chdir(tmp_path)
    checked = []
    monkeypatch.setattr(apf, "check_out", lambda *a, **k: checked.append(a))
    monkeypatch.setattr(apf, "profile", lambda mode, a, work: {"mode": mode, "model": a.model})
    monkeypatch.setattr(sys, "argv", ["async_profile.py", "--mode", "1", "--model", "m"])
    assert apf.main() == 0 and checked == []
    assert json.loads(capsys.readouterr().out.split("RESULT ", 1)[1]) == {"mode": 1, "model": str(tmp_path / "m")}

    monkeypatch.setattr(apf, "check_model", lambda *a, **k: None)
    monkeypatch.setattr(apf.os, "cpu_count", lambda: 2)
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, "", "stopped by the test")

    monkeypatch.setattr(apf.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["async_profile.py", "--model", "m", "--out", "r.json"])
    with pytest.raises(SystemExit, match="staleness 0 run failed"):
        apf.main()
    assert checked == [("--out", "r.json", apf.__file__)]
    cmd = seen["cmd"]
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "m") and "--mode" in cmd


# -- update_step_gpu.py: the device, --decode-alloc, a failed part ----------------------------------------------------


def test_update_step_gpu_device_decides_the_platform(monkeypatch):
    """An inherited JAX_PLATFORMS=cpu won over --device gpu (setdefault): it ran on the CPU, labelled gpu."""
    import benchmarks.update_step_gpu as usg

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert usg.child_env(argparse.Namespace(device="gpu"))["JAX_PLATFORMS"] == "cuda"
    assert usg.child_env(argparse.Namespace(device="cpu"))["JAX_PLATFORMS"] == "cpu"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU may be here: the run would measure")
def test_update_step_gpu_without_a_gpu_is_one_line_exit_2(tmp_path):
    """Was exit 1, "jax cannot start on it: AssertionError" (or, with JAX_PLATFORMS=cpu inherited, a CPU run)."""
    for env in (dict(os.environ, JAX_PLATFORMS="cpu"), {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}):
        r = _run("update_step_gpu.py", "--device", "gpu", "--shape", "tiny", "--out", str(tmp_path / "r.json"), env=env)
        assert "--device cpu" in _one_line(r, "error: --device gpu: JAX finds no GPU here")
    assert list(tmp_path.iterdir()) == []


def test_update_step_gpu_checks_decode_alloc_when_parsing(tmp_path):
    """--decode-alloc 4 with 16 decode steps failed in the child (init_cache max_len -43), and the parent exited 0."""
    r = _run("update_step_gpu.py", "--device", "cpu", "--shape", "tiny", "--batch-seq", "1x16", "--parts", "decode",
             "--decode-alloc", "4", "--out", str(tmp_path / "r.json"))
    assert "give at least 18" in _one_line(r, "error: update_step_gpu.py: argument --decode-alloc: 4 slots")
    assert list(tmp_path.iterdir()) == []


def test_update_step_gpu_decode_fills_stay_in_the_cache():
    """Every filled length the sweep times leaves room for its steps, down to the smallest --decode-alloc accepted."""
    src = (BENCHMARKS / "update_step_gpu.py").read_text()
    expr = re.search(r"fills = (sorted\(\{max\(1, .*?\}\))", src).group(1)
    for alloc, steps in ((18, 16), (20, 16), (64, 16), (8192, 16), (100, 1)):
        fills = eval(expr, {"alloc": alloc, "steps": steps})  # noqa: S307 - the script's own expression
        assert fills and all(1 <= f and f + steps + 1 <= alloc for f in fills), (alloc, steps, fills)


def test_update_step_gpu_exits_1_when_a_part_failed_and_says_so(tmp_path, monkeypatch, capsys):
    import benchmarks.update_step_gpu as usg

    monkeypatch.setattr(usg, "probe_device", lambda args: "cpu")
    monkeypatch.setattr(usg, "run_part", lambda name, args, work: {"error": f"part {name} exited with 1"})
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["update_step_gpu.py", "--device", "cpu", "--shape", "tiny", "--parts",
                                      "jax,packing", "--out", str(out)])
    assert usg.main() == 1
    captured = capsys.readouterr()
    result = json.loads(out.read_text())
    assert result["failed_parts"] == ["jax", "packing"] and result["parts"]["jax"] == {"error": "part jax exited with 1"}
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: 2 part(s) failed (part jax exited with 1; part packing")
    assert f"wrote {out}\n" in captured.out


# -- update_step.py: the step's grad norms compared ------------------------------------------------------------------


def test_update_step_rel_diff_of_zero_grad_norms():
    """A step whose gradient is 0 on both sides (every token clipped) ended the run in a ZeroDivisionError after it
    had measured everything (`--batch 1 --seq 8 --prompt-len 2`): both 0 agree."""
    from benchmarks.update_step import rel_diff

    assert rel_diff(0.0, 0.0) == 0.0
    assert rel_diff(1.0, 0.0) == rel_diff(0.0, 1.0) == 1.0
    assert rel_diff(7.013651, 7.013574) == pytest.approx(abs(7.013651 / 7.013574 - 1), rel=1e-4)
    assert rel_diff(-2.0, 2.0) == 2.0


# -- --help ---------------------------------------------------------------------------------------------------------


def test_description_is_the_first_paragraph():
    doc = "One sentence that goes on\nover two lines.\n\n    usage line\n\nMore.\n"
    assert _args.description(doc) == "One sentence that goes on\nover two lines."
    scripts = [p for p in sorted(BENCHMARKS.glob("*.py")) if "ArgumentParser(" in p.read_text()]
    assert len(scripts) >= 13
    for p in scripts:  # the first line alone cut sentences mid-way ("... against", "... the reference exact")
        text = p.read_text()
        assert "__doc__.splitlines()[0]" not in text and '__doc__.split("\\n")[0]' not in text, p.name


def test_help_shows_the_whole_first_paragraph_and_the_defaults():
    r = _run("async_rollouts.py", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert 'and what the `proximal = "bypass"` option saves in `Learner.prepare`.' in text
    assert "--steps STEPS loop part: steps per mode (the first --warmup are not timed) (default: 20)" in text
    assert "--part {all,loop,bypass,behaviour} default: all" in text
    r = _run("update_step_gpu.py", "--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "next to PyTorch; engine generation vs the HBM bound." in text
    assert "of jax, torch, engine, decode, packing; jax always runs" in text
    assert "also the packing part's timed runs (default: 5)" in text


def test_no_benchmark_prints_or_writes_a_result_of_its_own():
    """Every result (and its table) goes through `write_json`, which checks --out again and prints `wrote PATH`: no
    script writes one with `write_text` (only update_step_gpu's child, its scratch file for the parent) or prints a
    "wrote" line of its own (exact_head_barrier wrote its result silently)."""
    scripts = [p for p in sorted(BENCHMARKS.glob("*.py")) if p.name not in ("_paths.py", "_args.py")]
    calls = [f"{p.name}: {line.strip()}" for p in scripts for line in p.read_text().splitlines()
             if re.search(r"\bwrite_text\(", line) and "token_file.write_text(" not in line]
    assert calls == ['update_step_gpu.py: write_text(Path(args._work) / f"{args._part}.json", json.dumps(result))  '
                     '# for the parent, not a result']
    assert [p.name for p in scripts if re.search(r"print\(f?[\"']wrote ", p.read_text())] == []


def test_write_json_names_each_file_it_wrote(tmp_path, capsys):
    out = tmp_path / "r.json"
    write_json(out, {"x": 1}, BENCHMARKS / "mismatch_sources.py", table="| a |\n")
    assert capsys.readouterr().out == f"wrote {out}\nwrote {tmp_path / 'r.md'}\n"
    assert (tmp_path / "r.md").read_text() == "| a |\n"
