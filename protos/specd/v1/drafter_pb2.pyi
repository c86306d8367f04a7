from protos.specd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("round", "commands", "push_ahead", "reset_prefix_cache")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_AHEAD_FIELD_NUMBER: _ClassVar[int]
    RESET_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    round: int
    commands: _containers.RepeatedCompositeFieldContainer[SeqCommand]
    push_ahead: bool
    reset_prefix_cache: bool
    def __init__(self, round: _Optional[int] = ..., commands: _Optional[_Iterable[_Union[SeqCommand, _Mapping]]] = ..., push_ahead: _Optional[bool] = ..., reset_prefix_cache: _Optional[bool] = ...) -> None: ...

class SeqCommand(_message.Message):
    __slots__ = ("seq_id", "open", "step", "close")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    open: Open
    step: Step
    close: Close
    def __init__(self, seq_id: _Optional[int] = ..., open: _Optional[_Union[Open, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("token_ids", "params", "trace_context", "constraint", "prompt_length", "route", "proposer", "suffix_private", "cache_salt")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_PRIVATE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    trace_context: _containers.ScalarMap[str, str]
    constraint: _common_pb2.Constraint
    prompt_length: int
    route: str
    proposer: str
    suffix_private: bool
    cache_salt: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ..., prompt_length: _Optional[int] = ..., route: _Optional[str] = ..., proposer: _Optional[str] = ..., suffix_private: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("committed_ids", "k")
    COMMITTED_IDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    committed_ids: _containers.RepeatedScalarFieldContainer[int]
    k: int
    def __init__(self, committed_ids: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("round", "proposals", "drafter", "ahead", "lookup_only", "context_window", "combined_lookup")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ONLY_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    COMBINED_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    round: int
    proposals: _containers.RepeatedCompositeFieldContainer[SeqProposal]
    drafter: str
    ahead: bool
    lookup_only: bool
    context_window: int
    combined_lookup: bool
    def __init__(self, round: _Optional[int] = ..., proposals: _Optional[_Iterable[_Union[SeqProposal, _Mapping]]] = ..., drafter: _Optional[str] = ..., ahead: _Optional[bool] = ..., lookup_only: _Optional[bool] = ..., context_window: _Optional[int] = ..., combined_lookup: _Optional[bool] = ...) -> None: ...

class SeqProposal(_message.Message):
    __slots__ = ("seq_id", "tokens", "q", "error", "alternatives", "ngram", "follows", "assumed")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    NGRAM_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    error: str
    alternatives: _containers.RepeatedCompositeFieldContainer[Alternative]
    ngram: bool
    follows: int
    assumed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., error: _Optional[str] = ..., alternatives: _Optional[_Iterable[_Union[Alternative, _Mapping]]] = ..., ngram: _Optional[bool] = ..., follows: _Optional[int] = ..., assumed: _Optional[_Iterable[int]] = ...) -> None: ...

class Alternative(_message.Message):
    __slots__ = ("parent", "token")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    parent: int
    token: int
    def __init__(self, parent: _Optional[int] = ..., token: _Optional[int] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...
