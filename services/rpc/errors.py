"""What a handler raises instead of aborting by hand. The server's one interceptor
(services/rpc/server.py) turns each into its gRPC status code:

    ServiceError subclass        its `code` (below)
    AtCapacity                   RESOURCE_EXHAUSTED (capacity.py: the engine's full queues)
    IncompatibleLayout           FAILED_PRECONDITION (KV layouts differ)
    NotFound (common/errors.py)  NOT_FOUND (a LoRA adapter not served)
    ValueError, TypeError        INVALID_ARGUMENT (bad input; the message names the field)
    anything else                INTERNAL (logged with its traceback)

RESOURCE_EXHAUSTED always carries the retry hint, written once (`retry_metadata`): Baton's
own `retry-after-ms`, and gRPC's standard `grpc-retry-pushback-ms` that stock clients
with a retry policy honour.
"""

from __future__ import annotations

import grpc

from ..common.capacity import AtCapacity
from ..common.errors import NotFound


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Overloaded(AtCapacity, ServiceError):
    """AtCapacity raised by the shell (the router's or a worker's queue): its message and
    its hint are AtCapacity's."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """No worker can serve, a worker is draining, or a hop failed: try again elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(ServiceError):
    """A deliberate end (a KV pull failed under the "fail" policy): not to be retried."""

    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Missing(NotFound, ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL


# A status code as it comes back from a downstream call, as the error to raise here.
BY_CODE = {cls.code: cls for cls in (InvalidArgument, Overloaded, Unavailable,
                                     FailedPrecondition, Aborted, DeadlineExceeded,
                                     Unauthenticated, Missing, Internal)}


def retry_metadata(retry_after_s: float) -> tuple[tuple[str, str], ...]:
    ms = str(max(0, int(retry_after_s * 1000)))
    return (("retry-after-ms", ms), ("grpc-retry-pushback-ms", ms))


def retry_after_s(metadata) -> float | None:
    """The hint in a downstream call's trailing metadata, if any."""
    for key, value in metadata or ():
        if key in ("retry-after-ms", "grpc-retry-pushback-ms"):
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None
