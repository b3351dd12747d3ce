"""The one exception the client raises for a failed call, with the server's retry hint."""

from __future__ import annotations

import grpc

HINT_KEYS = ("retry-after-ms", "grpc-retry-pushback-ms")  # Baton's own first


class BatonError(Exception):
    """A call that failed with a gRPC status.

    `code` is a `grpc.StatusCode` (an attribute, not a method as on `grpc.RpcError`, which
    is why this is a plain Exception: code written for RpcError would call `e.code()`);
    `details` is the server's message; `retry_after_s` is its retry hint in seconds, or
    None when it sent none. The gRPC error itself is `__cause__`.
    """

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, error: grpc.RpcError) -> BatonError:
        """From the error a stub raised (sync or grpc.aio)."""
        code = error.code() if callable(getattr(error, "code", None)) else None
        details = error.details() if callable(getattr(error, "details", None)) else None
        trailing = (error.trailing_metadata()
                    if callable(getattr(error, "trailing_metadata", None)) else None)
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(error), retry_hint(trailing))


def retry_hint(metadata) -> float | None:
    """Seconds from `retry-after-ms` (else `grpc-retry-pushback-ms`) in trailing metadata."""
    values = dict(metadata or ())
    for key in HINT_KEYS:
        try:
            return max(0.0, int(values[key]) / 1000)
        except (KeyError, TypeError, ValueError):
            continue
    return None
