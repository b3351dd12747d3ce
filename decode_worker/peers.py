"""The prefill engines a decode worker has shaken hands with, and the calls it makes to
them: the handshake, lease confirmations and releases (on the event loop), and block
reads for the gRPC transport (on the receiver's threads).

Channels and locks are bounded: an address has a channel while its peer is known or a
handshake with it is under way, and a lock only while a handshake holds or awaits it; at
most MAX_PEERS peers are known (the one known longest goes first: it shakes hands again
when next asked)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import Future
from contextlib import asynccontextmanager

import grpc

from baton.v1 import worker_pb2 as wk
from baton.v1 import worker_pb2_grpc as wk_grpc
from kv_transfer.base import KVHandle
from services.serving.security import Security

log = logging.getLogger(__name__)

# A prefill worker that does not confirm a lease in this time is treated as gone (dead or
# frozen): the pull fails and the load-failure policy applies.
CONFIRM_TIMEOUT_S = 3.0
# Block reads over gRPC: a floor, plus time per block (a frozen source fails them too).
FETCH_BASE_S, FETCH_PER_BLOCK_S = 5.0, 0.05
MAX_CONFIRMED = 4096
MAX_PEERS = 1024


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
        # Leases a confirmation released, so the stream's own release is skipped. Bounded:
        # a stream that ended before its confirmation came back never takes its key out.
        self._confirmed: OrderedDict[tuple[str, str, int], None] = OrderedDict()
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
            task = asyncio.get_running_loop().create_task(entry[0].close())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ---- the receiver's threads ------------------------------------------------------

    def fetch(self, handle: KVHandle, block_ids: list[int]):
        """Block bytes over the gRPC transport (the source checks the lease around it)."""
        stub = wk_grpc.WorkerServiceStub(self._channel(handle.engine_id))
        req = wk.ReadKvBlocksRequest(request_id=handle.request_id, lease_id=handle.lease_id,
                                     block_ids=block_ids)
        timeout = FETCH_BASE_S + FETCH_PER_BLOCK_S * len(block_ids)
        for msg in stub.ReadKvBlocks(req, timeout=timeout):
            yield msg.data

    def confirm(self, handle: KVHandle) -> Future:
        """After a pull: release the lease at the source; the future says whether it was
        still held. Called from the engine thread; the RPC runs on the event loop."""
        return asyncio.run_coroutine_threadsafe(self._confirm(handle), self._loop)

    async def _confirm(self, handle: KVHandle) -> bool:
        address = self.address.get(handle.engine_id)
        if address is None:
            raise ConnectionError(f"unknown peer {handle.engine_id!r}")
        reply = await self.stub(address).ReleaseKv(
            wk.ReleaseKvRequest(request_id=handle.request_id, lease_id=handle.lease_id),
            timeout=CONFIRM_TIMEOUT_S)
        self._confirmed[(handle.engine_id, handle.request_id, handle.lease_id)] = None
        while len(self._confirmed) > MAX_CONFIRMED:
            self._confirmed.popitem(last=False)
        return reply.released

    def _channel(self, engine_id: str) -> grpc.Channel:
        channel = self._sync.get(engine_id)
        if channel is None:
            raise ConnectionError(f"unknown peer {engine_id!r}")
        return channel

    # ---- the event loop --------------------------------------------------------------

    def release_soon(self, handle: KVHandle) -> None:
        """Release the lease (in the background) unless a confirmation already did."""
        key = (handle.engine_id, handle.request_id, handle.lease_id)
        if key in self._confirmed:
            del self._confirmed[key]
            return
        address = self.address.get(handle.engine_id)
        if address is None:
            return
        stub = self.stub(address)

        async def call():
            try:
                await stub.ReleaseKv(wk.ReleaseKvRequest(request_id=handle.request_id,
                                                         lease_id=handle.lease_id), timeout=10)
            except grpc.aio.AioRpcError as e:  # the lease expires on its own
                log.warning("release of %s on %s failed: %s", handle.request_id,
                            handle.engine_id, e.code())

        task = asyncio.get_running_loop().create_task(call())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for channel in self._sync.values():
            channel.close()
        self._sync.clear()
