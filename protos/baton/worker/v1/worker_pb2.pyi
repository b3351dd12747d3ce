from baton.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    version: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "fingerprint", "cache_layout", "kv_scales", "tp_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CACHE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    fingerprint: str
    cache_layout: str
    kv_scales: str
    tp_size: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., fingerprint: _Optional[str] = ..., cache_layout: _Optional[str] = ..., kv_scales: _Optional[str] = ..., tp_size: _Optional[int] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("engine_id", "request_id", "lease_id", "block_ids", "num_tokens", "fingerprint", "lease_s")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    lease_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    fingerprint: str
    lease_s: float
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., fingerprint: _Optional[str] = ..., lease_s: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "cache_salt", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    priority: int
    cache_salt: str
    lora: LoraAdapter
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("delta", "handle", "cached_tokens", "timings")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    delta: _generation_pb2.TokenDelta
    handle: KvHandle
    cached_tokens: int
    timings: _generation_pb2.Timings
    def __init__(self, delta: _Optional[_Union[_generation_pb2.TokenDelta, _Mapping]] = ..., handle: _Optional[_Union[KvHandle, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[_generation_pb2.Timings, _Mapping]] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("request_id", "lease_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: int
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[int] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class AbortPrefillRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortPrefillResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("engine_id", "layout", "nonce")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    layout: KvLayout
    nonce: bytes
    def __init__(self, engine_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("engine_id", "layout", "transport", "transport_metadata", "proof")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    layout: KvLayout
    transport: str
    transport_metadata: bytes
    proof: bytes
    def __init__(self, engine_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., transport: _Optional[str] = ..., transport_metadata: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "sampling", "priority", "cache_salt", "handle", "prefill_address", "output_token_ids", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _generation_pb2.SamplingParams
    priority: int
    cache_salt: str
    handle: KvHandle
    prefill_address: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora: LoraAdapter
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., handle: _Optional[_Union[KvHandle, _Mapping]] = ..., prefill_address: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("delta", "cached_tokens", "timings")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    delta: _generation_pb2.TokenDelta
    cached_tokens: int
    timings: _generation_pb2.Timings
    def __init__(self, delta: _Optional[_Union[_generation_pb2.TokenDelta, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[_generation_pb2.Timings, _Mapping]] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("prefill_address",)
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    prefill_address: str
    def __init__(self, prefill_address: _Optional[str] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("prefill_engine_id", "transport")
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    prefill_engine_id: str
    transport: str
    def __init__(self, prefill_engine_id: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("engine_id", "role", "num_waiting", "num_running", "num_loading", "num_leases", "num_blocks", "num_free_blocks", "num_blocks_pulled", "num_blocks_local", "model_info", "layout", "num_load_failures", "num_leases_expired", "draining", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_prompt_tokens", "num_generation_tokens", "num_spec_drafts", "num_spec_draft_tokens", "num_spec_accepted_tokens", "engine_stalled_since", "lora_adapters", "kv_offload", "num_queued_prefill_tokens")
    class KvOffloadEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADING_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_LOCAL_FIELD_NUMBER: _ClassVar[int]
    MODEL_INFO_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STALLED_SINCE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: str
    num_waiting: int
    num_running: int
    num_loading: int
    num_leases: int
    num_blocks: int
    num_free_blocks: int
    num_blocks_pulled: int
    num_blocks_local: int
    model_info: _generation_pb2.ModelInfo
    layout: KvLayout
    num_load_failures: int
    num_leases_expired: int
    draining: bool
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_spec_drafts: int
    num_spec_draft_tokens: int
    num_spec_accepted_tokens: int
    engine_stalled_since: float
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    kv_offload: _containers.ScalarMap[str, int]
    num_queued_prefill_tokens: int
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_loading: _Optional[int] = ..., num_leases: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks_pulled: _Optional[int] = ..., num_blocks_local: _Optional[int] = ..., model_info: _Optional[_Union[_generation_pb2.ModelInfo, _Mapping]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_load_failures: _Optional[int] = ..., num_leases_expired: _Optional[int] = ..., draining: _Optional[bool] = ..., num_preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_generation_tokens: _Optional[int] = ..., num_spec_drafts: _Optional[int] = ..., num_spec_draft_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ..., engine_stalled_since: _Optional[float] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., kv_offload: _Optional[_Mapping[str, int]] = ..., num_queued_prefill_tokens: _Optional[int] = ...) -> None: ...

class LoadLoraRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class LoadLoraResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadLoraRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoraResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class ReadKvBlocksRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "block_ids", "head_start", "head_count")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    head_start: int
    head_count: int
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., head_start: _Optional[int] = ..., head_count: _Optional[int] = ...) -> None: ...

class ReadKvBlocksResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class GetKvEventsRequest(_message.Message):
    __slots__ = ("engine_id", "after")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    after: int
    def __init__(self, engine_id: _Optional[str] = ..., after: _Optional[int] = ...) -> None: ...

class GetKvEventsResponse(_message.Message):
    __slots__ = ("engine_id", "seq", "snapshot", "stored", "removed", "block_size", "enabled", "tiers")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    enabled: bool
    tiers: _containers.RepeatedCompositeFieldContainer[KvTierEvents]
    def __init__(self, engine_id: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ..., enabled: _Optional[bool] = ..., tiers: _Optional[_Iterable[_Union[KvTierEvents, _Mapping]]] = ...) -> None: ...

class KvTierEvents(_message.Message):
    __slots__ = ("medium", "stored", "removed")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    medium: str
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, medium: _Optional[str] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ...) -> None: ...
