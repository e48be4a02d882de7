"""Device mesh and parameter sharding rules (FSDP on ``fsdp``, Megatron-style tensor parallel on ``tensor``).

Sharding is declared here, by a regex table over the parameter paths fixed in ``docs/contracts.md``,
and nowhere in the model code (the big_vision way): the model stays a plain single-device module and
the same rules serve checkpoint loading (``hf_io``), the jitted train step and the rollout engine.

Mesh axes, always ``data``, ``fsdp``, ``tensor`` and, when the mesh config names it, ``expert`` (before
``tensor``), in this order:

- ``data``: pure data parallelism; parameters are replicated over it.
- ``fsdp``: parameters *and* the batch are split over it (ZeRO-3 style); XLA all-gathers a weight
  just before its matmul and reduce-scatters its gradient.
- ``expert``: expert parallelism for mixture-of-experts layers (``models/moe.py``). Expert weights
  ``[E, ...]`` are split over it on E; everything else is replicated over it and the batch is split over
  it, so outside the expert FFN it acts as a data axis. A rule naming ``expert`` on a mesh without the axis
  is read as replicated.
- ``tensor``: Megatron tensor parallelism. Column-parallel kernels (q/k/v/gate/up, ``[in, out]``)
  split their output features, row-parallel kernels (o/down) split their input features, so an
  attention or MLP block needs a single all-reduce at its output.

Rule of thumb for the specs below: the ``tensor`` axis sits on the "feature" dimension that the
Megatron split wants, and ``fsdp`` takes the other dimension so that every weight matrix is split
over both axes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")
OPTIONAL_AXES: tuple[str, ...] = ("expert",)  # present only when the mesh config names them
_AXIS_ORDER: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")

# One entry per tensor dimension (spelled out in full, see DESIGN.md "Sharding"). Paths are the
# "/"-joined keys of `nnx.state(model, nnx.Param)`; `\d+` is the layer index.
_LAYER = r"layers/\d+/"
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    # [V, D]: vocab over `tensor` (vocab-parallel embedding), model dim over `fsdp`.
    (r"embed/embedding", ("tensor", "fsdp")),
    # Column-parallel [D, out]: each tensor shard owns whole heads / a slice of the MLP features.
    (_LAYER + r"attn/(q|k|v)_proj/kernel", ("fsdp", "tensor")),
    (_LAYER + r"mlp/(gate|up)_proj/kernel", ("fsdp", "tensor")),
    # Qwen2 q/k/v biases live on the column-parallel output features, so they follow `tensor`.
    (_LAYER + r"attn/(q|k|v)_proj/bias", ("tensor",)),
    # Row-parallel [in, D]: consumes the tensor-sharded activations; output needs one all-reduce.
    (_LAYER + r"attn/o_proj/kernel", ("tensor", "fsdp")),
    (_LAYER + r"mlp/down_proj/kernel", ("tensor", "fsdp")),
    # Norm scales are tiny ([D] or [head_dim]); replicating them avoids a gather per layer.
    (_LAYER + r"(input_norm|post_attn_norm)/scale", (None,)),
    (_LAYER + r"attn/(q_norm|k_norm)/scale", (None,)),
    (r"final_norm/scale", (None,)),
    # [D, V]: vocab-parallel LM head; logits come out sharded over `tensor` on the vocab axis.
    (r"lm_head/kernel", ("fsdp", "tensor")),
    # Mixture of experts: the router [D, E] is small (every device routes its own tokens); expert weights
    # [E, D, F] / [E, F, D] split E over `expert` and are column / row parallel inside each expert.
    (_LAYER + r"mlp/router/kernel", ("fsdp", None)),
    (_LAYER + r"mlp/experts/(gate|up)_proj", ("expert", "fsdp", "tensor")),
    (_LAYER + r"mlp/experts/down_proj", ("expert", "tensor", "fsdp")),
)
_COMPILED_RULES = tuple((re.compile(pattern), spec) for pattern, spec in PARAM_RULES)
# Scanned layers (`Transformer(scan_layers=True)`): one stacked leaf per block parameter, path without the
# layer index (`layers/attn/q_proj/kernel`, shape `[L, D, H*hd]`).
_STACKED = re.compile(r"layers/(\D.*)")


def stacked_layer_param(path: str) -> str | None:
    """For a stacked (scanned-layers) parameter path, the in-block part (`attn/q_proj/kernel`); else None."""
    m = _STACKED.fullmatch(path)
    return m.group(1) if m else None


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a ``Mesh`` with axes ``("data", "fsdp", "tensor")`` from sizes such as ``{"data": -1}``, or
    ``("data", "fsdp", "expert", "tensor")`` when ``axes`` names ``expert``.

    Axes left out have size 1 (``expert`` is then absent), so every ``PartitionSpec`` in this module is
    valid on every mesh (``param_partition_spec`` reads ``expert`` on a mesh without it as replicated).
    Exactly one size may be ``-1``, meaning "all devices not used by the other axes". The product of
    the sizes must equal the number of devices: silently using a subset would leave accelerators idle
    and make the global batch size differ from what the config says.

    The mesh is built with ``jax.sharding.Mesh`` directly so that its axes are *Auto* (sharding
    propagated by XLA from the jit in/out shardings); ``jax.make_mesh`` would make *Explicit* axes,
    which change typing rules of every op (on jax 0.10.2, jitting ``opt.init`` then needs
    ``jax.set_mesh`` and indexing a sharded array raises ``ShardingTypeError``);
    ``tests/models/test_sharding.py`` pins the Auto axes.

    Raises:
        ValueError: naming the config and the device count, for an unknown axis, a size that is not a
            positive integer or -1, more than one -1, or a product that does not match the devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    n_devices = len(devices)
    config = dict(axes)
    unknown = sorted(set(config) - set(MESH_AXES) - set(OPTIONAL_AXES))
    if unknown:
        raise ValueError(f"mesh config {config}: unknown axis {unknown}; valid axes are {_AXIS_ORDER}")
    names = tuple(a for a in _AXIS_ORDER if a in MESH_AXES or a in config)
    sizes = {name: config.get(name, 1) for name in names}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
            raise ValueError(f"mesh config {config}: axis {name!r} has size {size!r}; use a positive int or -1")
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ValueError(f"mesh config {config}: only one axis may be -1, got {rest}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if rest:
        if n_devices % fixed:
            raise ValueError(
                f"mesh config {config}: the fixed axes use {fixed} devices, which does not divide "
                f"the {n_devices} available devices, so {rest[0]!r}=-1 has no integer size"
            )
        sizes[rest[0]] = n_devices // fixed
    shape = tuple(int(sizes[name]) for name in names)
    if math.prod(shape) != n_devices:
        raise ValueError(
            f"mesh config {config} needs {math.prod(shape)} devices (shape {dict(zip(names, shape))}) "
            f"but {n_devices} devices are available"
        )
    try:
        # Topology-aware placement on TPU/GPU (neighbouring devices on the innermost axes).
        device_array = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        # An explicit device subset that the topology helper cannot lay out: keep the given order.
        device_array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_array, names)


def param_partition_spec(path: str, shape: Sequence[int], mesh: Mesh | None = None) -> P:
    """The ``PartitionSpec`` of the parameter at ``path`` (e.g. ``"layers/3/attn/q_proj/kernel"``).

    The first rule of ``PARAM_RULES`` that matches the whole path wins. A stacked parameter of the
    scanned-layers layout (``layers/attn/q_proj/kernel``, leading layer axis) gets ``None`` on the layer
    axis followed by the spec of its per-layer path. With a ``mesh``, a mesh axis
    whose size does not divide the dimension it would shard is dropped for that dimension (``None``,
    i.e. replicated along it): e.g. a 151,936-row Qwen embedding on ``tensor=3``, or 2 KV heads ×
    head_dim on a large ``tensor`` axis. jit would otherwise reject the sharding; replicating one
    dimension costs memory, never correctness. Without a mesh the rule's spec is returned as is.

    Raises:
        ValueError: if no rule matches ``path`` (every parameter must be placed deliberately), or the
            rule's rank differs from ``len(shape)``.
    """
    shape = tuple(int(d) for d in shape)
    inner = stacked_layer_param(path)
    if inner is not None:
        # The layer axis stays whole on every device (a scan step reads one layer); the rest follows the rule
        # of the per-layer parameter.
        if not shape:
            raise ValueError(f"stacked parameter {path!r} has no layer axis (shape {shape})")
        return P(None, *param_partition_spec(f"layers/0/{inner}", shape[1:], mesh))
    for pattern, spec in _COMPILED_RULES:
        if pattern.fullmatch(path):
            break
    else:
        raise ValueError(
            f"no sharding rule matches parameter {path!r} (shape {shape}); add one to "
            "jaxrl_mismatch/models/sharding.py PARAM_RULES"
        )
    if len(spec) != len(shape):
        raise ValueError(
            f"sharding rule {pattern.pattern!r} has {len(spec)} entries {spec} but parameter {path!r} "
            f"has shape {shape} ({len(shape)} dims)"
        )
    if mesh is None:
        return P(*spec)
    resolved = []
    for axis, dim in zip(spec, shape):
        if axis is not None and (axis not in mesh.shape or dim % mesh.shape[axis] != 0):
            axis = None
        resolved.append(axis)
    return P(*resolved)


def _key_name(key: Any, keep_value: bool) -> str | None:
    """One path component; ``None`` for the ``.value`` attribute that wraps an nnx Variable's array."""
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return None if key.name == "value" and not keep_value else key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def tree_path(keys: Sequence[Any], *, keep_value: bool = False) -> str:
    """``"/"``-joined path of a ``jax.tree_util`` key path: the one leaf naming of the package.

    By default the parameter path of ``docs/contracts.md`` (``layers/0/attn/q_proj/kernel``), which the
    sharding rules, the HF name table and the quantizer match on: an nnx Variable's ``.value`` is left out.
    ``keep_value=True`` keeps it (``params/layers/0/attn/q_proj/kernel/value``, i.e.
    ``jax.tree_util.keystr(keys, simple=True, separator="/")``): the spelling checkpoint layout records and
    fingerprints are keyed by, so checkpoints already written keep matching.
    """
    return "/".join(name for name in (_key_name(k, keep_value) for k in keys) if name is not None)


def param_shardings(params: PyTree, mesh: Mesh) -> PyTree:
    """Map a parameter tree to ``NamedSharding``s with the same tree structure.

    Works on ``nnx.state(model, nnx.Param)`` (the result is a ``State`` whose Variables hold
    shardings, usable directly as ``jax.device_put`` / ``jax.jit`` shardings for that state), on
    ``nnx.eval_shape`` output (``ShapeDtypeStruct`` leaves, for loading straight onto shardings)
    and on plain nested dicts of arrays.
    """

    def one(keys, leaf):
        return NamedSharding(mesh, param_partition_spec(tree_path(keys), np.shape(leaf), mesh))

    return jax.tree_util.tree_map_with_path(one, params)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch dimension is split over: ``data``, ``fsdp`` and ``expert`` when present."""
    return tuple(a for a in ("data", "fsdp", "expert") if a in mesh.shape)


def row_shards(mesh: Mesh | None) -> int:
    """How many devices a per-row computation can split its rows over, each device computing its own rows alone
    with whole weights: the ``data`` axis of a data-parallel mesh, else 1 (no mesh, or weights split over
    ``fsdp``/``tensor``/``expert``: a row would need other devices' weights)."""
    if mesh is None or any(size > 1 for name, size in mesh.shape.items() if name != "data"):
        return 1
    return mesh.shape.get("data", 1)


def split_rows(fn: Any, mesh: Mesh | None, rows: int, split: Sequence[bool]) -> Any:
    """`fn` run by each device on its own rows of a ``[rows, ...]`` per-row computation (``jax.shard_map`` over
    ``data``): the arguments flagged in `split` are split on dim 0, the others replicated, every output split.
    `fn` itself when `row_shards` is 1 or does not divide `rows`. Why: a per-row ``lax.map`` under plain jit
    gathers the rows and runs every row on every device of a data-parallel mesh, N× the work on N devices."""
    shards = row_shards(mesh)
    if shards == 1 or rows % shards:
        return fn
    spec = P("data")
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec if s else P() for s in split), out_specs=spec,
                         check_vma=False)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a ``[batch, seq, ...]`` array: batch over ``data`` and ``fsdp`` (and ``expert`` when the
    mesh has it), the rest replicated.

    FSDP shards the batch too (each fsdp rank computes on its own examples with gathered weights), so
    the batch dimension is split over both axes and the global batch must divide by data×fsdp(×expert).
    """
    if ndim < 1:
        raise ValueError(f"batch_sharding needs ndim >= 1, got {ndim}")
    return NamedSharding(mesh, P(batch_axes(mesh), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding, for scalars such as the learning rate or the loss-scale state."""
    return NamedSharding(mesh, P())


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move an existing model's parameters onto their shardings, in place; returns the model.

    Meant for models built on one device (tests, small models). Large checkpoints should instead be
    loaded straight onto their shardings (``hf_io.load_hf(..., mesh=mesh)``) so that no host or device
    ever holds a full copy.
    """
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(params, param_shardings(params, mesh)))
    if hasattr(model, "mesh"):  # a Transformer: its MoE layers dispatch experts over this mesh (models/moe.py)
        model.mesh = mesh
    return model
