from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class Prompt(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "exact", "logit_noise_std", "return_routing", "quantize_strength", "prompt_offset")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_NOISE_STD_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTING_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    exact: bool
    logit_noise_std: float
    return_routing: bool
    quantize_strength: float
    prompt_offset: int
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., n: _Optional[int] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., exact: _Optional[bool] = ..., logit_noise_std: _Optional[float] = ..., return_routing: _Optional[bool] = ..., quantize_strength: _Optional[float] = ..., prompt_offset: _Optional[int] = ...) -> None: ...

class Routing(_message.Message):
    __slots__ = ("expert_ids", "num_layers", "top_k", "itemsize", "num_prompt_tokens")
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    ITEMSIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    expert_ids: bytes
    num_layers: int
    top_k: int
    itemsize: int
    num_prompt_tokens: int
    def __init__(self, expert_ids: _Optional[bytes] = ..., num_layers: _Optional[int] = ..., top_k: _Optional[int] = ..., itemsize: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "weight_version", "routing", "kept_counts")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    KEPT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    weight_version: int
    routing: Routing
    kept_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., weight_version: _Optional[int] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ..., kept_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptCompletions(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Completion]
    def __init__(self, samples: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("prompts", "server_id")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[PromptCompletions]
    server_id: str
    def __init__(self, prompts: _Optional[_Iterable[_Union[PromptCompletions, _Mapping]]] = ..., server_id: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "name", "dtype", "shape", "offset", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, version: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "num_tensors", "num_bytes")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    num_tensors: int
    num_bytes: int
    def __init__(self, weight_version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ("include_weight_specs",)
    INCLUDE_WEIGHT_SPECS_FIELD_NUMBER: _ClassVar[int]
    include_weight_specs: bool
    def __init__(self, include_weight_specs: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("architecture", "vocab_size", "dtype", "engine", "weight_version", "max_model_len", "server_id", "max_request_prompt_tokens", "max_request_completion_tokens", "weight_specs", "options", "quantize", "shm_host_id", "routing_bytes_per_token")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SPECS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    SHM_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTING_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    vocab_size: int
    dtype: str
    engine: str
    weight_version: int
    max_model_len: int
    server_id: str
    max_request_prompt_tokens: int
    max_request_completion_tokens: int
    weight_specs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    options: _containers.RepeatedScalarFieldContainer[str]
    quantize: str
    shm_host_id: str
    routing_bytes_per_token: int
    def __init__(self, architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., engine: _Optional[str] = ..., weight_version: _Optional[int] = ..., max_model_len: _Optional[int] = ..., server_id: _Optional[str] = ..., max_request_prompt_tokens: _Optional[int] = ..., max_request_completion_tokens: _Optional[int] = ..., weight_specs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., options: _Optional[_Iterable[str]] = ..., quantize: _Optional[str] = ..., shm_host_id: _Optional[str] = ..., routing_bytes_per_token: _Optional[int] = ...) -> None: ...

class ShmTensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ...) -> None: ...

class ShmWeights(_message.Message):
    __slots__ = ("version", "pid", "fd", "size", "checksum", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    pid: int
    fd: int
    size: int
    checksum: int
    tensors: _containers.RepeatedCompositeFieldContainer[ShmTensor]
    def __init__(self, version: _Optional[int] = ..., pid: _Optional[int] = ..., fd: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[ShmTensor, _Mapping]]] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
