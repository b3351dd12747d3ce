"""The router's settings (the CLI's flag table fills them; defaults live here only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.services.common.limits import Limits
from baton.services.lora.names import parse_lora_module
from baton.services.rpc.config import ServiceConfig

from .chat import ChatSettings
from .discovery import Target
from .policy import (
    DISAGGREGATION,
    DISK_WEIGHT,
    HOST_WEIGHT,
    LOCAL_PREFILL_QUEUE,
    LOCAL_PREFILL_TOKENS,
    Policy,
)


@dataclass(frozen=True)
class RouterConfig:
    service: ServiceConfig = field(default_factory=lambda: ServiceConfig("0.0.0.0:50051"))
    prefill: tuple[str, ...] = ()  # prefill worker addresses, or dns:///name:port
    decode: tuple[str, ...] = ()  # decode worker addresses, or dns:///name:port
    discovery_interval: float = 2.0  # seconds between lookups of dns:/// names
    # A name that answers nothing (NXDOMAIN, no records) keeps the workers it had this
    # many seconds before they retire: one bad answer must not empty the cluster.
    discovery_grace: float = 10.0
    routing: str = "kv"  # "kv": cached prefix against load; "load": load alone
    kv_overlap_weight: float = 1.0  # the cost of a prompt token the worker lacks
    # What a block in a worker's host (shared memory) or disk tier counts for, against 1
    # for one in its pool (router/policy.py says why these).
    kv_host_weight: float = HOST_WEIGHT
    kv_disk_weight: float = DISK_WEIGHT
    load_weight: float = 64.0  # the cost of a unit of load, in prompt tokens
    # Where a prompt is computed (router/policy.py): "auto" weighs each prompt (its
    # uncached length, the prefill workers' queue); "always" on a prefill worker (a
    # decode worker only when none can); "never" on the decode worker that streams it.
    disaggregation: str = "auto"
    local_prefill_tokens: int = LOCAL_PREFILL_TOKENS  # auto: decode prefills what lacks <= this
    local_prefill_hit: float = 0.9  # ... or holds this share of the prompt (0: never)
    # auto: ... or the prefill workers' queued prompt tokens exceed the decode worker's
    # by this many times (its prefill slows its own streams: 0 turns this off)
    local_prefill_queue: float = LOCAL_PREFILL_QUEUE
    # SLOs the router counts misses of (baton:slo_misses_total): a request's time to
    # first token, and its mean time per output token after the first (0: none).
    slo_ttft_ms: float = 0.0
    slo_itl_ms: float = 0.0
    model: str | None = None  # where the tokenizer comes from (default: the default model)
    tokenizer: str | None = None  # a tokenizer folder or hub id instead of the model's
    revision: str | None = None  # of a hub id
    tokenizer_revision: str | None = None  # of a --tokenizer hub id
    chat_template: str | None = None  # a jinja file or inline template; None: the tokenizer's
    # The defaults of unset sampling values, as the workers take them (the router checks
    # a request as they will run it): "auto" (the model's), "none", or a folder.
    generation_config: str = "auto"
    # A chat message's text that spells a special token is that control token (vLLM's
    # way); False: plain text (services/common/plain_content.py).
    allow_special_tokens_in_content: bool = False
    tool_call_parser: str | None = None  # finds tool calls in text (tool_choice "auto")
    enable_auto_tool_choice: bool = False  # tool_choice "auto" served (needs the parser)
    reasoning_parser: str | None = None  # splits a chat's reasoning from its answer
    max_inflight: int = 256  # requests in flight at once; past it, RESOURCE_EXHAUSTED
    limits: Limits = field(default_factory=Limits)  # the size of one request
    # Before admission (router/unparsed.py, router/openai/server.py): what callers may
    # hold of the router before their requests count against max_inflight.
    max_unparsed_bytes: int = 512 * 1024 * 1024  # read, not yet parsed, all requests
    max_parses_per_key: int = 1  # parses in flight per API key; its others wait
    max_http_connections: int | None = None  # None: 4 x max_inflight
    max_grpc_calls: int | None = None  # calls at once, any method; None: 4 x max_inflight
    http_header_timeout: float = 20.0  # seconds to send a request's headers
    http_body_timeout: float = 60.0  # seconds to send a request's body, once its headers are in
    request_timeout: float = 600.0  # the deadline of a request whose client set none
    # A stream whose client reads nothing this long (its buffers full) is cut, and its
    # request aborted: a stalled reader holds no KV blocks.
    stream_stall_timeout: float = 30.0
    poll_interval: float = 0.5  # seconds between stats polls of every worker
    worker_timeout: float = 3.0  # a worker silent this long is down (dead or frozen)
    http_port: int = 8000  # the OpenAI-compatible API and /metrics; 0: none (vLLM's port)
    served_model_name: str | None = None  # the model's name in the OpenAI API
    # Callers must bring one of these; none: anyone. Never shown in a repr.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_key_file: str | None = None  # more keys, one a line
    # With keys, each key's callers have a prefix cache of their own; True: one for all.
    shared_prefix_cache: bool = False
    enable_lora: bool = False  # LoRA adapters served (requests name them; loaded at run time)
    lora_modules: tuple[str, ...] = ()  # "name=path" served from the start
    allow_runtime_lora_updating: bool = False  # the load and unload routes and RPCs
    # The directory a run-time load's path must lie beneath (services/lora/paths.py);
    # the load routes need it. --lora-modules, the operator's, may lie anywhere.
    lora_root: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_inflight", "request_timeout", "stream_stall_timeout",
                     "poll_interval", "worker_timeout", "max_unparsed_bytes",
                     "max_parses_per_key", "http_header_timeout", "http_body_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be a port, got {self.http_port!r}")
        if self.routing not in ("kv", "load"):
            raise ValueError(f"routing must be kv or load, got {self.routing!r}")
        if self.discovery_interval <= 0:
            raise ValueError(f"discovery_interval must be > 0, got {self.discovery_interval}")
        if self.discovery_grace < 0:
            raise ValueError(f"discovery_grace must be >= 0, got {self.discovery_grace!r}")
        for name in ("max_http_connections", "max_grpc_calls"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.disaggregation not in DISAGGREGATION:
            raise ValueError(f"disaggregation must be one of {DISAGGREGATION}, got "
                             f"{self.disaggregation!r}")
        for name in ("kv_overlap_weight", "load_weight", "local_prefill_tokens",
                     "local_prefill_queue", "slo_ttft_ms", "slo_itl_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("local_prefill_hit", "kv_host_weight", "kv_disk_weight"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        for role in ("prefill", "decode"):
            self.targets(role)  # a bad address fails at start-up, naming it
        self.chat_settings()  # an unknown parser fails at start-up, naming it
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        for spec in self.lora_modules:
            parse_lora_module(spec)
        if self.allow_runtime_lora_updating and not self.lora_root:
            raise ValueError("allow_runtime_lora_updating needs lora_root: the directory "
                             "that adapters loaded at run time must lie beneath")

    def http_connections(self) -> int:
        return self.max_http_connections or 4 * self.max_inflight

    def grpc_calls(self) -> int:
        return self.max_grpc_calls or 4 * self.max_inflight

    def chat_settings(self) -> ChatSettings:
        return ChatSettings(self.tool_call_parser, self.enable_auto_tool_choice,
                            self.reasoning_parser)

    def targets(self, role: str) -> list[Target]:
        try:
            return [Target.parse(a) for a in getattr(self, role)]
        except ValueError as e:
            raise ValueError(f"--{role}: {e}") from None

    def policy(self) -> Policy:
        kv = self.routing == "kv"
        return Policy(kv_weight=self.kv_overlap_weight if kv else 0.0,
                      load_weight=self.load_weight, host_weight=self.kv_host_weight,
                      disk_weight=self.kv_disk_weight,
                      disaggregation=self.disaggregation,
                      local_prefill_tokens=self.local_prefill_tokens,
                      local_prefill_hit=self.local_prefill_hit if kv else 0.0,
                      local_prefill_queue=self.local_prefill_queue)
