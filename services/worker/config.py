"""A worker's settings beyond its engine's (the CLI's flag table fills them; defaults live
here and in EngineConfig only). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.services.engine.config import EngineConfig
from baton.services.rpc.config import ServiceConfig


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    service: ServiceConfig = field(default_factory=lambda: ServiceConfig("0.0.0.0:50061"))
    engine_id: str = ""  # unique per process start: the CLI adds a random suffix
    kv_transport: str | None = None  # "nixl" or "grpc"; the CLI picks NIXL when it loads
    max_queue: int | None = None  # waiting requests; default 4 x max_num_seqs
    threads: int | None = None  # torch intra-op threads; default torch's choice
    inject_kv_failure: str | None = None  # test hook: every KV pull fails with this
    # A step (or call) on the engine thread that has not ended after this many seconds
    # means a hung kernel or a stuck lock: health NOT_SERVING until it ends. Long enough
    # for a legitimate slow step: a first decode may build the CPU kernel.
    engine_stall_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue!r}")
        if self.engine_stall_timeout <= 0:
            raise ValueError(f"engine_stall_timeout must be > 0, got "
                             f"{self.engine_stall_timeout!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")

    @property
    def max_waiting(self) -> int:
        return self.max_queue if self.max_queue is not None else 4 * self.engine.max_num_seqs
