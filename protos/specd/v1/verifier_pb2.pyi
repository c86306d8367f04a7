from protos.specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyGenerateRequest(_message.Message):
    __slots__ = ("prompt_ids", "params", "max_new_tokens", "stop_ids", "ignore_eos", "num_draft_tokens", "route", "draft_below_batch", "auto", "max_kv_utilization", "min_acceptance", "constraint", "proposer", "suffix_private", "cache_salt", "prediction_ids")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BELOW_BATCH_FIELD_NUMBER: _ClassVar[int]
    AUTO_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    MIN_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_PRIVATE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    max_new_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    num_draft_tokens: int
    route: str
    draft_below_batch: int
    auto: bool
    max_kv_utilization: float
    min_acceptance: float
    constraint: _common_pb2.Constraint
    proposer: str
    suffix_private: bool
    cache_salt: str
    prediction_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., num_draft_tokens: _Optional[int] = ..., route: _Optional[str] = ..., draft_below_batch: _Optional[int] = ..., auto: _Optional[bool] = ..., max_kv_utilization: _Optional[float] = ..., min_acceptance: _Optional[float] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., proposer: _Optional[str] = ..., suffix_private: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., prediction_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "speculation", "usage", "logprobs", "prompt_logprobs", "stop_token")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    speculation: _common_pb2.SpeculationInfo
    usage: _common_pb2.Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    stop_token: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationInfo, _Mapping]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., stop_token: _Optional[bool] = ...) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("kv_blocks_total", "kv_blocks_used", "running", "waiting", "spec_running", "tokens_per_s", "acceptance_by_route", "drafter_available", "kv_block_size", "max_batch_size")
    class AcceptanceByRouteEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    SPEC_RUNNING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_ROUTE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    kv_blocks_total: int
    kv_blocks_used: int
    running: int
    waiting: int
    spec_running: int
    tokens_per_s: float
    acceptance_by_route: _containers.ScalarMap[str, float]
    drafter_available: bool
    kv_block_size: int
    max_batch_size: int
    def __init__(self, kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., spec_running: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., acceptance_by_route: _Optional[_Mapping[str, float]] = ..., drafter_available: _Optional[bool] = ..., kv_block_size: _Optional[int] = ..., max_batch_size: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "max_context", "eos_ids", "max_draft_tokens", "drafter")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_context: int
    eos_ids: _containers.RepeatedScalarFieldContainer[int]
    max_draft_tokens: int
    drafter: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_ids: _Optional[_Iterable[int]] = ..., max_draft_tokens: _Optional[int] = ..., drafter: _Optional[str] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...
