"""Checkpointing: the train state plus the host-side run state, saved asynchronously with orbax.

One checkpoint step is a directory `<directory>/<step>/` holding three orbax items:

- `state`:  the train-state pytree (params, Optax state incl. `inject_hyperparams` hyperparameters,
            loss-scale state, step, rng; typed PRNG keys or raw uint32 key data) as sharded arrays;
- `meta`:   a JSON dict from the caller: controller states, data-iterator position, rollout weight
            version, the resolved config (`ConfigDict.to_dict()`), anything else;
- `layout`: written by us: every state leaf's path, shape and dtype. `restore` compares it with the
            requested abstract state *before* touching any array, so a checkpoint of another model
            (other hidden size, vocab, optimizer) fails with an error naming the tensor and both
            shapes instead of an opaque tensorstore error deep inside orbax.

**Restoring onto another mesh.** `restore` takes an abstract state (`jax.ShapeDtypeStruct`s carrying
the *target* shardings); orbax reads each array's chunks straight into those shardings, so a state
saved on `fsdp=8` restores onto `data=2 × fsdp=4` or onto one device.

**Atomicity (orbax-checkpoint 0.12.8, read from `orbax/checkpoint/_src/path/atomicity.py`,
`temporary_paths.py`, `step.py`).** On a local/POSIX filesystem orbax writes a step into
`<step>.orbax-checkpoint-tmp/`, writes `commit_success.txt` into it last and only then renames it to
`<step>/` (`AtomicRenameTemporaryPath.finalize`). Step discovery accepts only names matching
`^(0|[1-9]\\d*)$`, so a crash mid-save leaves a `*.orbax-checkpoint-tmp*` directory that is never
listed (we also let orbax delete such leftovers when a `Checkpointer` is opened). In the rename mode
orbax itself does not look for `commit_success.txt` in a step directory; on a filesystem whose rename
is not atomic, or after an interrupted copy of a checkpoint tree, a `<step>/` directory can exist
without it. We therefore require the marker too: a step directory without `commit_success.txt` is
moved aside to `<step>.uncommitted-<ns>` when a `Checkpointer` is opened (kept for inspection, never
listed, never restored), so `latest_step()` falls back to the previous complete checkpoint and a
re-save of that step is not silently skipped. The rename mode is pinned explicitly: orbax's AUTO mode
switches to writing in place on GCS, where its tmp-directory cleanup deletes *any* child directory
lacking the marker.

**Async saves and donation.** `save` returns once the device arrays have been copied to host memory;
the file writes continue in a background thread. The caller may then donate or overwrite the live
state (the next jitted update step does) without affecting what is written. The next `save`, any
`restore`, `wait()` and `close()` wait for the write in flight.

**Faults.** A save that fails in the background (read-only directory, disk full, I/O error) is raised by
the next `wait()` as `CheckpointSaveError`, one line naming the step directory and the OS cause; the
trainer waits right after each save, so a failure stops the run before the next step, and the previous
checkpoint is untouched (orbax only renames a finished `<step>.orbax-checkpoint-tmp`). A step whose files
cannot be read back raises `CheckpointDamagedError`; `set_aside(step)` renames such a step to
`<step>.damaged-<ns>` (never deleted) so the previous one becomes the latest. A garbled data file that
still decodes is caught too: the layout record holds a fingerprint of every tensor
(`state_fingerprints`, a position-weighted integer sum of its bits), compared after each restore. orbax logs the tracebacks
of its failing background threads at ERROR through absl; those records are dropped here because every
one of them reaches the caller as one of these exceptions.

Single-controller (one process) is the tested setting; with several processes every process must
call `save`/`restore` (orbax synchronises them); only process 0 moves uncommitted directories aside,
behind a barrier.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import options as ocp_options

from jaxrl_mismatch.models.sharding import tree_path
from jaxrl_mismatch.usage import EnvironmentFailure

log = logging.getLogger(__name__)
T = TypeVar("T")

# Written last into a step directory by orbax's finalize, in both atomicity modes (orbax 0.12.8).
COMMIT_MARKER = "commit_success.txt"
_LAYOUT_FORMAT = 1
_MAX_LISTED = 20  # mismatches listed in one error message


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or written (missing, incomplete, corrupt or conflicting)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint exists at the requested directory or step."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint's tensors do not match the requested abstract state (another model or optimizer)."""


class CheckpointDamagedError(CheckpointError, EnvironmentFailure):
    """A complete-looking checkpoint whose files cannot be read (truncated, deleted, garbled)."""


def require_meta(meta: Any, where: str, fields: dict[str, type | tuple[type, ...]]) -> dict:
    """`meta` if it is a dict holding each of `fields` with its type; else CheckpointDamagedError naming `where` and
    the field, so a damaged newest checkpoint is set aside like one whose arrays cannot be read."""
    if not isinstance(meta, dict):
        raise CheckpointDamagedError(f"{where}: its meta is not a JSON object")
    for name, kind in fields.items():
        if name not in meta:
            raise CheckpointDamagedError(f"{where}: its meta has no {name!r}")
        if not isinstance(meta[name], kind) or isinstance(meta[name], bool):
            raise CheckpointDamagedError(f"{where}: its meta's {name!r} is {type(meta[name]).__name__} "
                                         f"{str(meta[name])[:60]!r}")
    return meta


class CheckpointSaveError(CheckpointError, EnvironmentFailure):
    """Writing a checkpoint failed (permissions, read-only or full filesystem, I/O error)."""


def describe_failure(e: BaseException, limit: int = 300) -> str:
    """One line saying why an orbax/tensorstore/OS call failed: the OS error when one is named
    (`File too large (errno 27)`), else the exception's first words; never a multi-line dump."""
    text = " ".join(str(e).split())
    if "See full TensorStore details" in text and e.__cause__ is not None:  # orbax's wrapper: the cause says more
        return describe_failure(e.__cause__, limit)
    code = re.search(r"os_error_code='?(\d+)", text)
    if isinstance(e, OSError) and e.errno:
        return f"{e.strerror or os.strerror(e.errno)} (errno {e.errno}" + (f", {e.filename})" if e.filename else ")")
    if code:
        n = int(code.group(1))
        return f"{os.strerror(n)} ({errno.errorcode.get(n, n)})"
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _DropOrbaxErrors(logging.Filter):
    """Drop orbax's own ERROR records (tracebacks of its background threads): each failure reaches the
    caller as a `CheckpointError` with one line, and a failing save would otherwise print dozens."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


_ORBAX_FILTER = _DropOrbaxErrors()


def _runs_through_orbax(tb, *described: object) -> bool:
    """Whether a traceback passes through orbax's code, or one of `described` (the failed object, a log
    message) names an orbax coroutine."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    where = " ".join(frames) + " " + " ".join(map(str, described))
    return f"{os.sep}orbax{os.sep}" in where or "_read_array_index_and_device_put" in where


class _DropAbandonedOrbaxTasks(logging.Filter):
    """Drop asyncio's "Task exception was never retrieved" records for orbax's reads: when one array of a
    damaged checkpoint fails to restore, orbax gives up on the reads of the other arrays, and each of those
    failed tasks is logged with its traceback whenever it is garbage-collected (seen in a `train` that set a
    damaged step aside: a traceback after the one warning line), and so is each of tensorstore's futures
    those tasks awaited (its error names the `tensorstore_spec`; tensorstore is only used through orbax here).
    The failure is already reported as one `CheckpointDamagedError`; asyncio records about anything else pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[1] is None:
            return True
        _, exc, tb = record.exc_info
        return not (_runs_through_orbax(tb, record.getMessage()) or "tensorstore_spec" in str(exc))


_ASYNCIO_FILTER = _DropAbandonedOrbaxTasks()


def _quiet_closed_loop_hook(previous):
    """sys.excepthook that drops `RuntimeError: Event loop is closed`: after a failed save, tensorstore
    completes its pending writes into the asyncio loop orbax already closed, and each callback's error
    is printed through this hook (dozens of tracebacks after the one-line error). Nothing else changes."""

    def hook(exc_type, exc, tb):
        if exc_type is RuntimeError and str(exc) == "Event loop is closed":
            return
        previous(exc_type, exc, tb)

    hook.jaxrl_quiet = True
    return hook


def _quiet_orbax_unraisable_hook(previous):
    """sys.unraisablehook that drops orbax's abandoned read coroutines: after a damaged checkpoint fails to
    restore (reported as one warning, and set aside), the coroutines still reading its other shards are
    garbage-collected later and Python prints each one's traceback ("Exception ignored in: <coroutine object
    _read_array_index_and_device_put ...>"); after a failed save, tensorstore's late callbacks into orbax's
    closed asyncio loop end here too ("Event loop is closed"). Anything else goes to the previous hook."""

    def hook(unraisable):
        if _runs_through_orbax(unraisable.exc_traceback, repr(unraisable.object)):
            return
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":  # as _quiet_closed_loop_hook
            return
        previous(unraisable)

    hook.jaxrl_quiet = True
    return hook


def state_layout(tree: Any) -> dict[str, dict[str, Any]]:
    """{leaf path: {"shape": [...], "dtype": "float32"}} for every leaf of a state or abstract state.

    Typed PRNG keys keep their key dtype (e.g. `key<fry>`), so a typed key is never confused with raw
    uint32 key data of another shape.
    """
    layout: dict[str, dict[str, Any]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = tree_path(path, keep_value=True)
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"state leaf {name!r} is of type {type(leaf).__name__}, not an array; keep every leaf of the "
                "checkpointed state a jax/numpy array (e.g. jnp.int32(step)) so its shape, dtype and "
                "sharding are defined"
            )
        layout[name] = {"shape": [int(d) for d in leaf.shape], "dtype": str(leaf.dtype)}
    return layout


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    """A position-weighted uint32 sum of the leaf's bits: Σ_i bits_i·(2i+1) mod 2^32. Integer addition is
    exact in any order, so the value does not depend on the sharding or the reduction order; any single
    changed word (a garbled byte of a data file that still decodes) changes it."""
    import jax.numpy as jnp

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize in (1, 2):
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
    else:  # 4 bytes, or 8 bytes as two uint32 words (a trailing axis)
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(bits.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    return jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


@jax.jit
def _fingerprints_jit(tree: Any) -> Any:
    return jax.tree_util.tree_map(_leaf_fingerprint, tree)


def state_fingerprints(state: Any) -> dict[str, int]:
    """{leaf path: uint32 fingerprint} of a live state, stored in the layout record at save and checked
    after a restore: tensorstore reads a data file with garbled bytes without complaint when it still
    decodes, and this catches it. One jitted pass over the state (cheap next to writing it)."""
    values = jax.device_get(_fingerprints_jit(state))
    return {tree_path(p, keep_value=True): int(v) for p, v in jax.tree_util.tree_flatten_with_path(values)[0]}


def _layout_mismatches(saved: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    problems = []
    for name, want in wanted.items():
        have = saved.get(name)
        if have is None:
            problems.append(f"{name}: missing from the checkpoint (requested {_fmt(want)})")
        elif list(have["shape"]) != list(want["shape"]) or have["dtype"] != want["dtype"]:
            problems.append(f"{name}: checkpoint has {_fmt(have)}, requested {_fmt(want)}")
    for name, have in saved.items():
        if name not in wanted:
            problems.append(f"{name}: in the checkpoint ({_fmt(have)}) but not in the requested state")
    return problems


def _fmt(entry: Mapping[str, Any]) -> str:
    return f"shape {tuple(entry['shape'])} {entry['dtype']}"


def _check_json(value: Any, where: str = "meta") -> None:
    """Fail in the caller's thread, naming the offending key; orbax would fail later in a background write.

    Python's JSON dialect is what orbax writes: NaN/Infinity floats round-trip (a controller's
    not-yet-known baseline may be NaN); tuples come back as lists.
    """
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; JSON object keys must be str")
            _check_json(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]")
    elif not (value is None or isinstance(value, (str, bool, int, float))):
        raise TypeError(
            f"{where} is of type {type(value).__name__}, not JSON (convert numpy/jax scalars with float()/int(), "
            "ConfigDicts with .to_dict())"
        )


class Checkpointer:
    """Async, keep-last-N, mesh-independent checkpoints of (train state, JSON meta) over orbax.

    Args:
      directory: root directory; created if absent. Steps live in `<directory>/<step>/`.
      max_to_keep: keep the newest N complete checkpoints (None keeps all).
      async_save: write in a background thread (`save` returns after the device→host copy).
      save_interval_steps: `save` only writes when `step % save_interval_steps == 0` (or `force=True`).
      tidy: move uncommitted steps aside and let orbax delete its leftover temporaries when opening. A
        reader that may run beside a trainer (export) passes False and changes nothing.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        save_interval_steps: int = 1,
        tidy: bool = True,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        self._interval = save_interval_steps
        absl_log = logging.getLogger("absl")
        if _ORBAX_FILTER not in absl_log.filters:
            absl_log.addFilter(_ORBAX_FILTER)
        asyncio_log = logging.getLogger("asyncio")
        if _ASYNCIO_FILTER not in asyncio_log.filters:
            asyncio_log.addFilter(_ASYNCIO_FILTER)
            # The same abandoned reads leave one orbax coroutine never awaited; Python warns when it is collected.
            warnings.filterwarnings("ignore", message=r"coroutine 'Store\._get_array_metadatas' was never awaited",
                                    category=RuntimeWarning)
        if not getattr(sys.excepthook, "jaxrl_quiet", False):
            sys.excepthook = _quiet_closed_loop_hook(sys.excepthook)
        if not getattr(sys.unraisablehook, "jaxrl_quiet", False):
            sys.unraisablehook = _quiet_orbax_unraisable_hook(sys.unraisablehook)
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint directory {self.directory} exists and is not a directory")
        if jax.process_index() == 0 and tidy:
            self._set_aside_uncommitted()
        if jax.process_count() > 1:  # no process may list steps before process 0 has moved them
            multihost_utils.sync_global_devices(f"jaxrl_mismatch.Checkpointer:{self.directory}")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=tidy,
            atomicity_options=ocp_options.AtomicityOptions(mode=ocp_options.AtomicityMode.ATOMIC_RENAME),
        )
        self._saving: int | None = None  # the step of a save in flight
        try:
            self._mgr = ocp.CheckpointManager(
                self.directory, item_names=("state", "meta", "layout"), options=options
            )
        except OSError as e:
            raise CheckpointSaveError(f"checkpoint directory {self.directory}: {describe_failure(e)}") from e

    def _set_aside_uncommitted(self) -> None:
        """Move `<step>/` directories lacking the commit marker out of orbax's sight (see module doc)."""
        if not os.path.isdir(self.directory):
            return
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name.isdigit() and os.path.isdir(path) and not os.path.exists(os.path.join(path, COMMIT_MARKER)):
                aside = f"{path}.uncommitted-{time.time_ns()}"
                log.warning("checkpoint %s has no %s (incomplete save); moved to %s", path, COMMIT_MARKER, aside)
                os.rename(path, aside)

    # ---- queries -----------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Complete checkpoint steps, ascending, plus a save of this process still being written."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        """The newest step from `all_steps()`, or None when the directory holds no checkpoint."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ---- save --------------------------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: Mapping[str, Any], *, force: bool = False) -> bool:
        """Start saving `state` and `meta` as checkpoint `step`; True if a save was started.

        Returns False (writing nothing) when `step` is off the `save_interval_steps` grid and not
        `force`d, or when `step` is already saved (a resumed run re-reaching its restore step).
        Raises `CheckpointError` for a step *older* than the newest saved one: orbax would skip it
        silently, mixing two trajectories in one directory; resume from the latest step or use a
        fresh directory.
        """
        step = int(step)
        if not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        _check_json(meta)
        layout = {"format": _LAYOUT_FORMAT, "leaves": state_layout(state)}
        # Decided here rather than by orbax alone: orbax also saves the first step of an empty
        # directory whatever its number, which would make the grid depend on the run's history.
        # A JAX preemption notice still forces a save, as orbax's own policy does.
        if not force and step % self._interval != 0 and not self._mgr.reached_preemption(step):
            return False
        existing = self.all_steps()
        if step in existing:
            log.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
            return False
        if existing and step < existing[-1]:
            raise CheckpointError(
                f"cannot save step {step}: {self.directory} already holds the newer step {existing[-1]} "
                f"(steps {existing}); resume from the latest step or use a fresh directory"
            )
        layout["fingerprints"] = state_fingerprints(state)
        self._saving = step
        try:
            return bool(
                self._mgr.save(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state),
                        meta=ocp.args.JsonSave(dict(meta)),
                        layout=ocp.args.JsonSave(layout),
                    ),
                    force=force,
                )
            )
        except Exception as e:  # the synchronous part (directory creation, metadata) failed
            raise self._save_error(step, e) from e

    def _save_error(self, step: int, e: BaseException) -> CheckpointSaveError:
        self._saving = None
        previous = [s for s in self.all_steps_on_disk() if s != step]
        kept = f"the previous checkpoint (step {previous[-1]}) is intact" if previous else "no earlier checkpoint exists"
        return CheckpointSaveError(f"checkpoint {os.path.join(self.directory, str(step))}: saving failed: "
                                   f"{describe_failure(e)}; {kept}")

    def all_steps_on_disk(self) -> list[int]:
        """Committed step directories as they are on disk now (not orbax's cached list)."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(int(n) for n in os.listdir(self.directory)
                      if re.fullmatch(r"0|[1-9]\d*", n) and os.path.exists(os.path.join(self.directory, n, COMMIT_MARKER)))

    # ---- restore -----------------------------------------------------------------------------------

    def _resolve_step(self, step: int | None) -> int:
        self._mgr.wait_until_finished()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(f"no complete checkpoint in {self.directory}")
            step = steps[-1]
        step = int(step)
        if step not in steps:
            raise CheckpointNotFoundError(
                f"no complete checkpoint for step {step} in {self.directory}; available steps: {steps}"
            )
        step_dir = os.path.join(self.directory, str(step))
        if not os.path.exists(os.path.join(step_dir, COMMIT_MARKER)):
            raise CheckpointDamagedError(f"checkpoint {step_dir} has no {COMMIT_MARKER}: it is incomplete or was removed")
        return step

    def _read_json_item(self, step: int, item: str) -> dict:
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
        except Exception as e:  # orbax raises assorted types for missing/corrupt files
            raise CheckpointDamagedError(
                f"checkpoint {os.path.join(self.directory, str(step))}: cannot read its {item!r} record "
                f"({describe_failure(e)})"
            ) from e
        value = out[item]
        if not isinstance(value, dict):
            raise CheckpointDamagedError(
                f"checkpoint {os.path.join(self.directory, str(step))}: its {item!r} record is missing "
                "(not written by this Checkpointer?)"
            )
        return value

    def read_meta(self, step: int | None = None) -> dict:
        """Only the JSON meta of `step` (default latest): e.g. the resolved config needed to build the
        model, and hence the abstract state, before calling `restore`."""
        return self._read_json_item(self._resolve_step(step), "meta")

    def restore(self, step: int | None = None, *, abstract_state: Any) -> tuple[Any, dict]:
        """(state, meta) of checkpoint `step` (default: the latest complete one).

        abstract_state: the pytree to restore into, each leaf a `jax.ShapeDtypeStruct` (or array) with
        the *target* sharding, e.g. `jax.eval_shape(init)` with shardings attached, or
        `train.state.abstract_state_of(fresh_state)`. Its structure, shapes and dtypes must equal the saved ones;
        any difference raises `CheckpointMismatchError` listing each tensor path with both shapes.
        """
        step = self._resolve_step(step)
        step_dir = os.path.join(self.directory, str(step))
        wanted = state_layout(abstract_state)
        unsharded = [
            tree_path(p, keep_value=True)
            for p, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
            if getattr(leaf, "sharding", None) is None
        ]
        if unsharded:
            raise ValueError(
                "abstract_state leaves need target shardings (jax.ShapeDtypeStruct(shape, dtype, "
                f"sharding=...)); these have none: {', '.join(unsharded[:_MAX_LISTED])}"
            )
        layout = self._read_json_item(step, "layout")
        if layout.get("format") != _LAYOUT_FORMAT or not isinstance(layout.get("leaves"), dict):
            raise CheckpointDamagedError(f"checkpoint {step_dir}: unrecognised layout record {str(layout)[:200]}")
        for name, leaf in layout["leaves"].items():  # an entry that parses but is not one (a KeyError before)
            ok = isinstance(leaf, dict) and isinstance(leaf.get("shape"), list) and isinstance(leaf.get("dtype"), str)
            if not ok:
                raise CheckpointDamagedError(f"checkpoint {step_dir}: its layout record's entry {name!r} is "
                                             f"{str(leaf)[:100]}, not a shape and a dtype")
        problems = _layout_mismatches(layout["leaves"], wanted)
        if problems:
            more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
            raise CheckpointMismatchError(
                f"checkpoint {step_dir} does not match the requested state "
                f"({len(problems)} difference(s); another model or optimizer config?):\n  "
                + "\n  ".join(problems[:_MAX_LISTED])
                + more
            )
        try:
            out = self._mgr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # tensorstore/orbax errors for missing or damaged array files
            raise CheckpointDamagedError(
                f"checkpoint {step_dir} could not be restored; its files are damaged or incomplete "
                f"({describe_failure(e)})"
            ) from e
        saved = layout.get("fingerprints")
        if isinstance(saved, dict):  # checkpoints written before fingerprints were recorded have none
            got = state_fingerprints(out["state"])
            bad = [name for name, value in got.items() if saved.get(name) != value]
            if bad:
                raise CheckpointDamagedError(
                    f"checkpoint {step_dir} could not be restored; its files are damaged: {len(bad)} tensor(s) "
                    f"read back with other contents than were saved ({', '.join(bad[:3])}"
                    + (", ..." if len(bad) > 3 else "") + ")")
        return out["state"], out["meta"]

    # ---- lifetime ----------------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed on disk; `CheckpointSaveError` (one line
        naming the step directory and the cause) if it failed."""
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # a failed background write: permissions, disk full, I/O error
            raise self._save_error(self._saving if self._saving is not None else -1, e) from e
        self._saving = None

    def set_aside(self, step: int, reason: str) -> str:
        """Rename damaged checkpoint `step` to `<step>.damaged-<ns>` (kept for inspection, never deleted)
        so that the previous step becomes the latest; returns the new path. `reason` (naming the step
        directory and the cause) starts the one warning line."""
        path = os.path.join(self.directory, str(int(step)))
        aside = f"{path}.damaged-{time.time_ns()}"
        os.rename(path, aside)
        self._mgr.reload()
        log.warning("%s; moved it to %s (kept), falling back to the previous checkpoint", " ".join(reason.split()),
                    os.path.basename(aside))
        return aside

    def newest_good(self, attempt: Callable[[int], T]) -> tuple[int, T] | None:
        """(step, attempt(step)) for the newest step that `attempt` (a restore) can read. A step raising
        `CheckpointDamagedError` is set aside (`set_aside`, one warning line) and the next older step is
        tried. None when the directory holds no checkpoint at all; `CheckpointDamagedError` when every
        one was damaged (all are kept, renamed)."""
        damaged = []
        while (step := self.latest_step()) is not None:
            try:
                return step, attempt(step)
            except CheckpointDamagedError as e:
                damaged.append(self.set_aside(step, str(e)))
        if damaged:
            raise CheckpointDamagedError(f"{self.directory}: no checkpoint can be restored; the damaged ones were "
                                         f"moved aside ({', '.join(os.path.basename(d) for d in damaged)}); "
                                         "use a new run_dir or restore them from a backup")
        return None

    def close(self) -> None:
        """Finish the save in flight and release orbax's threads; call before the process exits. A failed
        save in flight is not raised again here (`wait` reports it); the threads are released either way."""
        try:
            self._mgr.wait_until_finished()
        except Exception:  # noqa: BLE001 - already reported by wait(), or the process is ending on another error
            pass
        finally:
            self._mgr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


__all__ = [
    "COMMIT_MARKER",
    "Checkpointer",
    "CheckpointDamagedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CheckpointNotFoundError",
    "describe_failure",
    "require_meta",
    "state_layout",
]
