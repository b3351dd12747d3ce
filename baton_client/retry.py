"""When a failed call is tried again, and after how long; and deadlines as clock times."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc

from baton_client.errors import BatonError

RETRYABLE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class RetryPolicy:
    """Retry RESOURCE_EXHAUSTED and UNAVAILABLE after the server's hint (without one:
    `default_delay_s`, doubling each attempt), at most `max_delay_s`, plus up to `jitter`
    of it at random (never less than the hint), at most `max_retries` times, and never
    when the sleep would reach the deadline."""

    max_retries: int = 3
    max_delay_s: float = 10.0
    default_delay_s: float = 0.5
    jitter: float = 0.2

    def __post_init__(self):
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries!r}")

    def delay(self, error: BatonError, attempt: int, deadline: float | None) -> float | None:
        """Seconds to sleep before retry number `attempt` + 1, or None: do not retry."""
        if error.code not in RETRYABLE or attempt >= self.max_retries:
            return None
        base = error.retry_after_s
        if base is None:
            base = self.default_delay_s * 2 ** attempt
        delay = min(base, self.max_delay_s) * (1 + self.jitter * random.random())
        if deadline is not None and time.monotonic() + delay >= deadline:
            return None
        return delay


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    """The gRPC timeout that ends a call at `deadline`."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
