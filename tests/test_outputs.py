"""`outputs.staged_dir`: --force replaces only what an earlier output of the same command wrote, and a symlink
target is refused, never replaced (both used to delete what the user had put there)."""

import os

import pytest

from jaxrl_mismatch.outputs import marker_name, staged_dir
from jaxrl_mismatch.usage import UsageError

KIND = "export"


def _write(out, files=("a.txt", "sub/b.txt")):
    with staged_dir("--out", str(out), KIND, force=True) as tmp:
        for name in files:
            os.makedirs(os.path.dirname(os.path.join(tmp, name)) or tmp, exist_ok=True)
            with open(os.path.join(tmp, name), "w") as f:
                f.write(name)


def test_force_replaces_an_earlier_output_that_holds_only_its_own_files(tmp_path):
    out = tmp_path / "out"
    _write(out)
    _write(out, files=("c.txt",))
    assert sorted(p.name for p in out.iterdir()) == [marker_name(KIND), "c.txt"]


def test_force_refuses_an_earlier_output_holding_files_added_since(tmp_path):
    out = tmp_path / "out"
    _write(out)
    (out / "NOTES.txt").write_text("mine")
    (out / "sub" / "mine").mkdir()
    with pytest.raises(UsageError, match=r"--out .*did not write or that changed since \(NOTES.txt, sub/mine\); --force replaces only"):
        _write(out, files=("c.txt",))
    assert (out / "NOTES.txt").read_text() == "mine" and (out / "sub" / "mine").is_dir() and (out / "a.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left behind


@pytest.mark.parametrize("edit", ["content", "same size", "replaced"])
def test_force_refuses_an_earlier_output_whose_files_changed_since(tmp_path, edit):
    """The marker listed names only, so a file the user changed under one of them (a hand-edited config.json, a
    model of their own saved over the exported one) was deleted by --force. Each file's size and mtime are
    listed now: any change is refused by name, and the file stays as the user left it."""
    out = tmp_path / "out"
    _write(out)
    mine = out / "sub" / "b.txt"
    if edit == "content":
        mine.write_text("my own notes, longer")
    elif edit == "same size":
        st = mine.stat()
        mine.write_text("B" * st.st_size)
        os.utime(mine, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    else:
        mine.unlink()
        mine.write_text("sub/b.txt")  # the same bytes, a new file written later
        os.utime(mine, ns=(0, 10**9))
    want = mine.read_bytes()
    with pytest.raises(UsageError, match=r"did not write or that changed since \(sub/b.txt \(changed since written\)\)"):
        _write(out, files=("c.txt",))
    assert mine.read_bytes() == want and (out / "a.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


@pytest.mark.parametrize("marker", ["with kinds", "bare folder names"])
def test_force_refuses_a_users_file_put_where_the_output_had_a_folder(tmp_path, marker):
    """A folder has no fingerprint, so its entry went unchecked: --force deleted a user's file that had taken the
    folder's name. The marker records each entry's kind now; a bare name (markers before) was no regular file."""
    out = tmp_path / "out"
    _write(out)
    if marker == "bare folder names":
        m = out / marker_name(KIND)
        m.write_text(m.read_text().replace("sub\tdir\n", "sub\n"))
    assert "sub\tdir\n" in (out / marker_name(KIND)).read_text() or marker != "with kinds"
    (out / "sub" / "b.txt").unlink()
    (out / "sub").rmdir()
    (out / "sub").write_text("USER DATA")
    with pytest.raises(UsageError, match=r"changed since \(sub \(changed since written\)\)"):
        _write(out, files=("c.txt",))
    assert (out / "sub").read_text() == "USER DATA"
    _write(tmp_path / "again")  # unchanged folders still pass
    _write(tmp_path / "again", files=("c.txt",))
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == [marker_name(KIND), "c.txt"]


def test_force_accepts_an_earlier_output_whose_marker_lists_names_only(tmp_path):
    """Outputs written before the marker carried sizes and mtimes (names only) are still replaced by --force
    when they hold nothing else, as before."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("a")
    (out / marker_name(KIND)).write_text(f"written by jaxrl-mismatch {KIND}; `--force` may replace this directory\n"
                                         "its files and folders when written (--force replaces it only while it "
                                         "holds no others):\na.txt\n")
    _write(out, files=("c.txt",))
    assert sorted(p.name for p in out.iterdir()) == [marker_name(KIND), "c.txt"]


def test_force_refuses_an_output_whose_marker_lists_no_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / marker_name(KIND)).write_text(f"written by jaxrl-mismatch {KIND}; `--force` may replace this directory\n")
    (out / "x").write_text("?")
    with pytest.raises(UsageError, match="does not list its files"):
        _write(out)
    assert (out / "x").read_text() == "?"


def test_a_symlink_target_is_refused_and_kept(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UsageError, match=r"--out .*link: is a symbolic link; give the directory it points to"):
        _write(link)
    assert link.is_symlink() and real.is_dir() and not list(real.iterdir())


@pytest.mark.parametrize("force", [None, False, True])
def test_an_output_file_that_is_a_symlink_is_refused_and_kept(tmp_path, force):
    """A link to a file the command would replace (its own figure) is refused too: renaming the new file into
    place replaced the link with a regular file and left its target as it was."""
    from jaxrl_mismatch.outputs import check_out_file

    target = tmp_path / "ours.png"
    target.write_bytes(b"ours")
    link = tmp_path / "link.png"
    link.symlink_to(target)
    with pytest.raises(UsageError, match=rf"^--out {link}: is a symbolic link; give the file it points to "
                                         rf"\({target}\)"):
        check_out_file("--out", str(link), ours=lambda _: True, what="", force=force)
    dangling = tmp_path / "dangling.png"
    dangling.symlink_to(tmp_path / "missing.png")
    with pytest.raises(UsageError, match="is a symbolic link"):
        check_out_file("--out", str(dangling), ours=lambda _: True, what="", force=force)
    assert link.is_symlink() and target.read_bytes() == b"ours" and dangling.is_symlink()


def test_a_symlink_given_with_a_trailing_slash_is_refused_before_any_work(tmp_path):
    """`--out LINK/` passed the up-front check (LINK/ is the directory behind the link, not a link) and the job ran
    to the end, to be refused at the rename, which works on the link itself."""
    from jaxrl_mismatch.outputs import check_out_dir

    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    for given in (f"{link}/", f"{link}//", f"{link}/."):
        with pytest.raises(UsageError, match=rf"^--out {given}: is a symbolic link; give the directory it points to"):
            check_out_dir("--out", given, KIND, force=True)
    assert link.is_symlink() and not list(real.iterdir())
    check_out_dir("--out", f"{real}/", KIND, force=False)  # a real empty directory, slash or not, is taken


@pytest.mark.parametrize("force", [None, False, True])
def test_an_output_file_given_with_a_trailing_slash_is_refused(tmp_path, force):
    """`--out FILE/` named no file to the checks (no link, nothing at FILE/), and the rename into place replaced
    FILE: a user's file, the command's own input, a link — even without --force."""
    from jaxrl_mismatch.outputs import check_out_file, staged_file

    mine = tmp_path / "precious.txt"
    mine.write_text("precious\n")
    link = tmp_path / "link.txt"
    link.symlink_to(mine)
    for given in (f"{mine}/", f"{link}/", f"{tmp_path / 'new.txt'}/", f"{mine}/."):
        with pytest.raises(UsageError, match=rf"^--out {given}: names a directory \(it ends in '(/|\.)'\); "
                                             r"expected a file path$"):
            check_out_file("--out", given, ours=lambda _: False, what="", force=force)
    assert mine.read_text() == "precious\n" and link.is_symlink()
    assert not (tmp_path / "new.txt").exists()
    with staged_file(str(tmp_path / "new.txt")) as tmp:  # a plain new path still works
        open(tmp, "w").write("x")
    assert (tmp_path / "new.txt").read_text() == "x"


def test_a_target_that_changed_while_writing_is_kept_and_so_is_the_new_output(tmp_path):
    """The commit re-checks the target. A file the user put there meanwhile is never replaced, and the command's
    own output (hours of work, say) was thrown away with the temporary; it is kept beside it and named."""
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=r"it changed while this command ran, so the new output is in .*out\.new-\d+$") as e:
        with staged_dir("--out", str(out), KIND, force=False) as tmp:
            with open(os.path.join(tmp, "result.txt"), "w") as f:
                f.write("hours of work")
            out.mkdir()
            (out / "theirs.txt").write_text("mine")
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    kept = str(e.value).rsplit(" ", 1)[-1]
    assert open(os.path.join(kept, "result.txt")).read() == "hours of work"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_a_failed_rename_into_place_puts_the_earlier_output_back(tmp_path, monkeypatch):
    """Between moving the earlier output aside and renaming the new one into place, a failure (or Ctrl-C) left
    the target missing and the earlier output hidden in a `.out.old-` folder."""
    from jaxrl_mismatch import outputs

    out = tmp_path / "out"
    _write(out)
    before = sorted(p.name for p in out.iterdir())
    rename = os.rename

    def failing(src, dst):
        if os.path.basename(str(src)).startswith(".out.tmp-") and str(dst) == str(out):
            raise OSError(16, "Device or resource busy")
        return rename(src, dst)

    monkeypatch.setattr(outputs.os, "rename", failing)
    with pytest.raises(OSError, match="busy"):
        _write(out, files=("c.txt",))
    assert sorted(p.name for p in out.iterdir()) == before and (out / "a.txt").read_text() == "a.txt"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


@pytest.mark.parametrize("staged", ["dir", "file"])
def test_sigterm_while_writing_removes_the_temporary_and_exits_143(tmp_path, staged):
    """A warm start stopped by SIGTERM while it saved left its whole temporary folder (.base.tmp-*) for good: the
    default handler ended the process before any cleanup. Within a staged write SIGTERM now raises, the temporary
    goes, and the command says so with exit 143."""
    import signal
    import subprocess
    import sys

    script = f"""
import os, signal, sys
from jaxrl_mismatch import cli
from jaxrl_mismatch.outputs import staged_dir, staged_file

def job(argv):
    if {staged!r} == "dir":
        with staged_dir("--out", {str(tmp_path / "out")!r}, "warmstart", force=False) as tmp:
            open(os.path.join(tmp, "model.safetensors"), "w").write("x" * 1000)
            os.kill(os.getpid(), signal.SIGTERM)
    else:
        with staged_file({str(tmp_path / "out.png")!r}) as tmp:
            open(tmp, "w").write("x")
            os.kill(os.getpid(), signal.SIGTERM)
    return 0

import jaxrl_mismatch.jobs.export as export
export.main = job
sys.exit(cli.main(["export"]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 143, (out.returncode, out.stderr)
    assert out.stderr == ("error: stopped by SIGTERM; the output being written was removed (nothing half-written is "
                          "left)\n")
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # this process's handler is untouched


def test_a_handler_of_the_callers_own_is_kept_while_writing(tmp_path):
    """train's graceful stop (finish the step, checkpoint) must not become an exception inside a staged write."""
    import signal

    def graceful(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, graceful)
    try:
        with staged_dir("--out", str(tmp_path / "out"), KIND, force=False) as tmp:
            assert signal.getsignal(signal.SIGTERM) is graceful
            with open(os.path.join(tmp, "a.txt"), "w") as f:
                f.write("a")
        assert (tmp_path / "out" / "a.txt").read_text() == "a" and signal.getsignal(signal.SIGTERM) is graceful
    finally:
        signal.signal(signal.SIGTERM, previous)
