"""Model configuration read from (and written back to) a Hugging Face `config.json`.

One decoder covers the three families people fine-tune with RL; they differ only in a few switches:

| architecture        | q/k/v bias | per-head q/k RMSNorm | RoPE scaling |
| ------------------- | ---------- | -------------------- | ------------ |
| `LlamaForCausalLM`  | no         | no                   | llama3 or none |
| `Qwen2ForCausalLM`  | yes        | no                   | none         |
| `Qwen3ForCausalLM`  | no         | yes                  | none         |
| `Qwen3MoeForCausalLM` | no       | yes                  | none         |

`Qwen3MoeForCausalLM` (Qwen3 technical report, 2025, §2) replaces the SwiGLU MLP of its sparse layers by
`num_experts` SwiGLU experts of width `moe_intermediate_size` behind a top-`num_experts_per_tok` softmax
router (`models/moe.py`); a layer is sparse iff it is not in `mlp_only_layers` and
`(layer + 1) % decoder_sparse_step == 0` (HF's rule), the others keep a dense MLP of `intermediate_size`.

Anything outside that set (another architecture, sliding-window attention, an MLP bias, another RoPE
scaling type) is refused here with an error naming the field, rather than silently computing a
different model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jaxrl_mismatch.usage import first_line

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_MODEL_TYPE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "Qwen3MoeForCausalLM": "qwen3_moe"}
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyper-parameters of one decoder-only transformer (names follow HF `config.json`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or the Llama-3 dict (rope_type, factor, ... )
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projection biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int
    # Mixture of experts (Qwen3MoeForCausalLM; 0 experts = every layer dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k of the router
    moe_intermediate_size: int = 0  # width of one expert's SwiGLU
    norm_topk_prob: bool = False  # renormalise the k selected router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse iff (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001  # HF's coefficient, kept for to_hf (the trainer's is objective.router_aux_coef)

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings")
        small = [f"{k}={getattr(self, k)}" for k in sizes if getattr(self, k) < 1]
        if small:
            raise ValueError(f"{', '.join(small)}: sizes must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention needs equal groups)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.architecture == "Qwen3MoeForCausalLM":
            if self.num_experts < 1:
                raise ValueError(f"num_experts={self.num_experts} must be >= 1 for {self.architecture}")
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                                 f"{self.num_experts}]")
            if self.moe_intermediate_size < 1:
                raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ValueError(f"mlp_only_layers={list(self.mlp_only_layers)}: layer {bad[0]} is outside "
                                 f"[0, num_hidden_layers={self.num_hidden_layers})")
        elif self.num_experts:
            raise ValueError(f"num_experts={self.num_experts}: experts need architecture Qwen3MoeForCausalLM, "
                             f"got {self.architecture}")

    def __hash__(self) -> int:
        # The config rides in the model's static graph definition, which jit hashes; the dict field
        # would make the generated hash fail.
        items = tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return hash(tuple((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in items))

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer` has the mixture-of-experts block (HF `Qwen3MoeDecoderLayer`'s rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Indices of the sparse (MoE) layers, in order: the `layers` axis of routing arrays."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sparse_layer(i))

    @property
    def is_moe(self) -> bool:
        return bool(self.sparse_layers)

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | os.PathLike) -> "ModelConfig":
        """Build from a HF `config.json` dict, a path to the file, or the checkpoint directory.

        Reads both the legacy (`rope_theta` + `rope_scaling`) and the transformers-5 (`rope_parameters`)
        spellings of the RoPE settings.
        """
        d = _read_config(config)
        archs = d.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(
                f"config.json must name exactly one entry in 'architectures', got {archs!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        model_type = d.get("model_type")
        if model_type is not None and model_type != _MODEL_TYPE[arch]:  # mistral + LlamaForCausalLM: a sliding window
            raise ValueError(f"config.json: model_type {model_type!r} is not {arch}'s ({_MODEL_TYPE[arch]!r}); "
                             "another model family's config would be read as this one")
        _refuse_unsupported_features(d, arch)
        theta, scaling = _rope_settings(d)
        heads = _number(d, "num_attention_heads", int)
        moe = {}
        if arch == "Qwen3MoeForCausalLM":
            if "num_experts" not in d and "num_local_experts" in d:  # transformers 5 writes this spelling
                d = {**d, "num_experts": d["num_local_experts"]}
            missing = [k for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size") if k not in d]
            if missing:
                raise ValueError(f"config.json of {arch} is missing {', '.join(missing)}")
            only = d.get("mlp_only_layers") or []
            if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
                raise ValueError(f"config.json: mlp_only_layers must be a list of layer indices, got {only!r}")
            moe = dict(
                num_experts=_number(d, "num_experts", int), num_experts_per_tok=_number(d, "num_experts_per_tok", int),
                moe_intermediate_size=_number(d, "moe_intermediate_size", int),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                decoder_sparse_step=_number(d, "decoder_sparse_step", int, 1),
                mlp_only_layers=tuple(only),
                router_aux_loss_coef=_number(d, "router_aux_loss_coef", float, 0.001),
            )
        hidden = _number(d, "hidden_size", int)
        try:
            return cls(
                architecture=arch,
                vocab_size=_number(d, "vocab_size", int),
                hidden_size=hidden,
                intermediate_size=_number(d, "intermediate_size", int),
                num_hidden_layers=_number(d, "num_hidden_layers", int),
                num_attention_heads=heads,
                num_key_value_heads=_number(d, "num_key_value_heads", int, heads),
                head_dim=_number(d, "head_dim", int, hidden // heads if heads > 0 else 0),
                rms_norm_eps=_number(d, "rms_norm_eps", float, 1e-6),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=arch == "Qwen2ForCausalLM",
                qk_norm=arch in _QK_NORM,
                max_position_embeddings=_number(d, "max_position_embeddings", int, 4096),
                **moe,
            )
        except ValueError as e:  # sizes < 1, heads not dividing: the field is config.json's
            raise ValueError(str(e) if str(e).startswith("config.json") else f"config.json: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict for this model (without a dtype; `save_hf` adds the stored one).

        RoPE settings are written in both spellings so transformers 4.x/5.x and vLLM all read them.
        """
        rope_parameters: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope_parameters = {"rope_theta": self.rope_theta, **self.rope_scaling}
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPE[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling is not None else None,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.architecture == "LlamaForCausalLM":
            out.update(attention_bias=False, mlp_bias=False)
        elif self.architecture in _QK_NORM:
            out.update(attention_bias=False, use_sliding_window=False)
            if self.architecture == "Qwen3MoeForCausalLM":
                out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                           moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                           decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                           router_aux_loss_coef=self.router_aux_loss_coef, output_router_logits=False)
        else:
            out.update(use_sliding_window=False)
        return out


def _read_config(config: dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e.msg}, line {e.lineno})") from None
        except (ValueError, RecursionError) as e:  # an integer past Python's 4,300 digits; nesting too deep
            raise ValueError(f"{path} is not valid JSON ({first_line(e)})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} holds a JSON {type(d).__name__}, not an object")
    return d


def _refuse_unsupported_features(d: dict[str, Any], arch: str) -> None:
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported (SwiGLU with silu only)")
    if arch != "Qwen2ForCausalLM" and d.get("attention_bias", False):
        raise ValueError(f"attention_bias=True is not supported for {arch} (no q/k/v/o biases in this model)")
    if d.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (SwiGLU projections have no bias)")
    if d.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported (full causal attention only)")


_REQUIRED = object()


def _number(d: dict[str, Any], key: str, kind: type, default: Any = _REQUIRED) -> Any:
    """config.json's `key` as an int or float (`kind`); a missing or null key takes `default` when one is given.
    ValueError naming the key for a missing required one or a value of another type (a string, a bool, 2.5 layers):
    a KeyError or TypeError there ended `train` and `serve` with a traceback-less exit 1 naming no file."""
    v = d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ValueError(f"config.json: {key} is {'null' if key in d else 'missing'}")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and isinstance(v, float)
                                                                   and not v.is_integer()):
        raise ValueError(f"config.json: {key} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
    if abs(v) >= 2**63:  # float() of such an int overflows, and no size is that large (1e300 as a float neither)
        size = f"{v:.3g}" if isinstance(v, float) else f"{len(str(abs(v)))} digits"
        raise ValueError(f"config.json: {key} is out of range ({size})")
    return kind(v)


def _rope_settings(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, llama3 scaling dict or None) from either config spelling. A config holding both (as `to_hf`
    writes them) must say the same in each: transformers 5 and vLLM read a non-null `rope_scaling` first, this
    reader `rope_parameters`, so two different settings would give the engine and the trainer different RoPE."""
    params, legacy = d.get("rope_parameters"), d.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config.json: {key} must be an object or null, got {value!r}")
    settings = _rope_from(params if params is not None else legacy, d, "rope_parameters" if params is not None
                          else "rope_scaling")
    if params is not None and (legacy or "rope_theta" in d):  # a reader of the older keys takes these
        theta, scaling = _rope_from(legacy, d, "rope_scaling")
        if (legacy and (theta, scaling) != settings) or ("rope_theta" in d and theta != settings[0]):
            raise ValueError(f"config.json: rope_parameters {params!r} and rope_scaling {legacy!r} (with rope_theta "
                             f"{d.get('rope_theta')!r}) give different RoPE settings; readers differ in which they "
                             "take, so keep one or make them agree")
    return settings


def _rope_from(scaling: dict[str, Any] | None, d: dict[str, Any], key: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, llama3 scaling or None) of one spelling: `scaling` is `rope_parameters` or `rope_scaling` (`key`)."""
    outer = _number(d, "rope_theta", float, 10000.0)
    theta = _number(scaling, "rope_theta", float, outer) if scaling else outer
    if key == "rope_scaling" and scaling and "rope_theta" in scaling and "rope_theta" in d and theta != outer:
        # transformers 5 takes the one inside rope_scaling, older readers the top-level one
        raise ValueError(f"config.json: rope_scaling.rope_theta {theta!r} and rope_theta {outer!r} differ; readers "
                         "differ in which they take, so keep one or make them agree")
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: 'llama3' or none")
    top = d.get("original_max_position_embeddings")
    if top is not None:  # transformers 5 puts a top-level one over the dict's
        if scaling.get("original_max_position_embeddings", top) != top:
            raise ValueError(f"config.json: {key}.original_max_position_embeddings "
                             f"{scaling['original_max_position_embeddings']!r} and original_max_position_embeddings "
                             f"{top!r} differ; readers differ in which they take, so keep one or make them agree")
        scaling = {**scaling, "original_max_position_embeddings": top}
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {', '.join(missing)}")
    return theta, {"rope_type": "llama3", **{k: scaling[k] for k in _LLAMA3_KEYS}}
