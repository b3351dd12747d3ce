"""A bounded queue that is full, said without gRPC, so the engine can raise it: the
server shell (services/rpc/server.py) answers RESOURCE_EXHAUSTED with the retry
hint, the HTTP API 429 with Retry-After."""

from __future__ import annotations

RETRY_AFTER_S = 1.0  # the default hint


class AtCapacity(Exception):
    """A queue is full: the caller should come back after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = RETRY_AFTER_S):
        super().__init__(f"{message}; retry after {retry_after_s:.1f}s")
        self.retry_after_s = retry_after_s
