from pdspark.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_KIND_UNSPECIFIED: _ClassVar[PoolKind]
    POOL_KIND_C4_KV: _ClassVar[PoolKind]
    POOL_KIND_C4_INDEX: _ClassVar[PoolKind]
    POOL_KIND_C128_KV: _ClassVar[PoolKind]
    POOL_KIND_SWA_KV: _ClassVar[PoolKind]
    POOL_KIND_C4_STATE: _ClassVar[PoolKind]
    POOL_KIND_C4_INDEX_STATE: _ClassVar[PoolKind]
    POOL_KIND_C128_STATE: _ClassVar[PoolKind]
    POOL_KIND_DRAFT_KV: _ClassVar[PoolKind]
POOL_KIND_UNSPECIFIED: PoolKind
POOL_KIND_C4_KV: PoolKind
POOL_KIND_C4_INDEX: PoolKind
POOL_KIND_C128_KV: PoolKind
POOL_KIND_SWA_KV: PoolKind
POOL_KIND_C4_STATE: PoolKind
POOL_KIND_C4_INDEX_STATE: PoolKind
POOL_KIND_C128_STATE: PoolKind
POOL_KIND_DRAFT_KV: PoolKind

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "prompt_token_ids", "sampling", "timeout_ms", "num_generated")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    timeout_ms: int
    num_generated: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., num_generated: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: TransferResult
    def __init__(self, result: _Optional[_Union[TransferResult, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "prompt_token_ids", "sampling", "prefill_address", "timeout_ms", "generated_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prefill_address: str
    timeout_ms: int
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., generated_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finished", "finish_reason", "num_cached_tokens", "spec_verify_steps", "spec_accepted_tokens", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finished: bool
    finish_reason: _common_pb2.FinishReason
    num_cached_tokens: int
    spec_verify_steps: int
    spec_accepted_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., spec_verify_steps: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class TransferPlan(_message.Message):
    __slots__ = ("transfer_id", "request_id", "session", "compat", "buffers", "prompt_len", "full_pages", "swa_pages", "swa_first_page", "c128_pages", "req_slot", "timeout_ms", "destination_rank")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    FULL_PAGES_FIELD_NUMBER: _ClassVar[int]
    SWA_PAGES_FIELD_NUMBER: _ClassVar[int]
    SWA_FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    C128_PAGES_FIELD_NUMBER: _ClassVar[int]
    REQ_SLOT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_RANK_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    session: str
    compat: _common_pb2.CompatDescriptor
    buffers: _containers.RepeatedCompositeFieldContainer[BufferDescriptor]
    prompt_len: int
    full_pages: _containers.RepeatedScalarFieldContainer[int]
    swa_pages: _containers.RepeatedScalarFieldContainer[int]
    swa_first_page: int
    c128_pages: _containers.RepeatedScalarFieldContainer[int]
    req_slot: int
    timeout_ms: int
    destination_rank: int
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., session: _Optional[str] = ..., compat: _Optional[_Union[_common_pb2.CompatDescriptor, _Mapping]] = ..., buffers: _Optional[_Iterable[_Union[BufferDescriptor, _Mapping]]] = ..., prompt_len: _Optional[int] = ..., full_pages: _Optional[_Iterable[int]] = ..., swa_pages: _Optional[_Iterable[int]] = ..., swa_first_page: _Optional[int] = ..., c128_pages: _Optional[_Iterable[int]] = ..., req_slot: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., destination_rank: _Optional[int] = ...) -> None: ...

class BufferDescriptor(_message.Message):
    __slots__ = ("pool", "layer", "base_addr", "item_bytes", "num_items")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    ITEM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolKind
    layer: int
    base_addr: int
    item_bytes: int
    num_items: int
    def __init__(self, pool: _Optional[_Union[PoolKind, str]] = ..., layer: _Optional[int] = ..., base_addr: _Optional[int] = ..., item_bytes: _Optional[int] = ..., num_items: _Optional[int] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("bytes", "num_writes", "transfer_s", "prefill_s", "plan_wait_s", "bytes_by_pool", "write_s", "source_rank", "destination_rank")
    class BytesByPoolEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    PLAN_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_BY_POOL_FIELD_NUMBER: _ClassVar[int]
    WRITE_S_FIELD_NUMBER: _ClassVar[int]
    SOURCE_RANK_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_RANK_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    num_writes: int
    transfer_s: float
    prefill_s: float
    plan_wait_s: float
    bytes_by_pool: _containers.ScalarMap[str, int]
    write_s: float
    source_rank: int
    destination_rank: int
    def __init__(self, bytes: _Optional[int] = ..., num_writes: _Optional[int] = ..., transfer_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., plan_wait_s: _Optional[float] = ..., bytes_by_pool: _Optional[_Mapping[str, int]] = ..., write_s: _Optional[float] = ..., source_rank: _Optional[int] = ..., destination_rank: _Optional[int] = ...) -> None: ...

class TransferResult(_message.Message):
    __slots__ = ("transfer_id", "error", "first_token_id", "first_logprob", "num_cached_tokens", "stats", "checksum", "prompt_logprobs")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    error: _common_pb2.ErrorDetail
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    num_cached_tokens: int
    stats: TransferStats
    checksum: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, transfer_id: _Optional[str] = ..., error: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., stats: _Optional[_Union[TransferStats, _Mapping]] = ..., checksum: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("running", "waiting", "pages_used", "pages_total", "transfers_in_flight", "pages_cached", "metrics_url", "queued", "quarantined_pages", "quarantined_slots", "rank_states", "compat")
    class PagesUsedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PagesTotalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PagesCachedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class QuarantinedPagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RANK_STATES_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    pages_used: _containers.ScalarMap[str, int]
    pages_total: _containers.ScalarMap[str, int]
    transfers_in_flight: int
    pages_cached: _containers.ScalarMap[str, int]
    metrics_url: str
    queued: int
    quarantined_pages: _containers.ScalarMap[str, int]
    quarantined_slots: int
    rank_states: _containers.RepeatedScalarFieldContainer[str]
    compat: _common_pb2.CompatDescriptor
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., pages_used: _Optional[_Mapping[str, int]] = ..., pages_total: _Optional[_Mapping[str, int]] = ..., transfers_in_flight: _Optional[int] = ..., pages_cached: _Optional[_Mapping[str, int]] = ..., metrics_url: _Optional[str] = ..., queued: _Optional[int] = ..., quarantined_pages: _Optional[_Mapping[str, int]] = ..., quarantined_slots: _Optional[int] = ..., rank_states: _Optional[_Iterable[str]] = ..., compat: _Optional[_Union[_common_pb2.CompatDescriptor, _Mapping]] = ...) -> None: ...

class CallFrame(_message.Message):
    __slots__ = ("call_id", "prefill", "generate", "cancel", "timeout_ms", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    prefill: PrefillRequest
    generate: GenerateRequest
    cancel: bool
    timeout_ms: int
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, call_id: _Optional[int] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., timeout_ms: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CallFrames(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[CallFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[CallFrame, _Mapping]]] = ...) -> None: ...

class ReplyFrame(_message.Message):
    __slots__ = ("call_id", "prefill", "chunk", "end", "status_code", "status_details", "trailing_metadata")
    class TrailingMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    prefill: PrefillResponse
    chunk: GenerateChunk
    end: bool
    status_code: int
    status_details: str
    trailing_metadata: _containers.ScalarMap[str, bytes]
    def __init__(self, call_id: _Optional[int] = ..., prefill: _Optional[_Union[PrefillResponse, _Mapping]] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., end: _Optional[bool] = ..., status_code: _Optional[int] = ..., status_details: _Optional[str] = ..., trailing_metadata: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class ReplyFrames(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[ReplyFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[ReplyFrame, _Mapping]]] = ...) -> None: ...
