"""Safe outputs: a command writes only where it may, and never deletes what it did not create.

Rules every output directory follows (`export --out`, `warmstart --out`, `analyze {rollouts,bf16-softmax,
attribute} --out`, a train's warm start into `model.path`):

- the target must be new, an empty directory, or a directory carrying this project's marker file of
  the *same kind* (`.jaxrl-mismatch-export`, `.jaxrl-mismatch-warmstart`) from an earlier write — and
  replacing such a previous output needs `--force`, and the marker lists what was written (each file with its
  size and mtime, each folder or link as such), so `--force` refuses an output that holds anything added or
  changed since; anything else (user files, a run directory, a file, a symbolic link) is refused with one line
  naming it and saying how to proceed (`UsageError`, exit 2);
- everything is written into a temporary sibling (`.<name>.tmp-<random>`) and renamed into place at the
  end, so a crash or error never leaves a half-written output under the target name, and the temporary
  is removed on every failure path (except a target that changed while the command ran: the finished output
  is then kept as `<name>.new-<ns>`, named in the error);
- written files get the ordinary permissions (0666 / 0777 minus the umask, like `cp` or
  `save_pretrained`), so a checkpoint is readable by the serving user, not only its writer.

Output files (`perfectible --out`, `report --out`) are written the same way (temporary sibling, rename);
an existing file is replaced only if it is what the command itself writes, and never through a symbolic link
(see `check_out_file`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from jaxrl_mismatch.usage import Terminated, UsageError, listing, path_kind

MARKER_PREFIX = ".jaxrl-mismatch-"


def marker_name(kind: str) -> str:
    """The marker file of outputs of `kind`, the command that writes them as typed (`analyze rollouts`)."""
    return MARKER_PREFIX + kind.replace(" ", "-")


_MARKER_HEADER = "written by jaxrl-mismatch {kind}; `--force` may replace this directory"
_MARKER_LIST = "its files and folders when written (--force replaces it only while it holds no others):"
# Since 2026-11-28 each file's line also carries its size and mtime (ns) when written, tab-separated, so --force
# also refuses a file of the same name the user has changed since (an edited config.json, a model of their own).
_MARKER_FILES = ("its files and folders when written, files with size and mtime_ns (--force replaces it only "
                 "while it holds no others and its files are unchanged):")


def _entries(root: str) -> set[str]:
    """Every file and folder under `root`, as paths relative to it (symlinks listed, not followed)."""
    out = set()
    for d, dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        out.update(os.path.normpath(os.path.join(rel, n)) for n in dirs + files)
    return out


def file_fingerprint(path: str) -> str | None:
    """"size\tmtime_ns" of a regular file (a link is not followed); None for anything else or nothing: what an
    output is compared by to tell whether a user changed it since the command wrote it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return f"{st.st_size}\t{st.st_mtime_ns}" if stat.S_ISREG(st.st_mode) else None


def _entry_kind(path: str) -> str | None:
    """What a marker records of an entry that is not a regular file: "dir", "link" or "other" (None: nothing)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return "dir" if stat.S_ISDIR(mode) else "link" if stat.S_ISLNK(mode) else "other"


_KINDS = ("dir", "link", "other")
_UNKNOWN = "?"  # the oldest markers list names only: a change goes unseen


def _marker_lines(root: str) -> list[str]:
    """The marker's listing of `root`: every entry, a regular file's with its fingerprint, any other's with its kind
    (a user's file where the output had a folder is then "changed", not the output's own)."""
    lines = []
    for rel in sorted(_entries(root)):
        fp = file_fingerprint(os.path.join(root, rel))
        lines.append(f"{rel}\t{_entry_kind(os.path.join(root, rel))}" if fp is None else f"{rel}\t{fp}")
    return lines


def _changed(path: str, written: str | None) -> bool:
    """Whether the entry at `path` differs from the marker's record of it: a file's fingerprint, another entry's
    kind; a bare name (markers before kinds were recorded) was a folder or a link, so a regular file there now is
    not what was written (without this, --force deleted a user's file put where the output had a folder); the
    oldest markers' names tell nothing (`_UNKNOWN`)."""
    if written == _UNKNOWN:
        return False
    if written is None:
        return file_fingerprint(path) is not None
    if written in _KINDS:
        return _entry_kind(path) != written
    return file_fingerprint(path) != written


def _foreign_entries(path: str, kind: str) -> list[str] | None:
    """What `path` (an earlier output of `kind`) holds that the command did not write, or wrote and that has
    changed since (named "NAME (changed since written)"); None when its marker lists nothing (written before the
    marker listed its files: unknown). Markers of the older format list names only: changes go unseen there."""
    with open(os.path.join(path, marker_name(kind)), errors="replace") as f:
        lines = f.read().splitlines()
    if _MARKER_FILES in lines:
        written: dict[str, str | None] = {}
        for line in lines[lines.index(_MARKER_FILES) + 1:]:
            parts = line.rsplit("\t", 2)
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                written[parts[0]] = f"{parts[1]}\t{parts[2]}"
            elif (kind_of := line.rsplit("\t", 1))[-1] in _KINDS and len(kind_of) == 2:
                written[kind_of[0]] = kind_of[1]
            else:
                written[line] = None
    elif _MARKER_LIST in lines:
        written = dict.fromkeys(lines[lines.index(_MARKER_LIST) + 1:], _UNKNOWN)
    else:
        return None
    present = _entries(path) - {marker_name(kind)}
    foreign = sorted(present - set(written))
    changed = sorted(rel for rel in present & set(written) if _changed(os.path.join(path, rel), written[rel]))
    return foreign + [f"{rel} (changed since written)" for rel in changed]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _parent_writable(flag: str, path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path)) or "/"
    probe = parent
    while not os.path.exists(probe):  # the nearest existing ancestor must let us create the rest
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {path}: {probe} {path_kind(probe)}, so the output cannot be created there")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot create it: {probe} is not writable")


def check_out_dir(flag: str, path: str, kind: str, *, force: bool) -> None:
    """UsageError unless `path` may receive an output directory of `kind` (see module doc)."""
    if not path:
        raise UsageError(f"{flag}: empty path")
    shown, path = path, os.path.abspath(path)  # what `staged_dir` renames: "LINK/" is the link LINK itself
    if os.path.islink(path):  # replacing it would delete the user's link and leave its target as it was
        raise UsageError(f"{flag} {shown}: is a symbolic link; give the directory it points to "
                         f"({os.path.realpath(path)}) or a new path")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {shown}: {path_kind(path)}, not a directory; choose a new directory")
    _parent_writable(flag, shown)
    flag = f"{flag} {shown}"
    if not os.path.isdir(path):
        return
    entries = sorted(os.listdir(path))
    if not entries:
        return
    if marker_name(kind) in entries:
        if not force:
            raise UsageError(f"{flag}: already holds the output of an earlier `jaxrl-mismatch {kind}`; "
                             "pass --force to replace it, or choose a new directory")
        foreign = _foreign_entries(path, kind)
        if foreign is None:
            raise UsageError(f"{flag}: its earlier `jaxrl-mismatch {kind}` output does not list its files, "
                             "so --force cannot tell them from files added since; remove it yourself, or choose "
                             "a new directory (nothing was changed)")
        if foreign:
            raise UsageError(f"{flag}: holds files the earlier `jaxrl-mismatch {kind}` did not write or that "
                             f"changed since ({listing(foreign)}); --force replaces only its own output, unchanged: "
                             "move them out or choose a new directory (nothing was changed)")
        if not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            raise UsageError(f"{flag}: cannot replace it: its parent directory is not writable")
        return
    raise UsageError(f"{flag}: is a non-empty directory not written by `jaxrl-mismatch {kind}` "
                     f"(holds {listing(entries)}); choose a new or empty directory (nothing was changed; --force "
                     f"only replaces an earlier {kind} output)")


def _open_permissions(root: str) -> None:
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for d, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(d, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(d, name), 0o666 & ~mask)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises `usage.Terminated` where it would otherwise end the process outright (the
    default handler, in the main thread), so a staged write's cleanup runs: a warm start stopped by SIGTERM while
    it saved left its whole temporary folder behind. A handler of the caller's own (train's graceful stop) stays."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def staged_dir(flag: str, path: str, kind: str, *, force: bool) -> Iterator[str]:
    """Yield a temporary sibling of `path` to write into (`_staged_dir`), SIGTERM raising meanwhile
    (`_sigterm_raises`)."""
    with _sigterm_raises(), _staged_dir(flag, path, kind, force=force) as tmp:
        yield tmp


@contextlib.contextmanager
def _staged_dir(flag: str, path: str, kind: str, *, force: bool) -> Iterator[str]:
    """Yield a temporary sibling of `path` to write into; on success mark it and rename it to `path`.

    `check_out_dir` is applied before and again at the commit (the target may have changed meanwhile);
    an existing target is replaced only if it is empty or an earlier output of this kind (moved to a
    second temporary sibling first, then deleted, so `path` is never half-written). On any exception the
    temporary is removed and the target is as it was (an earlier output moved aside goes back). If the target
    changed while the command ran so that the commit refuses it, the new output is kept beside it, named in
    the error, rather than thrown away.
    """
    check_out_dir(flag, path, kind, force=force)
    path = os.path.abspath(path)
    parent, name = os.path.dirname(path), os.path.basename(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    old = None  # where an earlier output waits while the new one is renamed into place
    try:
        yield tmp
        listed = _marker_lines(tmp)
        with open(os.path.join(tmp, marker_name(kind)), "w") as f:
            f.write("\n".join([_MARKER_HEADER.format(kind=kind), _MARKER_FILES, *listed]) + "\n")
        _open_permissions(tmp)
        try:
            check_out_dir(flag, path, kind, force=force)
        except UsageError as e:  # the target changed while the command ran: its output is kept, not thrown away
            kept = f"{path}.new-{time.time_ns()}"
            os.rename(tmp, kept)
            raise UsageError(f"{e}; it changed while this command ran, so the new output is in {kept}") from None
        if os.path.isdir(path):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rename(path, os.path.join(old, name))
        os.rename(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)  # an empty directory or our own earlier output
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:  # failed (or interrupted) between the two renames: the earlier output goes back
            if not os.path.lexists(path) and os.path.lexists(os.path.join(old, name)):
                os.rename(os.path.join(old, name), path)
            with contextlib.suppress(OSError):
                os.rmdir(old)
        raise


def check_out_file(flag: str, path: str, *, ours: Callable[[str], bool], what: str, force: bool | None = None) -> None:
    """UsageError unless `path` may receive an output file: new, or an existing file `ours(path)` accepts
    (the kind of file the command writes, e.g. a PNG), or any file with `force` (None: the command has no
    --force flag). A symbolic link is refused, even to such a file and with `force`: the rename into place
    would replace the user's link with a file and leave its target as it was. So is anything else that is not a
    regular file (a FIFO, a socket, a device), before `ours` could open it."""
    if not path:
        raise UsageError(f"{flag}: empty path")
    if path.endswith(("/", os.sep)) or os.path.basename(path) in (".", ".."):
        # "FILE/" is not FILE to the checks below (no link, no file there), but `staged_file` would replace FILE
        raise UsageError(f"{flag} {path}: names a directory (it ends in {os.path.basename(path) or '/'!r}); "
                         "expected a file path")
    if os.path.islink(path):
        raise UsageError(f"{flag} {path}: is a symbolic link; give the file it points to "
                         f"({os.path.realpath(path)}) or a new path (nothing was changed)")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory; expected a file path")
    if os.path.exists(path) and not os.path.isfile(path):
        # Before `ours` reads it: opening a FIFO blocks until a writer comes (report hung for good), a device is
        # no output to replace; and the rename into place would put a file where the user's special file was.
        raise UsageError(f"{flag} {path}: is {_special_kind(path)}, not a regular file; give a new file path "
                         "(nothing was changed)")
    _parent_writable(flag, path)
    if os.path.lexists(path) and not force and not ours(path):
        raise UsageError(f"{flag} {path}: already exists" + (f" and is not {what}" if what else "")
                         + "; choose a new path" + (" or pass --force to replace it" if force is not None else ""))


def _special_kind(path: str) -> str:
    """What a path that exists and is neither a file nor a directory is, in words (for one line naming it)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "not readable"
    for test, what in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "a special file"


@contextlib.contextmanager
def staged_file(path: str) -> Iterator[str]:
    """Yield a temporary sibling file path; on success it is made durable (fsync) and renamed to `path`, on
    failure (SIGTERM too: `_sigterm_raises`) removed."""
    with _sigterm_raises(), _staged_file(path) as tmp:
        yield tmp


@contextlib.contextmanager
def _staged_file(path: str) -> Iterator[str]:
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.tmp-", dir=os.path.dirname(path))
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # a crash after the rename never leaves an empty or partial file under `path`
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def json_safe(obj: Any) -> Any:
    """`obj` with non-finite floats as the strings runlog writes ("nan", "inf", "-inf"): JSON has no NaN, and the
    NaN / Infinity tokens Python writes by default are refused by strict parsers."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, Mapping):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: str, obj: Any) -> None:
    """`obj` as indented strict JSON at `path` (`json_safe`), written to a temporary sibling renamed into place."""
    with staged_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(json_safe(obj), f, indent=2, allow_nan=False)
        f.write("\n")


__all__ = ["MARKER_PREFIX", "check_out_dir", "check_out_file", "json_safe", "marker_name", "staged_dir", "staged_file",
           "write_json"]
