"""The prefill engines a decode worker has shaken hands with, and the calls it makes to
them: the handshake, lease releases (on the event loop), and block reads for the gRPC
transport (on the receiver's threads).

This side releases the lease of every handle it is given once, on one of two paths:

    the pull landed ──> confirm: ReleaseKv, and its answer is the lease check
                        (kv_transfer/lease_check.py): held, the blocks are ours
    the load is over  ──> ReleaseKv in the background, unless a confirm released it:
    (the request's first     no pull, a failed or abandoned one, a failed or cancelled
     output, or the call's   call (a second ReleaseKv would be harmless: a lease id is
     end: `holding`)         never granted again, so it would answer released=False)

Channels and locks are bounded: an address has a channel while its peer is known or a
handshake with it is under way, and a lock only while a handshake holds or awaits it; at
most MAX_PEERS peers are known (the one known longest goes first: it shakes hands again
when next asked)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import Future
from contextlib import asynccontextmanager, contextmanager

import grpc

from baton.kv_transfer.base import KVHandle
from baton.services.rpc.retry import PASSING, retried
from baton.services.rpc.security import Security
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc

log = logging.getLogger(__name__)

# A prefill worker that does not confirm a lease in this time is treated as gone (dead or
# frozen): the pull fails and the load-failure policy applies.
CONFIRM_TIMEOUT_S = 3.0
RELEASE_TIMEOUT_S = 10.0  # one try of a background release (services/rpc/retry.py)
RELEASE_FOR_S = 30.0  # its tries in all, at most (a handle's deadline may say less)
# Block reads over gRPC: a floor, plus time per block (a frozen source fails them too).
FETCH_BASE_S, FETCH_PER_BLOCK_S = 5.0, 0.05
MAX_PEERS = 1024


def _key(handle: KVHandle) -> tuple[str, str, int]:
    return handle.engine_id, handle.request_id, handle.lease_id


class Peers:
    def __init__(self, security: Security):
        self.security = security  # TLS to the prefill workers, when set
        self.address: dict[str, str] = {}  # engine id -> address
        self.by_address: dict[str, str] = {}  # address -> engine id
        # Engines that proved they belong to the cluster (the token, or mutual TLS): only
        # their KV may enter the prefix cache.
        self.verified: set[str] = set()
        self._aio: dict[str, tuple[grpc.aio.Channel, wk_grpc.PrefillServiceStub]] = {}
        self._sync: dict[str, grpc.Channel] = {}  # engine id -> channel (receiver threads)
        # address -> (its lock, handshakes holding or awaiting it)
        self._handshakes: dict[str, tuple[asyncio.Lock, int]] = {}
        # The handles of Decode calls in progress: whether a confirm released the lease.
        self._held: dict[tuple[str, str, int], bool] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the worker's event loop

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Lease confirmations run as RPCs on the worker's event loop, side by side."""
        self._loop = loop

    def stub(self, address: str) -> wk_grpc.PrefillServiceStub:
        if address not in self._aio:
            channel = self.security.aio_channel(address)
            self._aio[address] = (channel, wk_grpc.PrefillServiceStub(channel))
        return self._aio[address][1]

    @asynccontextmanager
    async def handshaking(self, address: str) -> AsyncIterator[None]:
        """One handshake with `address` at a time. When the last one ends and no peer is
        known there (it failed), its lock and channel go."""
        lock, users = self._handshakes.get(address, (asyncio.Lock(), 0))
        self._handshakes[address] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._handshakes[address]
            if users > 1:
                self._handshakes[address] = (lock, users - 1)
            else:
                del self._handshakes[address]
                if address not in self.by_address:
                    self._drop_stub(address)

    def add(self, engine_id: str, address: str, verified: bool = False) -> None:
        self.address[engine_id], self.by_address[address] = address, engine_id
        if verified:
            self.verified.add(engine_id)
        self._sync[engine_id] = self.security.channel(address)
        while len(self.by_address) > MAX_PEERS:
            oldest = next(iter(self.by_address))
            log.info("forgetting prefill engine %s at %s: over %d peers",
                     self.by_address[oldest], oldest, MAX_PEERS)
            self.forget(oldest)

    def forget(self, address: str) -> None:
        """Drop a peer (it restarted under a new engine id, or made room for another):
        shake hands again next time."""
        eid = self.by_address.pop(address, None)
        if eid is not None:
            self.address.pop(eid, None)
            self.verified.discard(eid)
            channel = self._sync.pop(eid, None)
            if channel is not None:
                channel.close()
        if address not in self._handshakes:  # else the handshake's end decides
            self._drop_stub(address)

    def _drop_stub(self, address: str) -> None:
        entry = self._aio.pop(address, None)
        if entry is not None:  # its calls in flight end (a lease then expires on its own)
            self._spawn(entry[0].close())

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- the receiver's threads ------------------------------------------------------

    def fetch(self, handle: KVHandle, block_ids: list[int], heads: range | None = None):
        """Block bytes over the gRPC transport (the source checks the lease around it):
        of the global KV heads `heads` (None: every head)."""
        stub = wk_grpc.WorkerServiceStub(self._channel(handle.engine_id))
        req = wk.ReadKvBlocksRequest(request_id=handle.request_id, lease_id=handle.lease_id,
                                     block_ids=block_ids)
        if heads is not None:
            req.head_start, req.head_count = heads.start, len(heads)
        timeout = FETCH_BASE_S + FETCH_PER_BLOCK_S * len(block_ids)
        for msg in stub.ReadKvBlocks(req, timeout=timeout):
            yield msg.data

    def confirm(self, handle: KVHandle) -> Future:
        """After a pull: release the lease at the source; the future says whether it was
        still held. Called from the engine thread; the RPC runs on the event loop."""
        if self._loop is None:
            raise RuntimeError("Peers.bind(loop) comes first (the servicer calls it)")
        return asyncio.run_coroutine_threadsafe(self._confirm(handle), self._loop)

    def _channel(self, engine_id: str) -> grpc.Channel:
        channel = self._sync.get(engine_id)
        if channel is None:
            raise ConnectionError(f"unknown peer {engine_id!r}")
        return channel

    # ---- the event loop --------------------------------------------------------------

    @contextmanager
    def holding(self, handle: KVHandle) -> Iterator[Callable[[], None]]:
        """A Decode call's hold on `handle`, from its start to its end. Yields `over`, to
        call when the load is over (the request's first output); the end calls it too.
        The first call releases the lease, unless a confirm did."""
        key, ended = _key(handle), False
        self._held[key] = False

        def over() -> None:
            nonlocal ended
            if not ended:
                ended = True
                if not self._held.pop(key, False):
                    self._spawn(self._release_quietly(handle))

        try:
            yield over
        finally:
            over()

    async def _confirm(self, handle: KVHandle) -> bool:
        released = await self._release(handle, CONFIRM_TIMEOUT_S)
        if _key(handle) in self._held:
            self._held[_key(handle)] = True
        return released

    async def _release_quietly(self, handle: KVHandle) -> None:
        def again(e: Exception) -> bool:
            return isinstance(e, grpc.aio.AioRpcError) and e.code() in PASSING

        # Tried again while it fails in a passing way, until the lease would have ended.
        left = min(RELEASE_FOR_S, handle.deadline - time.monotonic())
        try:
            await retried(lambda: self._release(handle, RELEASE_TIMEOUT_S), again, left)
        except ConnectionError:  # a peer we do not know: nothing of it to release
            pass
        except grpc.aio.AioRpcError as e:  # the lease expires on its own
            log.warning("release of %s on %s failed: %s", handle.request_id,
                        handle.engine_id, e.code())

    async def _release(self, handle: KVHandle, timeout: float) -> bool:
        """The one ReleaseKv this side sends: True iff the lease was still held."""
        address = self.address.get(handle.engine_id)
        if address is None:
            raise ConnectionError(f"unknown peer {handle.engine_id!r}")
        reply = await self.stub(address).ReleaseKv(
            wk.ReleaseKvRequest(request_id=handle.request_id, lease_id=handle.lease_id),
            timeout=timeout)
        return reply.released

    def close(self) -> None:
        for channel in self._sync.values():
            channel.close()
        self._sync.clear()
