"""Multi-host JAX: one trainer process per host, the same loop on every process.

On a TPU pod or a multi-node GPU job every host runs `jaxrl-mismatch train`; `initialize` calls
`jax.distributed.initialize()` (which reads the cluster from the environment: TPU metadata, SLURM,
or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, the local cluster that
`LOCAL_PROCESSES=N launch/slurm_gpu.sh` starts on one machine; with JAX_PLATFORMS=cpu the processes'
CPU devices talk through gloo collectives). Process 0 talks to the rollout
server; the rollout batch is broadcast to every process, which then places its own shards. On one
host all of this reduces to plain calls.
"""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

import jax
import numpy as np

T = TypeVar("T")


def initialize(mode: str) -> bool:
    """`always`: initialise; `auto`: only when the environment describes a multi-process job; `never`."""
    if mode == "never":
        return False
    if mode == "auto":
        hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
        multi = (os.environ.get("JAX_COORDINATOR_ADDRESS") or int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) > 1
                 or "," in hosts or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))
        if not multi:
            return False
    kwargs = {}
    if os.environ.get("JAX_NUM_PROCESSES") and os.environ.get("JAX_PROCESS_ID"):
        # An explicit local cluster (launch/slurm_gpu.sh's local mode; JAX reads only the address itself).
        kwargs = dict(num_processes=int(os.environ["JAX_NUM_PROCESSES"]), process_id=int(os.environ["JAX_PROCESS_ID"]))
    elif (ids := slurm_local_device_ids(os.environ)) is not None:
        kwargs = dict(local_device_ids=ids)
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        # CPU devices of several processes need a cross-process collectives backend (XLA's default has none).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return True


def slurm_local_device_ids(env) -> list[int] | None:
    """Every GPU of the node for a SLURM job of one task per node (`launch/slurm_gpu.sh`), else None (JAX decides).

    Under SLURM, `jax.distributed.initialize` assumes one process per GPU and, unless told, gives each process
    only the GPU of its local rank (`local_device_ids=[SLURM_LOCALID]`): one task per node then trained on GPU 0
    alone (2 of 16 GPUs on 2 nodes × 8). The node's GPUs are those SLURM made visible (CUDA_VISIBLE_DEVICES, else
    SLURM_GPUS_ON_NODE), numbered 0.. within the process."""
    if "SLURM_JOB_ID" not in env or env.get("JAX_PLATFORMS", "").split(",")[0] in ("cpu", "tpu"):
        return None
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "").split("(")[0]
    if per_node != "1":
        return None
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    count = len(visible) or int(env.get("SLURM_GPUS_ON_NODE", "0") or 0)
    return list(range(count)) if count > 1 else None


def shutdown() -> None:
    """Leave the multi-process job in order, while every process is still whole: each one enters JAX's
    shutdown barrier, then the coordination service (process 0) stops. Otherwise only JAX's exit hook does
    this, at interpreter exit, after it has torn down the backends, and each process gets there on its own
    time (process 0 later: it writes the report); seen once in the two-process test as rank 0 aborting in the
    coordination service's shutdown after both ranks had checkpointed. The same teardown abort, with the same
    remedy (an explicit shutdown after the last checkpoint), is marin-community/marin#8392. Called from
    `jobs.train.main` on every path out of an initialised job; the exit hook then finds nothing to do."""
    jax.distributed.shutdown()


def to_host(x: jax.Array) -> np.ndarray:
    """The full value of a (possibly multi-host sharded) array on this host."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def any_process(flag: bool) -> bool:
    """Whether `flag` is set on any process: for a decision every process must take together, such as stopping
    between steps on a signal that reached only some of them (or reached them on either side of a step)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.array([int(bool(flag))], np.int32))).any())


def gather_params(params: Any) -> Any:
    """Params as host-complete arrays (weight push and HF export need every tensor whole)."""
    if jax.process_count() == 1:
        return params
    return jax.tree_util.tree_map(to_host, params)


_DTYPES = (np.int32, np.float32, np.uint8, np.uint16)  # uint: MoE routing (`models.moe.routing_dtype`)
_MAX_NDIM = 4  # the rollout's arrays: [B, S] tokens … [B, S, L, k] MoE routing


class LeadFailure(RuntimeError):
    """Process 0 failed in a step only it performs (rollout, push, eval); raised on every process so that
    all of them take the same error path (a collective checkpoint save) instead of deadlocking."""


def _broadcast_ok(ok: bool) -> bool:
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.broadcast_one_to_all(np.array([1 if ok else 0], np.int32)))[0])


def _lead_runs(is_lead: bool, fn: Callable[[], T], failure: str) -> T | None:
    """`fn()` on process 0 (None on the others), its success told to every process: a failure is re-raised on
    process 0 and raised as `LeadFailure(failure)` on the others, so all of them take the same error path."""
    out, error = None, None
    if is_lead:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below after telling the other processes
            error = e
    if not _broadcast_ok(error is None):
        if error is not None:
            raise error
        raise LeadFailure(failure)
    return out


def on_lead(is_lead: bool, fn: Callable[[], dict[str, float]], keys: tuple[str, ...]) -> dict[str, float]:
    """Run `fn` on process 0 only (it returns scalars named by `keys`) and give every process the same result.

    A failure on process 0 is re-raised there and raised as `LeadFailure` on the others. The scalars travel as
    float32 with a mask of the keys `fn` returned, and process 0 takes the broadcast values too: a controller
    reading them on every process must see the same value (process 0 had its float64, the others a float32 that
    could fall on the other side of a threshold, and a NaN it logged was dropped elsewhere).
    """
    if jax.process_count() == 1:
        return fn()
    from jax.experimental import multihost_utils

    out = _lead_runs(is_lead, fn, "process 0 failed (see its log)")
    present = [k in out for k in keys] if is_lead else [False] * len(keys)
    vec = np.array([[out[k] if p else 0.0 for k, p in zip(keys, present)] if is_lead else [0.0] * len(keys),
                    present], np.float32)
    vec = np.asarray(multihost_utils.broadcast_one_to_all(vec))
    return {k: float(v) for k, v, p in zip(keys, vec[0], vec[1]) if p}


def lead_first(is_lead: bool, fn: Callable[[], T]) -> T:
    """`fn()` on process 0 first, then (once it succeeded there) on the others: for work that writes files every
    process then reads, such as a task's dataset build, which processes racing on a shared filesystem fail.
    A failure on process 0 is re-raised there and raised as `LeadFailure` on the others, which do not run `fn`."""
    if jax.process_count() == 1:
        return fn()
    out = _lead_runs(is_lead, fn, "process 0 failed (see its log)")
    return out if is_lead else fn()


def _header(arrays: dict[str, np.ndarray], keys: tuple[str, ...]) -> np.ndarray:
    """Each array's dtype code, ndim and shape (0-padded), in `keys` order; ValueError (KeyError) for an array that
    cannot travel. Checked inside the lead's reported work: raised after it, the other processes waited forever."""
    header = np.zeros((len(keys), 2 + _MAX_NDIM), np.int32)
    for i, k in enumerate(keys):
        a = np.asarray(arrays[k])
        if not 1 <= a.ndim <= _MAX_NDIM or a.dtype.type not in _DTYPES:
            raise ValueError(f"rollout array {k!r}: need a 1- to {_MAX_NDIM}-d int32/float32/uint8/uint16 array, "
                             f"got {a.dtype}{a.shape}")
        header[i, :2 + a.ndim] = (_DTYPES.index(a.dtype.type), a.ndim, *a.shape)
    return header


def lead_computes(is_lead: bool, fn: Callable[[], tuple[dict[str, np.ndarray], dict[str, float]]],
                  keys: tuple[str, ...], stat_keys: tuple[str, ...]):
    """Run `fn` (the rollout) on process 0 and broadcast its (arrays, scalars) result to every process.

    `keys` / `stat_keys` fix the order on every process (the trainer passes `batch.rollout_fields(...)`).
    Shapes change from step to step (bucketed lengths), so a header of each array's dtype and shape is
    broadcast first (`broadcast_one_to_all` needs identically shaped inputs on all processes); the arrays
    then travel as they are (int32/float32, up to 4-d). A failure on process 0 reaches every process.
    """
    if jax.process_count() == 1:
        return fn()
    from jax.experimental import multihost_utils

    def produce():  # the arrays' checks belong to the lead's work: a failure there reaches every process too
        arrays, stats = fn()
        return arrays, stats, _header(arrays, keys)

    arrays, stats, header = _lead_runs(is_lead, produce, "process 0 failed to produce the rollout batch (see its "
                                       "log)") or ({}, {}, np.zeros((len(keys), 2 + _MAX_NDIM), np.int32))
    header = np.asarray(multihost_utils.broadcast_one_to_all(header))
    out = {}
    for i, k in enumerate(keys):
        code, ndim = int(header[i, 0]), int(header[i, 1])
        shape = tuple(int(d) for d in header[i, 2:2 + ndim])
        local = np.asarray(arrays[k]) if is_lead else np.zeros(shape, _DTYPES[code])
        out[k] = np.asarray(multihost_utils.broadcast_one_to_all(local))
    vec = np.array([stats.get(k, np.nan) for k in stat_keys] if is_lead else [0.0] * len(stat_keys), np.float32)
    vec = np.asarray(multihost_utils.broadcast_one_to_all(vec))
    return out, {k: float(v) for k, v in zip(stat_keys, vec)}
