import json
import math
import os

import numpy as np
import pytest

from jaxrl_mismatch.report.plot import make_report
from jaxrl_mismatch.runlog import RunWriter, read_jsonl
from jaxrl_mismatch.usage import UsageError


def test_writer_jsonl_tensorboard_and_resume_truncation(tmp_path):
    w = RunWriter(str(tmp_path))
    for s in range(5):
        w.write(s, {"reward/mean": np.float32(s / 10), "lr": 1e-3, "bad": float("nan")})
    w.close()
    recs = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in recs] == list(range(5))
    assert recs[2]["reward/mean"] == pytest.approx(0.2)
    assert recs[0]["bad"] == "nan"
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    # A resumed run from step 3 cuts steps >= 3 written before the crash from the log, then appends; the cut
    # records are kept beside it (they were deleted: after a damaged checkpoint, the only record of those steps).
    before = (tmp_path / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    w = RunWriter(str(tmp_path), resume_from_step=3)
    w.write(3, {"reward/mean": 0.9})
    w.close()
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [0, 1, 2, 3]
    (cut,) = [p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.cut-")]
    assert cut.read_bytes().splitlines(keepends=True) == before[3:]
    # Nothing to cut (a resume at the log's end): no file aside.
    RunWriter(str(tmp_path), resume_from_step=4, tensorboard=False).close()
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.cut-")]) == 1


def test_resume_cut_back_that_fails_half_way_leaves_the_records_as_they_were(tmp_path, monkeypatch):
    """The cut-back writes a temporary sibling renamed into place: a failure while writing it (a full disk, a
    kill) leaves metrics.jsonl whole. It was rewritten in place, so such a failure emptied it."""
    from jaxrl_mismatch import runlog

    w = RunWriter(str(tmp_path), tensorboard=False)
    for s in range(5):
        w.write(s, {"x": float(s)})
    w.close()
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def full_disk(fd):  # the temporary is written; making it durable fails, as on a full disk
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runlog.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        RunWriter(str(tmp_path), resume_from_step=3, tensorboard=False)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary, no half-written copy


def test_read_jsonl_skips_torn_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps({"step": 0, "x": 1.0}) + "\n" + '{"step": 1, "x"')
    assert read_jsonl(str(p)) == [{"step": 0, "x": 1.0}]


def test_report_writes_png_with_surge(tmp_path):
    w = RunWriter(str(tmp_path), tensorboard=False)
    for s in range(40):
        w.write(
            s,
            {
                "reward/mean": 0.2 + s / 100,
                "length/mean": 10.0 if s < 10 else 30.0,
                "mismatch/log_ppl_abs_diff": 1e-3 * (1 + math.sin(s)),
                "mismatch/rho_std": 0.01,
                "grad/norm_clipped_per_token": 0.05,
                "lr": 1e-3 if s < 20 else 5e-4,
                "controller/surge_step": -1 if s < 12 else 12,
            },
        )
    w.close()
    out = make_report(str(tmp_path))
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_report_errors_on_missing_run(tmp_path):
    with pytest.raises(UsageError, match="not a run directory"):
        make_report(str(tmp_path))

def test_resume_keeps_every_line_that_is_not_a_later_step_record(tmp_path):
    """The resume's cut-back read the records with the unchecked reader: a "step" of "3" stopped it with a
    TypeError, and the lines that were not JSON objects (a note, a torn last line) were dropped. Now only the
    step records of the resumed step and later go; every other line stays byte for byte."""
    p = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": 0, "x": 1.0}), json.dumps({"step": "3", "x": 2.0}), "a note of mine",
             json.dumps({"step": 1, "x": 0.5}), json.dumps({"step": 3, "x": 9.0}), json.dumps({"step": 2, "x": 3.0})]
    p.write_text("\n".join(lines) + "\n" + '{"step": 4, "x"')  # ... and a torn last line
    w = RunWriter(str(tmp_path), resume_from_step=3, tensorboard=False)
    w.write(3, {"x": 7.0})
    w.close()
    assert p.read_text().splitlines() == [*lines[:4], lines[5], '{"step": 4, "x"', json.dumps({"step": 3, "x": 7.0})]
    assert [r["step"] for r in read_jsonl(str(p))] == [0, "3", 1, 2, 3]
    (cut,) = [q for q in tmp_path.iterdir() if q.name.startswith("metrics.jsonl.cut-")]
    assert cut.read_text().splitlines() == [lines[4]]  # the one step record it cut


def test_amend_adds_to_the_last_record_of_a_step_in_place(tmp_path):
    """A resumed step's validation (`Trainer.run`: a rollout failure interrupted it) joins that step's record:
    one record per step, the other lines byte for byte, NaN written as the log writes it; a step without a
    record gets one."""
    w = RunWriter(str(tmp_path), tensorboard=False)
    w.write(-1, {"val/accuracy": 0.1})
    w.write(0, {"loss/total": 1.5})
    w.write(1, {"loss/total": 1.25})
    w.close()
    path = tmp_path / "metrics.jsonl"
    before = path.read_bytes().splitlines(keepends=True)
    w = RunWriter(str(tmp_path), resume_from_step=2, tensorboard=False)
    merged = w.amend(1, {"val/accuracy": 0.5, "val/greedy_accuracy": float("nan")})
    assert merged == {"loss/total": 1.25, "val/accuracy": 0.5, "val/greedy_accuracy": merged["val/greedy_accuracy"]}
    assert math.isnan(merged["val/greedy_accuracy"])
    w.write(2, {"loss/total": 1.0})  # the writer goes on appending after an amend
    w.amend(3, {"val/accuracy": 0.75})  # no record of step 3: written
    w.close()
    lines = path.read_bytes().splitlines(keepends=True)
    assert lines[:2] == before[:2]
    assert [json.loads(x) for x in lines[2:]] == [
        {"step": 1, "loss/total": 1.25, "val/accuracy": 0.5, "val/greedy_accuracy": "nan"},
        {"step": 2, "loss/total": 1.0}, {"step": 3, "val/accuracy": 0.75}]


def test_a_resume_never_writes_through_a_dangling_metrics_link(tmp_path, capsys):
    """`metrics.jsonl` a symbolic link to a missing file: the resume's append followed it and created the target,
    outside the run directory. The link is kept aside, renamed, and the log starts in the run directory."""
    run, outside = tmp_path / "run", tmp_path / "elsewhere.jsonl"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(outside)
    w = RunWriter(str(run), resume_from_step=3, tensorboard=False)
    w.write(3, {"loss": 1.0})
    w.close()
    assert not outside.exists()
    assert not (run / "metrics.jsonl").is_symlink()
    assert read_jsonl(str(run / "metrics.jsonl")) == [{"step": 3, "loss": 1.0}]
    (aside,) = run.glob("metrics.jsonl.replaced-*")
    assert aside.is_symlink() and "a dangling symbolic link; kept as" in capsys.readouterr().err


def test_a_resume_and_an_amend_write_through_a_live_metrics_link(tmp_path, capsys):
    """The resume's cut renamed a new file over the user's link: the link was gone and its target still held the
    records the resume redoes. The cut (and an amend) now rewrite the target, as the appends always did."""
    run, shared = tmp_path / "run", tmp_path / "shared_metrics.jsonl"
    run.mkdir()
    shared.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(-1, 6)))
    (run / "metrics.jsonl").symlink_to(shared)
    w = RunWriter(str(run), resume_from_step=3, tensorboard=False)
    w.write(3, {"loss": 30.0})
    w.amend(3, {"val/accuracy": 0.5})
    w.close()
    assert (run / "metrics.jsonl").is_symlink() and os.readlink(run / "metrics.jsonl") == str(shared)
    assert [r["step"] for r in read_jsonl(str(shared))] == [-1, 0, 1, 2, 3]
    assert read_jsonl(str(shared))[-1] == {"step": 3, "loss": 30.0, "val/accuracy": 0.5}
    (aside,) = run.glob("metrics.jsonl.cut-*")  # the redone steps' first records, kept in the run directory
    assert [r["step"] for r in read_jsonl(str(aside))] == [3, 4, 5]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".shared_metrics")]


def _tb_events(tb_dir):
    """(file, step, session-log status or None, tags) of every event in the tb folder's files, in file order."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for f in sorted(tb_dir.iterdir(), key=lambda p: p.stat().st_mtime_ns):
        data, i = f.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            e = event_pb2.Event()
            e.ParseFromString(data[i + 12:i + 12 + n])
            i += 16 + n
            out.append((f.name, e.step, e.session_log.status if e.HasField("session_log") else None,
                        [v.tag for v in e.summary.value]))
    return out


def test_tensorboard_purges_the_steps_a_resume_redoes(tmp_path):
    """A resume cut metrics.jsonl back but TensorBoard kept both writes of a redone step (tb steps 0,1,2,3,3,4). The
    new event file starts with a SessionLog START at the resume step: TensorBoard hides the earlier events from that
    step on (tensorboardX's purge_step); the earlier file stays on disk, whole."""
    from tensorboardX.proto import event_pb2

    w = RunWriter(str(tmp_path))
    for s in range(4):
        w.write(s, {"reward/mean": s / 10})
    w.close()
    first = {f for f, *_ in _tb_events(tmp_path / "tb")}
    w = RunWriter(str(tmp_path), resume_from_step=3)
    w.write(3, {"reward/mean": 0.9})
    w.close()
    events = _tb_events(tmp_path / "tb")
    new = [e for e in events if e[0] not in first]
    # nothing deleted: the earlier writer's file and events stay (a writer started within the same second opened
    # the same file name again and emptied it)
    assert [step for f, step, _, tags in events if f in first and "reward/mean" in tags] == [0, 1, 2, 3]
    starts = [(step, status) for _, step, status, _ in new if status is not None]
    assert starts == [(3, event_pb2.SessionLog.START)]
    # a fresh start (its metrics.jsonl replaced aside) hides every earlier event, the step -1 validation's too
    RunWriter(str(tmp_path)).close()
    latest = max((tmp_path / "tb").iterdir(), key=lambda p: p.stat().st_mtime_ns).name
    assert [(s, st) for f, s, st, _ in _tb_events(tmp_path / "tb") if f == latest and st is not None] == [
        (-1, event_pb2.SessionLog.START)]
    assert [step for _, step, _, tags in new if "reward/mean" in tags] == [3]
