"""A call tried again while it fails in a way that may pass: for the idempotent calls that
end a KV lease (ReleaseKv, AbortPrefill), where one failed try would leave the lease held,
its blocks unusable, until it expires on the worker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

T = TypeVar("T")
# What a loaded or briefly unreachable worker answers: worth another try.
PASSING = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                     grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})
FIRST_S, LAST_S = 0.1, 2.0  # the wait before the second try, doubling up to LAST_S


async def retried(call: Callable[[], Awaitable[T]], again: Callable[[Exception], bool],
                  for_s: float) -> T:
    """`call()`'s result; after a failure `again(e)` accepts, the same call once more,
    backing off, for up to `for_s` seconds in all; past that, or on a failure it refuses,
    that failure is raised."""
    loop = asyncio.get_running_loop()
    give_up, delay = loop.time() + for_s, FIRST_S
    while True:
        try:
            return await call()
        except Exception as e:  # noqa: BLE001 - `again` says which are passing
            if not again(e) or loop.time() + delay > give_up:
                raise
        await asyncio.sleep(delay)
        delay = min(2 * delay, LAST_S)
