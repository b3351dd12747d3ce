"""What both clients set up the same way: credentials, metadata and their checks."""

from __future__ import annotations

import grpc


def credentials(tls: bool, root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    """TLS credentials (the system roots unless `root_certificates`, PEM bytes, are given),
    or None for a plaintext channel."""
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    return timeout
