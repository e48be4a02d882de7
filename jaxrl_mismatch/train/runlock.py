"""One trainer per run directory: an OS-level lock held for the run's life.

`<run_dir>/train.lock` is locked with `fcntl.flock` (exclusive, non-blocking) and holds the owner's PID
and host. The kernel releases the lock when its process dies however it dies (kill -9 included), so a
lock file left by a dead trainer is simply taken over; a live holder makes a second `train` on the same
directory stop at once with one line naming its PID (two trainers would overwrite each other's rollout
token and mix checkpoints). The descriptor is not inherited by child processes (the rollout server), so
the lock never outlives the trainer. flock works on local filesystems and on NFSv4; multi-host jobs lock
from process 0 only.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
import stat

from jaxrl_mismatch.usage import UsageError

LOCK_FILE = "train.lock"
# What a harness may put in a new run directory before its trainer starts (jobs/compare.py's status and log).
# Any other content in a run directory without LOCK_FILE belongs to someone else: `train` refuses it.
HARNESS_STATUS_FILE, HARNESS_LOG_FILE = "compare.json", "compare.log"
# What train/checkpoint.py leaves in <run_dir>/checkpoints: orbax step folders, its temporaries, and the steps it
# set aside (`<step>.uncommitted-<ns>`, `<step>.damaged-<ns>`).
_CHECKPOINT_ENTRY = re.compile(r"^(0|[1-9]\d*)(\.orbax-checkpoint-tmp.*|\.uncommitted-\d+|\.damaged-\d+)?$")
_STEP_FILES = ("commit_success.txt", "_CHECKPOINT_METADATA")  # one of them is in every step folder orbax wrote


def is_run_dir(run_dir: str) -> bool:
    """Whether `run_dir` is a training run's (it may be resumed or restarted there): it holds the run lock, or a
    `checkpoints/` folder of this trainer's checkpoints only. A folder of another tool's with a `checkpoints/`
    subfolder (its own numbered steps, model files) is not: a new run there would replace its metrics.jsonl and
    move its step folders aside."""
    if os.path.lexists(os.path.join(run_dir, LOCK_FILE)):
        return True
    ckpts = os.path.join(run_dir, "checkpoints")
    if os.path.islink(ckpts) or not os.path.isdir(ckpts):
        return False
    entries = os.listdir(ckpts)
    return bool(entries) and all(
        (m := _CHECKPOINT_ENTRY.match(e)) is not None and os.path.isdir(os.path.join(ckpts, e))
        and (m.group(2) is not None or any(os.path.isfile(os.path.join(ckpts, e, f)) for f in _STEP_FILES))
        for e in entries)


class RunDirLock:
    """`with RunDirLock(run_dir):` or `lock = RunDirLock(run_dir).acquire()` ... `lock.release()`."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        # Never through a link (its target would be truncated and overwritten with our PID) nor into a FIFO,
        # device or folder: O_NOFOLLOW refuses a link, O_NONBLOCK a FIFO without a writer, fstat the rest.
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            what = ("is a symbolic link; remove it or use another run_dir" if e.errno == errno.ELOOP else
                    f"cannot be created or opened: {e.strerror}")
            raise UsageError(f"config.run_dir: the run lock {self.path} {what}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UsageError(f"config.run_dir: the run lock {self.path} is not a regular file; remove it or use "
                             "another run_dir")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise UsageError(f"config.run_dir: {os.path.dirname(self.path)} is in use by another trainer "
                             f"({holder or 'PID unknown'}, lock {self.path}); wait for it to finish, stop it "
                             "(SIGTERM checkpoints and exits), or use another run_dir") from None
        if not self._is_the_file_at_path(fd):  # unlinked (a stopped start's cleanup) between open and flock
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return self.acquire()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def _is_the_file_at_path(self, fd: int) -> bool:
        try:
            at_path = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)

    def remove(self) -> None:
        """Delete the lock file while still holding it, then release: a trainer that opens the path meanwhile locks a
        new file, or finds it gone and opens again (`acquire`). (Released first, a cleanup deleted a file another
        trainer had just locked, and a third one then ran beside it.)"""
        if self._fd is not None and self._is_the_file_at_path(self._fd):
            os.remove(self.path)
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""
