"""The one place that decides when the router releases a prefill worker's lease.

A prefill worker holds a request's KV under a lease until somebody releases it. Once a
decode worker has answered with the handle, the lease is that worker's business: it
pulls, confirms the lease and releases it itself (or, on failure, the lease expires).
Until then the router owns it. So the router releases it, naming the lease the handle
gave, on every way out that leaves the handle with nobody:

    the client left or its deadline passed before a decode worker answered
    no decode worker could take the request (or none can pull from that prefill engine:
      the request then recomputes elsewhere, `give_up`)

A Prefill call that failed or was cancelled leaves no handle, and no release: a worker
takes a release only for the lease a handle names (none "by request id", which would let
a caller end leases it never saw). The prefill worker cleans up itself: a call cancelled
(or past its deadline) before it answered aborts the request there, lease and all; and
if the answer was lost on the way, the lease expires (--kv-lease-timeout).

A decode worker that fails before answering leaves the handle to the next one (the
lease check makes a second pull safe even if the first had started).
"""

from __future__ import annotations

import asyncio
import logging

from baton.v1 import worker_pb2 as wk
from router.clients import WorkerError

log = logging.getLogger(__name__)

_PENDING: set[asyncio.Task] = set()  # keeps fire-and-forget releases alive until done


def release_soon(client, request_id: str, lease_id: int) -> None:
    """Release in the background: idempotent on the worker; a failure leaves the lease to
    expire there."""

    async def release():
        try:
            await client.release(request_id, lease_id)
        except WorkerError as e:
            log.warning("release of %s on %s failed: %s", request_id, client.address, e)

    task = asyncio.get_running_loop().create_task(release())
    _PENDING.add(task)
    task.add_done_callback(_PENDING.discard)


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
