"""Hugging Face checkpoints in and out: `config.json` + (sharded) safetensors ⇄ our parameter tree.

Loading never builds the model on the host: the model is created abstractly (`nnx.eval_shape`), each
parameter's target sharding is computed from its path, and each tensor is read from the memory-mapped
safetensors file, transposed to our `[in, out]` layout, cast to the policy's parameter dtype and
`jax.device_put` straight onto that sharding — at most one tensor is on the host at a time.

Names are mapped by one regex table (`_RULES`, Tunix style). The same mapping is the weight-sync wire
format (`params_to_hf` / `hf_to_params`): a trainer pushes HF-named, torch-layout tensors and the JAX
engine or vLLM applies them exactly like a checkpoint.

Both layer layouts of `Transformer` use the same per-layer HF names: a stacked parameter of the scanned
layout (`layers/attn/q_proj/kernel`, `[L, ...]`) is read from, and written as, the L tensors
`model.layers.{i}.self_attn.q_proj.weight`, one stacked parameter on the host at a time.

Mixture-of-experts weights are stacked over experts here (`layers/{i}/mlp/experts/gate_proj`, `[E, D, F]`)
and one tensor per expert in HF checkpoints (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, `[F, D]`;
transformers 5 fuses them on load and splits them again on save), so such a parameter is read from, and
written as, its E slices (L × E in the scanned layout); the router `layers/{i}/mlp/router/kernel` `[D, E]` is
`model.layers.{i}.mlp.gate.weight` `[E, D]`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import PyTree
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_mismatch.models.config import ModelConfig
from jaxrl_mismatch.models.model import Transformer
from jaxrl_mismatch.models.sharding import stacked_layer_param, tree_path
from jaxrl_mismatch.precision import DTypePolicy
from jaxrl_mismatch.usage import first_line

_EXPERT_STACK = re.compile(r"layers/\d+/mlp/experts/(gate|up|down)_proj")

# (our parameter path, HF tensor name template, transposed?) — linear kernels are [in, out] here and
# [out, in] in torch.
_RULES: tuple[tuple[re.Pattern, str, bool], ...] = tuple(
    (re.compile(p), t, tr)
    for p, t, tr in (
        (r"embed/embedding", "model.embed_tokens.weight", False),
        (r"layers/(\d+)/input_norm/scale", "model.layers.{0}.input_layernorm.weight", False),
        (r"layers/(\d+)/post_attn_norm/scale", "model.layers.{0}.post_attention_layernorm.weight", False),
        (r"layers/(\d+)/attn/([qkvo])_proj/kernel", "model.layers.{0}.self_attn.{1}_proj.weight", True),
        (r"layers/(\d+)/attn/([qkv])_proj/bias", "model.layers.{0}.self_attn.{1}_proj.bias", False),
        (r"layers/(\d+)/attn/([qk])_norm/scale", "model.layers.{0}.self_attn.{1}_norm.weight", False),
        (r"layers/(\d+)/mlp/(gate|up|down)_proj/kernel", "model.layers.{0}.mlp.{1}_proj.weight", True),
        (r"layers/(\d+)/mlp/router/kernel", "model.layers.{0}.mlp.gate.weight", True),
        # One expert's slice of a stacked expert parameter (`_slices`): .../experts/gate_proj/{e}.
        (r"layers/(\d+)/mlp/experts/(gate|up|down)_proj/(\d+)", "model.layers.{0}.mlp.experts.{2}.{1}_proj.weight",
         True),
        (r"final_norm/scale", "model.norm.weight", False),
        (r"lm_head/kernel", "lm_head.weight", True),
    )
)
# Non-parameter buffers some older checkpoints carry; recomputed here from the config.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_DTYPE_NAMES = {np.dtype(jnp.float32): "float32", np.dtype(jnp.bfloat16): "bfloat16", np.dtype(jnp.float16): "float16"}


def hf_name(path: str) -> tuple[str, bool]:
    """(HF tensor name, whether the tensor is transposed relative to ours) of one parameter path."""
    for pattern, template, transposed in _RULES:
        m = pattern.fullmatch(path)
        if m:
            return template.format(*m.groups()), transposed
    raise ValueError(f"parameter {path!r} has no Hugging Face name mapping")


def _slices(path: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """(per-tensor path, index into the parameter) of every HF tensor one parameter holds: itself; its L layers
    (scanned layout); its E experts (stacked expert weights); or L × E of them."""
    inner = stacked_layer_param(path)
    if inner is not None:
        return [(p, (i, *idx)) for i in range(shape[0]) for p, idx in _slices(f"layers/{i}/{inner}", shape[1:])]
    if _EXPERT_STACK.fullmatch(path):
        return [(f"{path}/{e}", (e,)) for e in range(shape[0])]
    return [(path, ())]


def _expected_extras(cfg: ModelConfig) -> set[str]:
    # Tied checkpoints sometimes still store lm_head.weight (a copy of the embedding); we use the embedding.
    return {"lm_head.weight"} if cfg.tie_word_embeddings else set()


def hf_to_params(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, abstract_params: PyTree) -> PyTree:
    """Place HF-named, torch-layout tensors into a parameter tree shaped like `abstract_params`.

    `abstract_params` is `nnx.state(model, nnx.Param)` of a real model (each tensor goes onto the
    existing leaf's sharding and dtype, e.g. a weight-sync update) or of `nnx.eval_shape` output
    (`ShapeDtypeStruct` leaves, optionally carrying a `.sharding`). Tensors are fetched one at a time
    from `tensors`, which may be lazy.

    Raises:
        ValueError: naming the tensor, when one the model needs is missing, has the wrong shape, or
            `tensors` holds names the model does not use.
    """
    used: set[str] = set()

    def read(path: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        name, transposed = hf_name(path)
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r} (parameter {path}, shape {shape})")
        x = np.asarray(tensors[name])
        if transposed:
            x = x.T
        if x.shape != shape:
            got = x.T.shape if transposed else x.shape
            want = shape[::-1] if transposed else shape
            raise ValueError(f"tensor {name!r} has shape {got}, expected {want} for {cfg.architecture} config")
        used.add(name)
        return np.asarray(x, dtype=dtype)

    def place(keys, leaf):
        path = tree_path(keys)
        shape = tuple(leaf.shape)
        parts = _slices(path, shape)
        if parts == [(path, ())]:
            x = read(path, shape, leaf.dtype)
        else:  # scanned layers and/or stacked experts: one host array filled tensor by tensor
            x = np.empty(shape, dtype=leaf.dtype)
            for part, idx in parts:
                x[idx] = read(part, shape[len(idx):], leaf.dtype)
        sharding = getattr(leaf, "sharding", None)
        x = np.ascontiguousarray(x)
        if not x.flags.writeable:  # device_put aliases read-only host memory (e.g. a trainer's shared memory,
            x = x.copy()           # rollout/shm.py) instead of copying it; the parameters must own theirs
        return jax.device_put(x, sharding)

    params = jax.tree_util.tree_map_with_path(place, abstract_params)
    allowed = _expected_extras(cfg)
    unexpected = sorted(n for n in tensors if n not in used and n not in allowed and not _IGNORED.fullmatch(n))
    if unexpected:
        shown = ", ".join(repr(n) for n in unexpected[:10])
        more = f" (+{len(unexpected) - 10} more)" if len(unexpected) > 10 else ""
        raise ValueError(f"checkpoint has tensors the {cfg.architecture} model does not use: {shown}{more}")
    return params


class _Block:
    """`leaf[prefix]` fetched from the device once for the `count` slices that read it, then dropped."""

    def __init__(self, leaf, prefix: tuple[int, ...], count: int):
        self.leaf, self.prefix, self.left, self.data = leaf, prefix, count, None

    def take(self, rest: tuple[int, ...]) -> np.ndarray:
        if self.data is None:
            self.data = np.asarray(jax.device_get(self.leaf[self.prefix] if self.prefix else self.leaf))
        out = self.data[rest] if rest else self.data
        self.left -= 1
        if self.left == 0:
            self.data = None
        return out


class _LayerSlice:
    """One HF tensor inside a stacked parameter (a layer and/or an expert), fetched only when written
    (`_to_host`); the slices of one layer share a `_Block`, so a layer's experts cross to the host at once."""

    def __init__(self, stacked, idx: tuple[int, ...], block: _Block):
        self.idx, self.block = idx, block
        self.shape, self.dtype = tuple(stacked.shape[len(idx):]), stacked.dtype

    def fetch(self) -> np.ndarray:
        return self.block.take(self.idx[len(self.block.prefix):])


def _iter_hf(params: PyTree) -> Iterator[tuple[str, str, bool, Any]]:
    """(HF name, our path, transposed?, leaf or `_LayerSlice`) of every HF tensor, per layer and expert."""
    for keys, leaf in jax.tree_util.tree_leaves_with_path(params):
        path = tree_path(keys)
        parts = _slices(path, tuple(leaf.shape))
        if parts == [(path, ())]:
            name, transposed = hf_name(path)
            yield name, path, transposed, leaf
            continue
        width = 1 if stacked_layer_param(path) is not None else 0  # one block per layer, else the whole leaf
        counts = collections.Counter(idx[:width] for _, idx in parts)
        blocks = {prefix: _Block(leaf, prefix, n) for prefix, n in counts.items()}
        for part, idx in parts:
            prefix = idx[:width]
            name, transposed = hf_name(part)
            yield name, part, transposed, _LayerSlice(leaf, idx, blocks[prefix])


def hf_tensor_shapes(params: PyTree) -> dict[str, tuple[tuple[int, ...], Any]]:
    """HF name -> (torch-layout shape, dtype) of every tensor `params_to_hf` would produce, from shapes alone."""
    return {name: ((tuple(leaf.shape)[::-1] if tr else tuple(leaf.shape)), leaf.dtype)
            for name, _, tr, leaf in _iter_hf(params)}


def _to_host(leaf, transposed: bool) -> np.ndarray:
    x = leaf.fetch() if isinstance(leaf, _LayerSlice) else np.asarray(jax.device_get(leaf))
    return np.ascontiguousarray(x.T if transposed else x)


def params_to_hf(params: PyTree, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF-named tensors in torch layout (`[out, in]` linears), in the parameters' dtype.

    Tied models have no `lm_head.weight` entry (transformers and vLLM re-tie it from the embedding).
    """
    del cfg  # names follow from the parameter paths; kept for the contract's symmetry with hf_to_params
    return {name: _to_host(leaf, tr) for name, _, tr, leaf in _iter_hf(params)}


class ModelFilesError(ValueError):
    """A checkpoint directory's weights cannot be loaded: an unreadable safetensors file, a missing tensor, a shape
    that does not match config.json (`load_hf`; the message names the directory or file)."""


def _read_weight_map(index_path: str) -> dict[str, str]:
    """The `weight_map` of a sharded checkpoint's index (tensor name → safetensors file in the same folder);
    ModelFilesError naming the index when it is not one."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ModelFilesError(f"{index_path}: not valid JSON ({first_line(e)})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFilesError(f"{index_path}: expected an object with a non-empty 'weight_map' object (tensor name → "
                              "safetensors file)")
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or os.path.basename(fname) != fname or not fname.endswith(".safetensors"):
            raise ModelFilesError(f"{index_path}: weight_map[{name!r}] is {fname!r}, not a .safetensors file name in "
                                  "the checkpoint's folder")
    return weight_map


class _LazyCheckpoint(Mapping):
    """Read-on-demand view of a HF safetensors directory: name → numpy array (one tensor at a time)."""

    def __init__(self, directory: str, stack: contextlib.ExitStack):
        index_path = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index_path):
            weight_map = _read_weight_map(index_path)
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {directory}")
            weight_map = None
        self._handles = {}
        for fname in files:
            fpath = os.path.join(directory, fname)
            if not os.path.exists(fpath):
                raise FileNotFoundError(f"{index_path} lists {fname}, which does not exist")
            try:
                self._handles[fname] = stack.enter_context(safe_open(fpath, framework="numpy"))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError (truncated, garbled)
                raise ModelFilesError(f"{fpath} is not a readable safetensors file ({first_line(e)})") from None
        if weight_map is None:  # no index: every safetensors file of the folder, as vLLM reads them
            weight_map = {}
            for fname, h in self._handles.items():
                for n in h.keys():
                    if n in weight_map:  # a stray copy (model_old.safetensors): which one wins is a file-name accident
                        raise ModelFilesError(f"{directory}: tensor {n!r} is in both {weight_map[n]} and {fname} (no "
                                              "model.safetensors.index.json says which); move the other file away")
                    weight_map[n] = fname
        self._weight_map = weight_map

    def __getitem__(self, name: str) -> np.ndarray:
        fname = self._weight_map[name]
        try:
            return self._handles[fname].get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a tensor whose bytes cannot be read (a damaged file)
            raise ModelFilesError(f"{fname}: tensor {name!r} cannot be read ({first_line(e)})") from None

    def __iter__(self):
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape from its file's header, without reading its data."""
        fname = self._weight_map[name]
        try:
            return tuple(self._handles[fname].get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - an index naming a tensor its file does not hold
            raise ModelFilesError(f"{fname}: tensor {name!r} cannot be read ({first_line(e)})") from None


def _check_against_config(checkpoint: _LazyCheckpoint, cfg: ModelConfig) -> None:
    """ValueError naming the first tensor `load_hf` would refuse: one the config's model needs that is missing or
    has another shape, or one it would not use. From the headers and `nnx.eval_shape` alone (nothing is read or
    allocated), so a folder whose weights were written for another config.json is refused before any work."""
    expected = hf_tensor_shapes(nnx.split(abstract_model(cfg, DTypePolicy()), nnx.Param)[1])
    for name, (shape, _) in expected.items():
        if name not in checkpoint:
            raise ValueError(f"checkpoint is missing tensor {name!r} (shape {shape}) that its config.json's "
                             f"{cfg.architecture} model needs")
        got = checkpoint.shape(name)
        if got != shape:
            raise ValueError(f"tensor {name!r} has shape {got}, expected {shape} for its config.json's "
                             f"{cfg.architecture} model")
    allowed = _expected_extras(cfg)
    unexpected = sorted(n for n in checkpoint if n not in expected and n not in allowed and not _IGNORED.fullmatch(n))
    if unexpected:
        more = f" (+{len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(f"checkpoint has tensor {unexpected[0]!r}{more} that its config.json's "
                         f"{cfg.architecture} model does not use")


def check_model_files(directory: str | os.PathLike, cfg: ModelConfig | None = None) -> None:
    """ModelFilesError naming the file unless every safetensors file of `directory` (or its index) opens: a header
    that parses and data that covers it, so a truncated or garbled copy is found before any work, not after a
    server started. Given the folder's `cfg` (its config.json), the tensors' names and header shapes are checked
    against it too, as `load_hf` would when the job loads it (each rollout server loads it again)."""
    directory = os.fspath(directory)
    try:
        with contextlib.ExitStack() as stack:
            checkpoint = _LazyCheckpoint(directory, stack)
            if cfg is not None:
                _check_against_config(checkpoint, cfg)
    except ModelFilesError:
        raise
    except (ValueError, OSError, KeyError) as e:  # no weights, a listed file missing, a bad index, a wrong tensor
        raise ModelFilesError(f"{directory}: {first_line(e)}") from None


def abstract_model(cfg: ModelConfig, policy: DTypePolicy, **options) -> Transformer:
    """The model with `ShapeDtypeStruct`s in place of arrays (nothing allocated); `options` are
    `Transformer`'s keyword options (`scan_layers`, `attention_impl`, `attention_block`, `remat`)."""
    return nnx.eval_shape(lambda: Transformer(cfg, policy, rngs=nnx.Rngs(0), **options))


def load_hf(directory: str | os.PathLike, *, policy: DTypePolicy, mesh: jax.sharding.Mesh | None = None,
            **options):
    """Load a local HF checkpoint directory → (ModelConfig, Transformer), parameters in `policy.param_dtype`.

    With a `mesh`, each tensor is placed on `models.sharding.param_shardings`' sharding for its path, and the
    model carries the mesh (`Transformer.mesh`: a MoE layer's experts then run expert-parallel under `shard_map`);
    without, on the default device. `options` go to `Transformer` (e.g. `scan_layers=True`: the same
    checkpoint loads into the stacked layout).
    """
    directory = os.fspath(directory)
    cfg = ModelConfig.from_hf(directory)
    graphdef, abstract = nnx.split(abstract_model(cfg, policy, mesh=mesh, **options), nnx.Param)
    if mesh is not None:
        from jaxrl_mismatch.models.sharding import param_shardings

        shardings = param_shardings(abstract, mesh)
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
        )
    try:
        with contextlib.ExitStack() as stack:
            params = hf_to_params(_LazyCheckpoint(directory, stack), cfg, abstract)
    except ModelFilesError:
        raise
    except (ValueError, OSError) as e:  # a missing tensor or file, a wrong shape, a bad index (JSON)
        raise ModelFilesError(f"{directory}: {first_line(e)}") from None
    return cfg, nnx.merge(graphdef, params)


def save_hf(
    model: Transformer, cfg: ModelConfig, directory: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30,
    extra_config: dict[str, Any] | None = None,
) -> list[str]:
    """Write `config.json` + safetensors that transformers `from_pretrained` and vLLM load.

    Tensors are fetched to the host one shard at a time (each parameter must be fully addressable from
    this process: single-host meshes; multi-host saving goes through orbax). Checkpoints over
    `max_shard_bytes` are split into `model-0000i-of-0000n.safetensors` files with a
    `model.safetensors.index.json`, as HF does.
    `extra_config`: further `config.json` keys `cfg` does not hold (an export keeps its base's token ids).
    Returns the written safetensors file names. A folder that already holds weights is refused (FileExistsError):
    a sharded index left beside a new single file would be read first and load the old weights, and nothing here
    deletes what it did not write (the jobs save into a new temporary folder and rename it into place).
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    weights = sorted(f for f in os.listdir(directory)
                     if f.endswith(".safetensors") or f == "model.safetensors.index.json")
    if weights:
        raise FileExistsError(f"{directory} already holds a checkpoint's weights ({', '.join(weights[:3])}"
                              f"{', ...' if len(weights) > 3 else ''}); save into a new or empty folder")
    params = nnx.state(model, nnx.Param)
    entries = sorted(_iter_hf(params), key=lambda e: e[0])
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = int(np.prod(entry[3].shape)) * np.dtype(entry[3].dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        tensors = {name: _to_host(leaf, tr) for name, _, tr, leaf in shard}
        save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
        for name, x in tensors.items():
            weight_map[name] = fname
            total += x.nbytes
        del tensors
    if len(shards) > 1:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {**(extra_config or {}), **cfg.to_hf()}
    config["torch_dtype"] = config["dtype"] = _DTYPE_NAMES[np.dtype(model.policy.param_dtype)]
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return names
