"""The one place that decides when the router releases a prefill worker's lease.

A prefill worker holds a request's KV under a lease until somebody releases it. Once a
decode worker has answered with the handle, the lease is that worker's business: it
releases it once, whatever happens (decode_worker/peers.py), or, if it dies, the lease
expires. Until then the router owns it. So the router releases it, naming the lease the
handle gave, on every way out that leaves the handle with nobody (the whole life of a
lease: docs/structures.md):

    the client left or its deadline passed before a decode worker answered
    no decode worker could take the request (or none can pull from that prefill engine:
      the request then recomputes elsewhere, `give_up`)

A Prefill call that ended without its answer in the router's hands (its deadline passed,
the client left, it failed) may still have granted a lease: the worker finished just as
the call ended, and its answer never arrived. Nobody else can know, so the router asks the
worker to end whatever lease the request holds (AbortPrefill, `lost`), unless the worker
refused the request before taking it (RESOURCE_EXHAUSTED). ReleaseKv takes only the lease
a handle names; AbortPrefill, by request id, only a cluster member may call.

A decode worker that fails before answering leaves the handle to the next one (the
lease check makes a second pull safe even if the first had started).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine

import grpc

from baton.services.rpc.retry import PASSING, retried
from baton.worker.v1 import worker_pb2 as wk

from .clients import WorkerError

log = logging.getLogger(__name__)

_PENDING: set[asyncio.Task] = set()  # keeps fire-and-forget releases alive until done
ABORT_TIMEOUT_S = 2.0  # one AbortPrefill try
# A release or abort that failed on the way (its deadline passed on a worker too loaded to
# answer in time, a connection being remade) is tried again for up to RETRY_FOR_S, the
# default lease timeout, past which the worker has ended the lease itself.
RETRY_FOR_S = 30.0


def _soon(what: str, client, request_id: str, call: Callable[[], Coroutine]) -> None:
    """`call()` in the background, idempotent on the worker, tried again while it fails
    in a passing way (services/rpc/retry.py) and the worker is still in the registry; a
    lease whose end never landed expires there."""

    def again(e: Exception) -> bool:
        return isinstance(e, WorkerError) and e.code in PASSING and not client.retired

    async def run():
        try:
            await retried(call, again, RETRY_FOR_S)
        except WorkerError as e:
            log.warning("%s of %s on %s failed: %s; the lease is left to expire", what,
                        request_id, client.address, e)

    task = asyncio.get_running_loop().create_task(run())
    _PENDING.add(task)
    task.add_done_callback(_PENDING.discard)


def release_soon(client, request_id: str, lease_id: int) -> None:
    _soon("release", client, request_id, lambda: client.release(request_id, lease_id))


def abort_soon(client, request_id: str) -> None:
    _soon("abort", client, request_id,
          lambda: client.abort_prefill(request_id, ABORT_TIMEOUT_S))


class PrefillLease:
    """A request's lease on one prefill worker, while the router owns it.

        live      the worker answered with a handle: a decode worker may take it
        none      nothing held (no worker, the first token ended the request, or a
                  decode worker took the handle over, or it was released)
    """

    def __init__(self, worker, request_id: str):
        self.worker = worker
        self.request_id = request_id
        self.handle: wk.KvHandle | None = None

    def granted(self, handle: wk.KvHandle | None) -> None:
        """The Prefill call answered: with the handle it holds KV under, or none."""
        self.handle = handle if handle is not None and handle.engine_id else None

    @property
    def live(self) -> bool:
        """The router holds a handle to give a decode worker."""
        return self.handle is not None

    @property
    def engine_id(self) -> str | None:
        return self.handle.engine_id if self.handle is not None else None

    def taken_over(self) -> None:
        """A decode worker answered with the handle: the lease is its business now."""
        self.handle = None

    def lost(self, code: grpc.StatusCode | None) -> None:
        """The Prefill call ended without its answer in our hands: `code` its status, None
        if the router left it (the client left)."""
        if self.worker is not None and code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            abort_soon(self.worker.client, self.request_id)
        self.handle = None

    def give_up(self) -> None:
        """Nobody will pull it: release it now (without a handle there is nothing the
        router may release: see above)."""
        if self.handle is not None:
            release_soon(self.worker.client, self.request_id, self.handle.lease_id)
        self.handle = None

    async def __aenter__(self) -> PrefillLease:
        return self

    async def __aexit__(self, *exc) -> None:
        self.give_up()
