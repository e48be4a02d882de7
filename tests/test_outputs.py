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
    with pytest.raises(UsageError, match=r"--out .*did not write \(NOTES.txt, sub/mine\); --force replaces only"):
        _write(out, files=("c.txt",))
    assert (out / "NOTES.txt").read_text() == "mine" and (out / "sub" / "mine").is_dir() and (out / "a.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left behind


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
