"""Fault injection on real runs: no command loses a user's file, every failure is one line with a documented
exit code, and a run continues bit for bit where it can.

One tiny warm start and one reference run (4 RL steps, checkpoints at steps 2 and 4) are shared by the file.
The faults: each file of the newest checkpoint truncated, deleted or garbled (export falls back or refuses
by name; `train` moves the damaged step aside and resumes from step 2, reproducing the reference's steps 2-3
exactly); a full disk (a file-size limit, `RLIMIT_FSIZE`, in the trainer process: the kernel fails the
write with EFBIG as it fails a full disk with ENOSPC) and a read-only checkpoint directory (chmod, or
`chattr +i` when the tests run as root, who ignores permissions) at the step-4 save; two trainers on one run
directory; output folders holding a user's files.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl_mismatch.runlog import read_jsonl
from jaxrl_mismatch.train.checkpoint import CheckpointDamagedError
from jaxrl_mismatch.usage import EXIT_STOPPED, EXIT_STORAGE, UsageError
from tests.child_env import child_env

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:Exception ignored in:pytest.PytestUnraisableExceptionWarning")

# The arguments of the session's shared `tiny_base_model_h64` (tests/conftest.py), used for the warm start
# folder-safety checks too. Long enough that some of a step's 64 samples are right (1-2 % at T=1), so the reference
# run's updates are not all zero and "bit for bit" covers the optimizer state too (the fixture checks it).
WARMSTART = ["--steps", "200", "--num-eval", "0", "--hidden", "64", "--heads", "2", "--kv-heads", "1",
             "--intermediate", "128", "--layers", "1", "--num-train", "2000"]


def _env() -> dict:
    return child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))


def cli(*args: str, preexec=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxrl_mismatch.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=_env(), preexec_fn=preexec)


def error_line(out: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """The one `error:` line of a failed command (no traceback, nothing else on stderr but warnings/logs)."""
    assert out.returncode == code, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr + out.stdout, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes: 'no user file lost or changed' is snapshot equality."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def config_file(path: Path, model: Path, run_dir: Path, steps: int = 4) -> Path:
    path.write_text(f'''from jaxrl_mismatch.train.config import base_config


def get_config():
    c = base_config()
    c.run_dir = {str(run_dir)!r}
    c.steps = {steps}
    c.model.path = {str(model)!r}
    c.model.warmstart_if_missing = False
    c.task.num_train = 200
    c.task.num_val = 8
    c.rollout.group_size = 8
    c.rollout.max_tokens = 28
    c.batch.prompts_per_step = 8
    c.batch.max_oversample_rounds = 1
    c.trainer.chunk_size = 16
    c.optim.lr = 1e-3
    c.eval.every = 0
    c.eval.k = 1
    c.checkpoint.every = 2
    c.log.progress = False
    c.log.tensorboard = False
    c.log.report = False
    return c
''')
    return path


def steps_of(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    return {r["step"]: r for r in read_jsonl(str(path)) if r["step"] >= 0} if path.is_file() else {}


def assert_same_steps(run_dir: Path, reference: Path, steps: list[int]) -> None:
    """Steps reproduced bit for bit: every logged number except wall-clock times."""
    got, want = steps_of(run_dir), steps_of(reference)
    for s in steps:
        a = {k: v for k, v in got[s].items() if not k.startswith("time/")}
        b = {k: v for k, v in want[s].items() if not k.startswith("time/")}
        assert a == b, (s, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})


def copy_run(reference: Path, dest: Path, *, drop_newest: bool = False) -> Path:
    shutil.copytree(reference, dest, ignore=shutil.ignore_patterns("train.lock", "rollout_server*", ".rollout*"))
    if drop_newest:
        shutil.rmtree(dest / "checkpoints" / "4")  # as if the run had stopped after its step-2 checkpoint
    return dest


@pytest.fixture(scope="module")
def base(tiny_base_model_h64) -> Path:
    """The session's hidden-64 warm start (tests/conftest.py, built with WARMSTART's arguments), read only."""
    return tiny_base_model_h64


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> dict:
    """The reference run (4 steps, checkpoints 2 and 4). While it runs, paused, a second trainer on the same
    directory is refused by name; the outcome of that probe is returned for its test."""
    root = tmp_path_factory.mktemp("ref")
    run_dir = root / "run"
    cfg = config_file(root / "cfg.py", base, run_dir)
    first = subprocess.Popen([sys.executable, "-m", "jaxrl_mismatch.cli", "train", "--config", str(cfg)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
    second = None
    try:
        lock = run_dir / "train.lock"
        deadline = time.time() + 240
        while time.time() < deadline and first.poll() is None:
            if lock.is_file() and f"pid {first.pid} " in lock.read_text():
                break
            time.sleep(0.2)
        if first.poll() is None:
            os.kill(first.pid, signal.SIGSTOP)  # hold it mid-run, lock taken, whatever its speed
            try:
                second = cli("train", "--config", str(cfg))
            finally:
                os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-3000:]
    assert any(r["reward/std"] > 0 for r in steps_of(run_dir).values()), "no step had a non-zero advantage"
    return {"run_dir": run_dir, "cfg": cfg, "pid": first.pid, "second": second}


# ---- one trainer per run directory ------------------------------------------------------------------------
@pytest.mark.slow
def test_a_second_trainer_on_the_same_run_directory_is_refused_by_pid(reference):
    second = reference["second"]
    assert second is not None, "the reference run ended before the lock could be probed"
    error_line(second, 2, "in use by another trainer", f"pid {reference['pid']}")
    assert sorted(os.listdir(reference["run_dir"] / "checkpoints")) == ["2", "4"]  # one trainer's checkpoints
    assert sorted(steps_of(reference["run_dir"])) == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_lock_left_by_a_killed_trainer_is_taken_over(tmp_path):
    from jaxrl_mismatch.train.runlock import RunDirLock

    code = ("import sys, time; from jaxrl_mismatch.train.runlock import RunDirLock; "
            f"RunDirLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UsageError, match=f"in use by another trainer \\(pid {holder.pid} "):
            RunDirLock(str(tmp_path)).acquire()
    finally:
        holder.kill()  # kill -9: the lock file stays, with the dead PID in it
        holder.wait()
    assert f"pid {holder.pid} " in (tmp_path / "train.lock").read_text()
    lock = RunDirLock(str(tmp_path)).acquire()  # a stale lock is taken over
    try:
        assert f"pid {os.getpid()} " in (tmp_path / "train.lock").read_text()
    finally:
        lock.release()


# ---- damaged checkpoints ------------------------------------------------------------------------------------
def _damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    else:  # garble: the middle of the file replaced by other bytes, same size
        data = bytearray(path.read_bytes())
        lo, hi = len(data) // 4, max(len(data) // 4 + 1, 3 * len(data) // 4)
        data[lo:hi] = bytes((b ^ 0x5A) for b in data[lo:hi])
        path.write_bytes(bytes(data))


def _weights(out: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow
def test_export_falls_back_from_each_damaged_file_and_refuses_an_explicit_damaged_step(reference, tmp_path, caplog):
    from jaxrl_mismatch.jobs.export import export

    run = reference["run_dir"]
    want = {s: _weights(tmp_path / f"ref{s}") for s in (2, 4) if export(str(run), str(tmp_path / f"ref{s}"), step=s)}
    newest = run / "checkpoints" / "4"
    files = sorted(p.relative_to(newest) for p in newest.rglob("*") if p.is_file())
    assert len(files) >= 8, files
    undetected = []
    for i, rel in enumerate(files):
        for how in ("truncate", "delete", "garble"):
            work = tmp_path / f"run{i}{how}"
            shutil.copytree(run, work, ignore=shutil.ignore_patterns("train.lock"))
            _damage(work / "checkpoints" / "4" / rel, how)
            before = snapshot(work)
            out = tmp_path / f"out{i}{how}"
            caplog.clear()
            step = export(str(work), str(out))
            got = _weights(out)
            assert step in (2, 4) and all(np.array_equal(got[k], want[step][k]) for k in want[step]), (rel, how)
            if step == 2:
                assert any("checkpoints/4" in r.getMessage() and "skipping it" in r.getMessage()
                           for r in caplog.records), (rel, how)
                with pytest.raises(CheckpointDamagedError, match="--step 4: .*other steps: \\[2\\]"):
                    export(str(work), str(tmp_path / f"x{i}{how}"), step=4)
                assert not (tmp_path / f"x{i}{how}").exists()
            else:
                undetected.append(f"{how} {rel}")
            assert snapshot(work) == before  # export only reads the run
            shutil.rmtree(work)
            shutil.rmtree(out)
    # A damage that goes unnoticed left the exported weights bit-identical to the undamaged step 4 (asserted
    # above): it touched a file this restore does not read (orbax's step metadata, commit markers, an OCDBT
    # data file holding nothing the state needs). Every damage of the meta and layout records and of the
    # largest data file (the tensors) is caught — garbling included, by the tensor fingerprints.
    tensors = max((f for f in files if "/d/" in str(f)), key=lambda f: (newest / f).stat().st_size)
    for rel in ("meta/metadata", "layout/metadata", str(tensors)):
        assert not [d for d in undetected if d.endswith(f" {rel}")], (rel, undetected)


def _edit_meta(run: Path, step: int, edit) -> None:
    import json

    path = run / "checkpoints" / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


@pytest.mark.slow
def test_a_meta_without_a_field_is_a_damaged_checkpoint_for_train_and_export(reference, tmp_path, caplog):
    """A newest checkpoint whose meta (valid JSON) lacks a field the resume or the export reads was a bare KeyError,
    exit 1, although the good step 2 sat next to it; now it is set aside (train) or skipped (export) like one whose
    files cannot be read, and an explicit `--step` on it names the missing field."""
    from jaxrl_mismatch.jobs.export import export
    from jaxrl_mismatch.train.config_checks import validate
    from jaxrl_mismatch.train.config_overrides import load_config
    from jaxrl_mismatch.train.loop import Trainer

    for field in ("weight_version", "data", "config"):
        run = copy_run(reference["run_dir"], tmp_path / field)
        _edit_meta(run, 4, lambda m: m.pop(field))
        if field == "config":
            step = export(str(run), str(tmp_path / "out"))
            assert step == 2 and any("checkpoints/4" in r.getMessage() and "skipping it" in r.getMessage()
                                     for r in caplog.records)
            with pytest.raises(CheckpointDamagedError, match="--step 4: .*checkpoints/4: its meta has no 'config'"):
                export(str(run), str(tmp_path / "x"), step=4)
            _edit_meta(run, 4, lambda m: m.update(config={"model": {}}))
            with pytest.raises(CheckpointDamagedError, match="its meta's config.*: its meta has no 'trainer'"):
                export(str(run), str(tmp_path / "x"), step=4)
            continue
        c = load_config(str(config_file(tmp_path / f"{field}.py", _model_of(reference), run)), [])
        validate(c)
        t = Trainer(c)
        try:
            step, (_, meta) = t.ckpt.newest_good(t._read_checkpoint)
        finally:
            t.close()
        assert step == 2 and meta["step"] == 2
        assert [n for n in os.listdir(run / "checkpoints") if n.startswith("4.damaged-")]


@pytest.mark.slow
def test_a_damaged_base_model_is_one_line_naming_the_field_and_file(reference, tmp_path):
    """A truncated model.safetensors or a missing tensor was exit 1 with the library's exception."""
    from safetensors.numpy import load_file, save_file

    from jaxrl_mismatch.train.config import ConfigError
    from jaxrl_mismatch.train.config_overrides import load_config
    from jaxrl_mismatch.train.loop import Trainer

    for how, needle in (("truncate", "model.safetensors is not a readable safetensors file"),
                        ("drop", "checkpoint is missing tensor 'lm_head.weight'")):
        model = tmp_path / how
        shutil.copytree(_model_of(reference), model)
        if how == "truncate":
            _damage(model / "model.safetensors", "truncate")
        else:
            tensors = load_file(str(model / "model.safetensors"))
            tensors.pop("lm_head.weight")
            save_file(tensors, str(model / "model.safetensors"))
        c = load_config(str(config_file(tmp_path / f"{how}.py", model, tmp_path / f"run_{how}")), [])
        with pytest.raises(ConfigError, match=f"config.model.path: .*{needle}"):
            Trainer(c)


@pytest.mark.slow
def test_train_moves_a_damaged_newest_checkpoint_aside_and_resumes_bit_for_bit(reference, tmp_path):
    run = copy_run(reference["run_dir"], tmp_path / "run")
    data = sorted((run / "checkpoints" / "4" / "state").rglob("d/*"), key=lambda p: -p.stat().st_size)[0]
    _damage(data, "truncate")
    cfg = config_file(tmp_path / "cfg.py", _model_of(reference), run)
    # The user's symbolic link where the end-of-run report goes: kept, and its target too (was replaced by a file).
    (tmp_path / "mine.png").write_bytes(b"not a figure")
    (run / "report.png").symlink_to(tmp_path / "mine.png")
    out = cli("train", "--config", str(cfg), "--config.log.report=true")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert (run / "report.png").is_symlink() and (tmp_path / "mine.png").read_bytes() == b"not a figure"
    assert "train: report not written: config.log.report" in out.stderr and "symbolic link" in out.stderr
    warnings = [line for line in out.stderr.splitlines() if "moved it to 4.damaged-" in line]
    assert len(warnings) == 1 and "checkpoints/4" in warnings[0], out.stderr[-3000:]
    aside = [n for n in os.listdir(run / "checkpoints") if n.startswith("4.damaged-")]
    assert len(aside) == 1 and (run / "checkpoints" / aside[0] / "state").is_dir()  # kept, not deleted
    assert "4" in os.listdir(run / "checkpoints")  # step 4 trained again and saved
    assert_same_steps(run, reference["run_dir"], [0, 1, 2, 3])  # steps 2-3 redone exactly
    assert len(out.stderr.splitlines()) < 40, out.stderr  # a few lines, no background tracebacks


def test_a_rerun_after_every_checkpoint_was_damaged_is_refused_and_keeps_the_log(reference, tmp_path):
    """After "no checkpoint can be restored" (every step moved aside as `N.damaged-<ns>`), rerunning the same command
    started a new run at step 0: it deleted the earlier metrics.jsonl (38 records → 2) and replaced report.png."""
    run = copy_run(reference["run_dir"], tmp_path / "run")
    for step in ("2", "4"):  # what `Checkpointer.set_aside` leaves
        os.rename(run / "checkpoints" / step, run / "checkpoints" / f"{step}.damaged-1795823024353038113")
    before = {k: v for k, v in snapshot(run).items() if k != "train.lock"}
    cfg = config_file(tmp_path / "cfg.py", _model_of(reference), run)
    out = cli("train", "--config", str(cfg), "--config.log.report=true")
    error_line(out, EXIT_STORAGE, f"{run}: no checkpoint can be restored", "2.damaged-", "use a new run_dir")
    assert {k: v for k, v in snapshot(run).items() if k != "train.lock"} == before


# ---- checkpoint write failures -------------------------------------------------------------------------------
def _file_size_limit(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_full_disk_at_a_save_stops_the_run_at_that_step_with_one_line(reference, tmp_path):
    run = copy_run(reference["run_dir"], tmp_path / "run", drop_newest=True)
    # Every save writes its tree's `_METADATA` in one file (same tree, same size), so a limit one byte below it
    # cannot fit the step-4 save. Half the biggest data file did not always: orbax's OCDBT splits the same arrays
    # into different files per save (one 447 KB file at step 2, three of at most 211 KB at step 4, measured).
    metadata = (run / "checkpoints" / "2" / "state" / "_METADATA").stat().st_size
    appended = (reference["run_dir"] / "metrics.jsonl").stat().st_size  # the log at the end of the full run
    assert appended < metadata - 1, (appended, metadata)  # the writes before the save stay under the limit
    cfg = config_file(tmp_path / "cfg.py", _model_of(reference), run)
    before = snapshot(run / "checkpoints" / "2")
    t0 = time.monotonic()
    out = cli("train", "--config", str(cfg), preexec=_file_size_limit(metadata - 1), timeout=400)
    line = error_line(out, EXIT_STORAGE, "checkpoints/4: saving failed", "File too large (EFBIG)",
                      "previous checkpoint (step 2) is intact")
    assert time.monotonic() - t0 < 300, "no hang after the failure"
    assert len(out.stderr.splitlines()) < 30, out.stderr  # no background-thread tracebacks
    assert sorted(n for n in os.listdir(run / "checkpoints") if n.isdigit()) == ["2"], line
    assert snapshot(run / "checkpoints" / "2") == before
    assert_same_steps(run, reference["run_dir"], [0, 1, 2, 3])  # the steps before the failed save are exact


@pytest.mark.slow
def test_a_read_only_checkpoint_directory_stops_the_run_at_the_save(reference, tmp_path):
    run = copy_run(reference["run_dir"], tmp_path / "run", drop_newest=True)
    ckpts = run / "checkpoints"
    if os.geteuid() == 0:  # root ignores permission bits; an immutable directory refuses even root
        if subprocess.run(["chattr", "+i", str(ckpts)], capture_output=True).returncode != 0:
            pytest.skip("running as root on a filesystem without chattr +i")
        undo = ["chattr", "-i", str(ckpts)]
    else:
        ckpts.chmod(0o555)
        undo = ["chmod", "755", str(ckpts)]
    try:
        out = cli("train", "--config", str(config_file(tmp_path / "cfg.py", _model_of(reference), run)), timeout=400)
    finally:
        subprocess.run(undo, check=True)
    error_line(out, EXIT_STORAGE, "checkpoints/4: saving failed", "previous checkpoint (step 2) is intact")
    assert len(out.stderr.splitlines()) < 30, out.stderr
    assert sorted(n for n in os.listdir(ckpts) if n.isdigit()) == ["2"]
    assert_same_steps(run, reference["run_dir"], [0, 1, 2, 3])  # the steps before the failed save are exact


def _model_of(reference) -> Path:
    text = reference["cfg"].read_text()
    return Path(text.split("c.model.path = ")[1].split("\n")[0].strip("'"))


# ---- outputs that hold a user's files --------------------------------------------------------------------------
@pytest.mark.slow
def test_warmstart_refuses_folders_and_files_it_did_not_write(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    before = snapshot(tmp_path)
    for target, needle in ((mine, "non-empty directory not written by"), (mine / "notes.txt", "is a file")):
        for extra in ([], ["--force"]):
            error_line(cli("warmstart", "--out", str(target), *WARMSTART, *extra), 2, f"--out {target}", needle)
    error_line(cli("warmstart", "--out", str(tmp_path / "new"), "--lr", "-1"), 2, "--lr")
    assert snapshot(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["mine"]  # no temporary either


@pytest.mark.slow
def test_train_never_warm_starts_into_a_folder_holding_user_files(tmp_path):
    mine = tmp_path / "model"
    mine.mkdir()
    (mine / "weights.bin").write_bytes(b"\0" * 10)
    cfg = config_file(tmp_path / "cfg.py", mine, tmp_path / "run")
    cfg.write_text(cfg.read_text().replace("warmstart_if_missing = False", "warmstart_if_missing = True"))
    error_line(cli("train", "--config", str(cfg)), 2, f"config.model.path {mine}", "non-empty directory")
    assert snapshot(mine) == {"weights.bin": b"\0" * 10}


@pytest.mark.slow
def test_export_never_replaces_what_it_did_not_write(reference, tmp_path):
    run = reference["run_dir"]
    parent_before = snapshot(run.parent)
    user = tmp_path / "user"
    user.mkdir()
    (user / "data.csv").write_text("1,2\n")
    for target, needle in ((run, "is the run directory"), (run.parent, "a parent of the run directory"),
                           (user, "non-empty directory not written by"), (user / "data.csv", "is a file")):
        for extra in ([], ["--force"]):
            error_line(cli("export", str(run), "--out", str(target), *extra), 2, f"--out {target}", needle)
    assert snapshot(run.parent) == parent_before and snapshot(user) == {"data.csv": b"1,2\n"}
    for bad, needle in ((["--step", "-1"], "--step -1"), (["--step", "3"], "--step 3: no such checkpoint"),
                        (["--base", str(tmp_path / "nowhere")], "--base")):
        error_line(cli("export", str(run), "--out", str(tmp_path / "e"), *bad), 2, needle)
    out = tmp_path / "export"
    first = cli("export", str(run), "--out", str(out))
    assert first.returncode == 0, first.stderr[-2000:]
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in out.iterdir())  # world-readable, like an HF checkpoint
    error_line(cli("export", str(run), "--out", str(out)), 2, "already holds the output of an earlier `jaxrl-mismatch export`", "--force")
    again = cli("export", str(run), "--out", str(out), "--step", "2", "--force")
    assert again.returncode == 0 and "step 2" in again.stdout, again.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["export", "user"]  # no temporary left anywhere


@pytest.mark.slow
def test_sigterm_exits_with_its_own_code_and_lower_steps_say_so(reference, tmp_path):
    run = copy_run(reference["run_dir"], tmp_path / "run", drop_newest=True)
    cfg = config_file(tmp_path / "cfg.py", _model_of(reference), run, steps=6)  # never finished when stopped
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl_mismatch.cli", "train", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
    # The resumed run first cuts metrics.jsonl back to its checkpoint (steps 0-1; the SIGTERM handler is set
    # by then), then logs step 2: stop it there.
    deadline, truncated = time.time() + 300, False
    while time.time() < deadline and proc.poll() is None:
        logged = steps_of(run)
        truncated = truncated or 2 not in logged
        if truncated and 2 in logged:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    assert f"exit {EXIT_STOPPED}" in out and "Traceback" not in err
    stopped = max(steps_of(run)) + 1  # 3, or 4 when the signal came just after step 3 began
    assert stopped in (3, 4) and str(stopped) in os.listdir(run / "checkpoints")
    # Steps 0-2 as in the reference (step 2 redone after the resume; the reference's step 3 was its last and
    # carries validation numbers, this run's does not).
    assert_same_steps(run, reference["run_dir"], [0, 1, 2])
    lower = cli("train", "--config", str(cfg), "--config.steps=1")
    assert lower.returncode == 0, lower.stderr[-2000:]
    assert f"config.steps=1 is lower than the {stopped} steps this run has done" in lower.stderr
