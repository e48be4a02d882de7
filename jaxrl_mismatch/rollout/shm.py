"""Same-host weight sync through shared memory: the trainer writes, the server maps; only metadata crosses gRPC.

Why: over gRPC a weight push costs a protobuf copy per chunk, HTTP/2 framing and the loopback socket on
both sides (423 MB/s measured against ~19-25 GB/s memcpy, `benchmarks/rollout.py`), i.e. seconds per step
for a multi-GB policy. When the server runs on the trainer's host the bytes need not move through a
socket at all.

How. The trainer owns one anonymous shared-memory file (`memfd_create`): it lays the tensors out in it
(64-byte aligned, C-contiguous, little-endian), hashes the used bytes with xxh3-64, and sends
`UpdateWeightsShm` with the version, every tensor's name/dtype/shape/offset, the hash and where to find
the file (`/proc/<trainer pid>/fd/<fd>`), authenticated with the same bearer token as `UpdateWeights`.
The server opens that path read-only, maps it, re-hashes it (a stale, truncated or foreign buffer is
refused), checks the tensors exactly as a streamed push (`validation.py`: names, shapes, dtypes, finite
values) and hands the mapped arrays to its engine, which copies them (read-only host arrays are copied,
never aliased: `hf_io.hf_to_params`, `vllm_engine._to_torch`) before the call answers.

Nothing is ever left behind: a memfd has no name in /dev/shm or anywhere else, so a trainer killed with
SIGKILL mid-push leaves no file to clean up; the kernel frees the memory once the trainer's descriptor
and the server's mapping are gone (the server keeps the latest trainer's mapping for the next push).
The file is reused across pushes: allocating shared memory is slow here, rewriting it is memcpy-fast.

When it applies: the server advertises `GetInfoResponse.shm_host_id` (this module's `host_id()`: boot id
and PID namespace, so `/proc/<pid>` means the same process on both ends), the client dials a loopback
address (or a unix socket), and both host ids are equal. Otherwise — or when the server cannot open the
file (e.g. another user's process) — the client falls back to the gRPC stream. `weight_transport`
forces either ("shm" then fails instead of falling back).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import weakref
from collections.abc import Mapping

import numpy as np
import xxhash

from jaxrl_mismatch.rollout import rollout_pb2
from jaxrl_mismatch.rollout.engine import TensorSpec
from jaxrl_mismatch.rollout.protocol import little_endian, tensor_from_bytes, tensor_nbytes
from jaxrl_mismatch.rollout.validation import RequestError, check_finite_tensor
from jaxrl_mismatch.usage import mode_kind

ALIGN = 64
TRANSPORTS = ("auto", "shm", "grpc")
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0"}


def checksum(buf) -> int:
    """xxh3-64 of a buffer: ~35 GB/s on this machine (crc32 6.5, blake2b 1.3), so verifying costs ~1 memcpy."""
    return xxhash.xxh3_64_intdigest(buf)


def host_id() -> str:
    """Identifies "same host, same /proc": the boot id plus the PID namespace; "" where memfd is unavailable."""
    if not hasattr(os, "memfd_create"):
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def is_local_target(target: str) -> bool:
    """True for a gRPC target on this host: a unix socket or a loopback host."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.rsplit(":", 1)[0] if not target.startswith("[") else target[: target.index("]") + 1]
    return host.lower() in _LOOPBACK_HOSTS or host.startswith("127.")


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ShmWriter:
    """The trainer's side: one memfd, rewritten by every push and grown when needed. Close with `close()`.

    Reused rather than created per push: on this machine a fresh 50 MB shared-memory file costs ~125 ms to
    allocate (400 MB/s) while rewriting an allocated one runs at memcpy speed (benchmarks/rollout.py).
    Safe because the server never keeps views of it: it verifies the bytes and the engine copies them
    before UpdateWeightsShm answers, and pushes of one client are sequential. A push that failed (its
    deadline passed, say) may still be read by the server's handler: the client then drops this writer and
    the next push writes a new file (`RolloutClient._push_shm`), never the bytes being read.
    """

    def __init__(self) -> None:
        self._fd = os.memfd_create("jaxrl-weights", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        # Sealed against shrinking (it still grows): the server maps it, and a file truncated under a mapping
        # kills the reader with SIGBUS. The server refuses a file without this seal (`ShmReader`).
        try:
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        except OSError:  # the caller falls back to gRPC: the descriptor is not left open
            os.close(self._fd)
            raise
        # Closed when collected or at interpreter exit too (after a SIGKILL the kernel closes it).
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        self._map: mmap.mmap | None = None

    def _buffer(self, size: int) -> np.ndarray:
        if self._map is None or len(self._map) < size:
            if self._map is not None:
                self._map.close()
            os.ftruncate(self._fd, size)
            # MAP_POPULATE allocates every page in one call instead of one fault per 4 KiB page.
            self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return np.frombuffer(self._map, np.uint8, count=size)

    def write(self, tensors: Mapping[str, np.ndarray], version: int) -> rollout_pb2.ShmWeights:
        """Copy `tensors` (already of their wire dtype) into the file; the message that describes them."""
        msg = rollout_pb2.ShmWeights(version=version, pid=os.getpid(), fd=self._fd)
        offset, arrays = 0, []
        for name, arr in tensors.items():
            arr = little_endian(arr)
            msg.tensors.add(name=name, dtype=arr.dtype.name, shape=list(arr.shape), offset=offset)
            arrays.append((offset, arr))
            offset = _round_up(offset + arr.nbytes)
        msg.size = max(offset, ALIGN)
        buf = self._buffer(msg.size)
        for off, arr in arrays:
            np.copyto(buf[off : off + arr.nbytes].view(arr.dtype).reshape(arr.shape), arr, casting="no")
        msg.checksum = checksum(buf)
        return msg

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self._finalizer()


class ShmReader:
    """The server's side: maps the pushing trainer's file, keeping the mapping of the latest one for reuse.

    Mapping 50 MB costs ~15-20 ms of page-table set-up here, more than hashing it, so the mapping is kept
    while the same file (same inode, same size) comes back. Only the last file is kept: a trainer that
    exits or dies frees its memory once another trainer pushes or this server stops.
    """

    def __init__(self) -> None:
        self._key: tuple[int, int, int] | None = None
        self._map: mmap.mmap | None = None

    def read(self, msg: rollout_pb2.ShmWeights, specs: dict[str, TensorSpec], current_version: int
             ) -> dict[str, np.ndarray]:
        """Read-only views of the pushed tensors, hash and tensors verified; valid until the next `read`.

        Raises RequestError naming the field for anything `UpdateWeights` would refuse too, or `fd` when the
        descriptor is no regular file (a FIFO, a device: opened without blocking, never mapped), and OSError
        when the file cannot be opened (another host or user: the client falls back to gRPC).
        """
        if msg.version < 1:
            raise RequestError("version", f"target weight version must be >= 1, got {msg.version}")
        if msg.version < current_version:
            raise RequestError("version", f"target version {msg.version} is older than the version in service "
                               f"({current_version}); versions never go backwards")
        if msg.pid < 1:  # no process has it: a malformed request (INVALID_ARGUMENT), not an unreachable host
            raise RequestError("pid", f"must be a process id >= 1, got {msg.pid}")
        if msg.fd < 0:
            raise RequestError("fd", f"must be a file descriptor >= 0, got {msg.fd}")
        buf = np.frombuffer(self._mapping(msg), np.uint8, count=msg.size)
        got = checksum(buf)
        if got != msg.checksum:
            raise RequestError("checksum", f"xxh3-64 of the shared-memory buffer is {got:#x}, the trainer sent "
                               f"{msg.checksum:#x} (stale or overwritten buffer)")
        return _tensors(msg, buf, specs)

    def _mapping(self, msg: rollout_pb2.ShmWeights) -> mmap.mmap:
        path = f"/proc/{msg.pid}/fd/{msg.fd}"
        # O_NONBLOCK: the descriptor named may be a FIFO with no writer (or a device), whose blocking open would
        # never return while the caller holds the server's update lock; O_NOCTTY: nor may a terminal become ours.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a memfd is a regular file; a FIFO, socket or device cannot be mapped
                raise RequestError("fd", f"{path} is {mode_kind(st.st_mode)}, not a shared-memory file")
            if msg.size < 1 or msg.size > st.st_size:
                raise RequestError("size", f"{msg.size} bytes announced, the shared-memory file has {st.st_size}")
            try:
                sealed = bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
            except OSError:  # not a memfd (a file that takes no seals)
                sealed = False
            if not sealed:  # else the caller could truncate it under our mapping: SIGBUS, the server gone
                raise RequestError("fd", f"{path} is not a memfd sealed against shrinking (F_SEAL_SHRINK); the "
                                   "server maps it and a shrunk file would crash the reader")
            key = (st.st_dev, st.st_ino, st.st_size)
            if key != self._key:
                self.close()
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._map = mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ)
                self._key = key
        finally:
            os.close(fd)
        return self._map

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # an engine kept a view: unmapped when that view is collected
                pass
        self._map, self._key = None, None


def _tensors(msg: rollout_pb2.ShmWeights, buf: np.ndarray, specs: dict[str, TensorSpec]) -> dict[str, np.ndarray]:
    """The tensors `msg` lays out in `buf`, checked as a streamed push is (names, shapes, dtypes, finite)."""
    tensors: dict[str, np.ndarray] = {}
    for t in msg.tensors:
        spec = specs.get(t.name)
        if spec is None:
            raise RequestError(f"tensor {t.name!r}", "not a weight of this engine")
        if t.name in tensors:
            raise RequestError(f"tensor {t.name!r}", "sent twice")
        if tuple(t.shape) != tuple(spec.shape):
            raise RequestError(f"tensor {t.name!r}", f"shape {tuple(t.shape)} != expected {tuple(spec.shape)}")
        if t.dtype != spec.dtype:
            raise RequestError(f"tensor {t.name!r}", f"dtype {t.dtype!r} != expected {spec.dtype!r}")
        nbytes = tensor_nbytes(spec)
        if t.offset < 0 or t.offset % ALIGN or t.offset + nbytes > msg.size:
            raise RequestError(f"tensor {t.name!r}", f"offset {t.offset} (+{nbytes} bytes) is not an aligned "
                               f"range inside the {msg.size}-byte buffer")
        arr = tensor_from_bytes(buf[t.offset : t.offset + nbytes], spec)
        check_finite_tensor(t.name, arr)
        tensors[t.name] = arr
    missing = sorted(set(specs) - set(tensors))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise RequestError(f"tensor {missing[0]!r}", f"missing from the update: {missing[:5]}{more}")
    return tensors
