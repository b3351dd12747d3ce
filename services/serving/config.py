"""What every service's settings share, router and workers alike: where it listens, how
long it drains, its TLS files, its metrics port and where its traces go. Torch-free;
the CLI's flag table fills it (defaults live here only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DRAIN_GRACE_S = 30.0  # on SIGTERM, how long in-flight work may take (every service)


@dataclass(frozen=True)
class ServiceConfig:
    address: str = "0.0.0.0:50051"
    drain_grace: float = DRAIN_GRACE_S
    # TLS. A worker with a CA file asks every caller for a certificate signed by it
    # (mutual TLS); the router's public port never does (clients bring API keys). The
    # same certificate and key identify the service when it calls others.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    metrics_port: int = 0  # Prometheus /metrics on this HTTP port; 0: none
    otlp_traces_endpoint: str | None = None  # host:port of an OTLP gRPC collector

    def __post_init__(self) -> None:
        if self.drain_grace < 0:
            raise ValueError(f"drain_grace must be >= 0, got {self.drain_grace!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("tls_ca needs tls_cert and tls_key (mutual TLS)")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path!r}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be a port, got {self.metrics_port!r}")
