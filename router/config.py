"""The router's settings (the CLI's flag table fills them; defaults live here only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.serving.config import ServiceConfig


@dataclass(frozen=True)
class RouterConfig:
    service: ServiceConfig = field(default_factory=lambda: ServiceConfig("0.0.0.0:50051"))
    prefill: tuple[str, ...] = ()  # prefill worker addresses
    decode: tuple[str, ...] = ()  # decode worker addresses
    model: str | None = None  # where the tokenizer comes from (default: the default model)
    max_inflight: int = 256  # requests in flight at once; past it, RESOURCE_EXHAUSTED
    request_timeout: float = 600.0  # the deadline of a request whose client set none
    poll_interval: float = 0.5  # seconds between stats polls of every worker
    worker_timeout: float = 3.0  # a worker silent this long is down (dead or frozen)
    http_port: int = 8000  # the OpenAI-compatible API and /metrics; 0: none (vLLM's port)
    served_model_name: str | None = None  # the model's name in the OpenAI API
    api_keys: tuple[str, ...] = ()  # callers must bring one of these; none: anyone
    api_key_file: str | None = None  # more keys, one a line

    def __post_init__(self) -> None:
        for name in ("max_inflight", "request_timeout", "poll_interval", "worker_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be a port, got {self.http_port!r}")
