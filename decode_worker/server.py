"""The decode worker: an engine in the decode role behind DecodeService and WorkerService.
A request arrives with its first token and a KV handle; the engine allocates its blocks,
pulls from the prefill worker only those its own prefix cache lacks, tells the prefill
worker to release its lease, and streams every token as it is sampled."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

import grpc

from baton.v1 import worker_pb2 as wk
from baton.v1 import worker_pb2_grpc as wk_grpc
from kv_transfer import make_receiver
from kv_transfer.fake import FailingReceiver
from services.engine.engine import LLMEngine
from services.engine.kv_layout import IncompatibleLayout, KVLayout
from services.engine.request import RemoteKV
from services.serving.convert import FINISH, logprobs_messages, set_stop_reason
from services.serving.server import CHANNEL_OPTIONS
from services.worker.async_engine import AsyncEngine, Overloaded
from services.worker.common import (
    abort_overloaded,
    engine_config,
    layout_from_message,
    layout_message,
    run_worker,
    sampling_params,
)

log = logging.getLogger(__name__)

# The handle says how long the prefill worker holds the blocks from when it answered; the
# router's hop comes out of that, so a pull must be done this much before it ends.
LEASE_MARGIN_S = 2.0


class Peers:
    """Prefill engines we have shaken hands with: engine id -> address and channels."""

    def __init__(self):
        self.address: dict[str, str] = {}
        self.by_address: dict[str, str] = {}
        self.aio: dict[str, wk_grpc.PrefillServiceStub] = {}
        self.sync: dict[str, grpc.Channel] = {}

    def fetch(self, engine_id: str, request_id: str, block_ids: list[int]):
        """Block bytes over the gRPC fallback (runs on the receiver's threads)."""
        stub = wk_grpc.WorkerServiceStub(self.sync[engine_id])
        req = wk.ReadKvBlocksRequest(block_ids=block_ids, request_id=request_id)
        for msg in stub.ReadKvBlocks(req, timeout=60):
            yield msg.data

    def forget(self, address: str) -> None:
        """Drop a peer (it restarted under a new engine id): the next request shakes hands
        again."""
        eid = self.by_address.pop(address, None)
        if eid is not None:
            self.address.pop(eid, None)
            self.aio.pop(eid, None)
            channel = self.sync.pop(eid, None)
            if channel is not None:
                channel.close()


def _warm_up(receiver, engine_id: str, timeout_s: float = 10.0) -> None:
    """Copy the peer's null block into ours once: the transport's first transfer sets up
    its connection (about half a second over UCX), so no request pays for that. The null
    block only pads tables; nothing reads what it holds."""
    tid = f"warm-up-{engine_id}"
    receiver.start_load(tid, engine_id, [0], [0])
    deadline = time.monotonic() + timeout_s
    while not receiver.poll(tid)[0].done and time.monotonic() < deadline:
        time.sleep(0.001)


async def _reply(out, first: bool, context) -> wk.DecodeResponse:
    if out.error:  # ABORTED: a deliberate end (the router does not move it elsewhere)
        await context.abort(grpc.StatusCode.ABORTED, out.error)
    reply = wk.DecodeResponse(token_ids=out.new_token_ids, text=out.new_text,
                              finish_reason=FINISH[out.finish_reason])
    if out.logprobs and out.new_token_ids:
        reply.logprobs.extend(logprobs_messages(out.logprobs[-len(out.new_token_ids):]))
    set_stop_reason(reply, out.stop_reason)
    if first:
        reply.cached_tokens = out.num_cached_tokens
        reply.kv_transfer_s = out.transfer_time or 0.0
    return reply


class DecodeServicer(wk_grpc.DecodeServiceServicer):
    def __init__(self, aengine: AsyncEngine, engine_id: str, transport: str, peers: Peers):
        self.aengine = aengine
        self.engine_id = engine_id
        self.transport = transport
        self.peers = peers
        self.layout = KVLayout.of_engine(aengine.engine)
        self._connecting: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()  # fire-and-forget releases, kept alive

    async def _connect(self, address: str, context) -> str:
        """Handshake with the prefill worker at `address` (once); its engine id."""
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            if address in self.peers.by_address:
                return self.peers.by_address[address]
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            stub = wk_grpc.PrefillServiceStub(channel)
            try:
                reply = await stub.Handshake(wk.HandshakeRequest(
                    engine_id=self.engine_id, layout=layout_message(self.layout)), timeout=10)
                layout = layout_from_message(reply.layout)
                self.layout.check_compatible(layout)
                if reply.transport != self.transport:
                    raise IncompatibleLayout(f"KV transport: ours {self.transport!r}, "
                                             f"peer {reply.transport!r}")
                receiver = self.aengine.engine.kv_receiver
                await asyncio.to_thread(receiver.add_peer, reply.engine_id, layout,
                                        reply.transport_metadata)
                await asyncio.to_thread(_warm_up, receiver, reply.engine_id)
            except IncompatibleLayout as e:
                await channel.close()
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"prefill worker {address} is incompatible: {e}")
            except (ConnectionError, ValueError) as e:  # the transport could not reach it
                await channel.close()
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"KV transport to {address}: {e}")
            except grpc.aio.AioRpcError as e:
                await channel.close()
                code = e.code()
                if code != grpc.StatusCode.FAILED_PRECONDITION:
                    code = grpc.StatusCode.UNAVAILABLE
                await context.abort(code, f"handshake with {address}: {e.details()}")
            eid = reply.engine_id
            self.peers.address[eid], self.peers.by_address[address] = address, eid
            self.peers.aio[eid] = stub
            self.peers.sync[eid] = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            log.info("connected to prefill engine %s at %s", eid, address)
            return eid

    async def Connect(self, request, context):
        self.peers.forget(request.prefill_address)  # (re)registration: shake hands anew
        eid = await self._connect(request.prefill_address, context)
        return wk.ConnectResponse(prefill_engine_id=eid, transport=self.transport)

    async def Decode(self, request, context):
        handle = request.handle
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if not request.HasField("handle"):
            async with aclosing(self._decode_local(request, context)) as replies:
                async for reply in replies:
                    yield reply
            return
        if handle.engine_id not in self.peers.address:
            if not request.prefill_address:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"unknown prefill engine {handle.engine_id!r}")
            self.peers.forget(request.prefill_address)  # a restart: a new engine id there
            if await self._connect(request.prefill_address, context) != handle.engine_id:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"prefill engine {handle.engine_id!r} is no longer at "
                                    f"{request.prefill_address}")
        if handle.fingerprint and handle.fingerprint != self.layout.fingerprint:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "KV handle fingerprint does not match this engine's layout")
        try:
            params = sampling_params(request.sampling)
        except (ValueError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id
        deadline = (time.monotonic() + handle.lease_s - LEASE_MARGIN_S if handle.lease_s > 0
                    else float("inf"))
        remote = RemoteKV(handle.engine_id, tuple(handle.block_ids), handle.num_tokens,
                          deadline)

        def add(engine: LLMEngine):
            engine.add_remote_request(list(request.prompt_token_ids), request.first_token_id,
                                      remote, params, request_id=rid,
                                      priority=request.priority,
                                      cache_salt=request.cache_salt or None)

        released = False

        def release_once() -> None:  # the load is over, whatever its outcome, or never ran
            nonlocal released
            if not released:
                released = True
                self._release(handle.engine_id, rid)

        try:
            async with aclosing(self._stream(rid, add, context, release_once)) as replies:
                async for reply in replies:
                    yield reply
        finally:
            release_once()

    async def _decode_local(self, request, context):
        """No KV handle: compute the prompt's KV here (no prefill worker could, or the
        request migrates from a dead decode worker) and continue after the outputs the
        client already has."""
        try:
            params = sampling_params(request.sampling)
        except (ValueError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id

        def add(engine: LLMEngine):
            engine.resume_request(list(request.prompt_token_ids),
                                  list(request.output_token_ids), params, request_id=rid,
                                  priority=request.priority,
                                  cache_salt=request.cache_salt or None)

        async with aclosing(self._stream(rid, add, context)) as replies:
            async for reply in replies:
                yield reply

    async def _stream(self, rid: str, add, context, on_output=None):
        """The request's outputs as DecodeResponses; engine refusals as status codes."""
        first = True
        try:
            async for out in self.aengine.generate(rid, add):
                if on_output is not None:
                    on_output()
                yield await _reply(out, first, context)
                first = False
        except Overloaded as e:
            await abort_overloaded(context, e)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _release(self, engine_id: str, rid: str) -> None:
        stub = self.peers.aio.get(engine_id)
        if stub is None:
            return

        async def call():
            try:
                await stub.ReleaseKv(wk.ReleaseKvRequest(request_id=rid), timeout=10)
            except grpc.aio.AioRpcError as e:  # the lease expires on its own
                log.warning("release of %s on %s failed: %s", rid, engine_id, e.code())

        task = asyncio.get_running_loop().create_task(call())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def serve(args) -> None:
    engine = LLMEngine(engine_config(args))
    peers = Peers()
    receiver = make_receiver(args.kv_transport, args.engine_id, KVLayout.of_engine(engine),
                             engine.runner.kv_caches, fetch=peers.fetch)
    if getattr(args, "inject_kv_failure", None):
        log.warning("test hook: every KV pull will fail (%s)", args.inject_kv_failure)
        receiver = FailingReceiver(receiver, args.inject_kv_failure)
    engine.kv_receiver = receiver

    def add(server: grpc.aio.Server, aengine: AsyncEngine) -> None:
        wk_grpc.add_DecodeServiceServicer_to_server(
            DecodeServicer(aengine, args.engine_id, args.kv_transport, peers), server)

    run_worker(args, "decode", engine, "DecodeService", add, closers=[receiver.close])
