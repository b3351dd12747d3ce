"""What every service's settings share, router and workers alike: where it listens, how
long it drains, its TLS files and cluster token, its metrics port and where its traces
go. Torch-free; the CLI's flag table fills it (defaults live here only)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

DRAIN_GRACE_S = 30.0  # on SIGTERM, how long in-flight work may take (every service)
MIN_CLUSTER_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """Whether only this machine reaches `host` (a name other than localhost may resolve
    to anything, so it is not)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServiceConfig:
    address: str = "127.0.0.1:50051"  # a role that must be reached says where (the CLI)
    drain_grace: float = DRAIN_GRACE_S
    # TLS. A worker with a CA file asks every caller for a certificate signed by it
    # (mutual TLS); the router's public port never does (clients bring API keys). The
    # same certificate and key identify the service when it calls others.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    # The name the workers' certificates carry, checked instead of the address dialed (a
    # worker found by DNS is dialed by its IP): gRPC's ssl_target_name_override.
    tls_server_name: str | None = None
    # The cluster's shared secret: a worker takes calls only from callers that send it,
    # and a prefill worker proves it holds it in the handshake. Given inline or as a file
    # (one line); never shown in a repr.
    cluster_token: str | None = field(default=None, repr=False)
    cluster_token_file: str | None = None
    metrics_port: int = 0  # Prometheus /metrics on this HTTP port; 0: none
    # Where /metrics listens: this host (default: the host of `address`, so metrics are
    # never more exposed than the service), over TLS when the service has a certificate.
    metrics_host: str | None = None
    # host:port of an OTLP gRPC collector (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)
    otlp_traces_endpoint: str | None = None
    otlp_insecure: bool = False  # plaintext to the collector (default: TLS, as OTel's)

    def __post_init__(self) -> None:
        if self.drain_grace < 0:
            raise ValueError(f"drain_grace must be >= 0, got {self.drain_grace!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("tls_ca needs tls_cert and tls_key (mutual TLS)")
        if self.tls_server_name is not None and (
                not self.tls_server_name.strip() or not (self.tls_cert or self.tls_ca)):
            raise ValueError(f"tls_server_name {self.tls_server_name!r}: a host name, and "
                             f"only with TLS (tls_cert, tls_key)")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path!r}")
        self.cluster_secret()  # raises if the token is unusable
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be a port, got {self.metrics_port!r}")
        if self.metrics_host is not None and not self.metrics_host.strip("[] "):
            raise ValueError(f"metrics_host must be a host, got {self.metrics_host!r}")

    @property
    def host(self) -> str:
        """The host part of `address` ("0.0.0.0" when it names none)."""
        return self.address.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"

    @property
    def local_only(self) -> bool:
        """Whether only this machine can reach `address`: a loopback host or a unix
        socket."""
        return self.address.startswith(("unix:", "unix-abstract:")) or \
            is_loopback(self.host)

    @property
    def checks_callers(self) -> bool:
        """Whether, as a worker, it tells its cluster from strangers: a cluster token, or
        certificates checked against --tls-ca (mutual TLS)."""
        return bool(self.tls_ca or self.cluster_token or self.cluster_token_file)

    @property
    def metrics_bind(self) -> str:
        """Where the /metrics port listens."""
        return (self.metrics_host or "").strip("[]") or self.host

    def cluster_secret(self) -> str | None:
        """The cluster token, from `cluster_token` or `cluster_token_file`; None if unset.
        ValueError (never quoting the token) when it cannot serve as one."""
        if self.cluster_token and self.cluster_token_file:
            raise ValueError("cluster_token and cluster_token_file: give one, not both")
        token = self.cluster_token
        if self.cluster_token_file:
            path = Path(self.cluster_token_file)
            if not path.is_file():
                raise ValueError(f"cluster_token_file: no such file {str(path)!r}")
            token = path.read_text().strip()
        if not token:
            if self.cluster_token_file:
                raise ValueError(f"cluster_token_file: {self.cluster_token_file!r} is empty")
            return None
        if len(token) < MIN_CLUSTER_TOKEN_CHARS:
            raise ValueError(f"cluster token: at least {MIN_CLUSTER_TOKEN_CHARS} characters "
                             f"are needed, got {len(token)}")
        if not (token.isascii() and token.isprintable()) or " " in token:
            raise ValueError("cluster token: printable ASCII without spaces only (it "
                             "travels in gRPC metadata)")
        return token
