"""The decode worker: an engine in the decode role behind DecodeService and WorkerService.

A request arrives with its first token and a KV handle. The engine allocates its blocks,
pulls from the prefill worker only those its own prefix cache lacks, and then asks the
prefill worker to release the lease: the pull counts only if the lease was still held
(kv_transfer/lease_check.py), else the load-failure policy applies. Every token streams
as it is sampled. Without a handle the engine computes the prompt itself.

It pulls only from prefill workers it may trust: with a cluster token, those that prove
in the handshake that they hold it; with mutual TLS, those whose certificate the CA
signed. Without either (a dev setup) any peer is taken, but what it sends serves only the
request that asked for it: it never enters the prefix cache (`KVHandle.verified`)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from contextlib import aclosing
from dataclasses import replace
from functools import partial

import grpc

from baton.kv_transfer.base import IncompatibleLayout, KVHandle, KVLayout, KVReceiver
from baton.kv_transfer.connectors import make_receiver
from baton.kv_transfer.faults import FailingReceiver
from baton.kv_transfer.lease_check import LeaseCheckedReceiver
from baton.services.engine.engine import LLMEngine
from baton.services.lora.calls import lora_of
from baton.services.rpc import tracing
from baton.services.rpc.convert import sampling_params
from baton.services.rpc.errors import (
    Aborted,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    Unavailable,
)
from baton.services.rpc.security import Security
from baton.services.worker import spans
from baton.services.worker.async_engine import AsyncEngine
from baton.services.worker.config import WorkerConfig
from baton.services.worker.messages import (
    delta_message,
    layout_from_message,
    layout_message,
    timings_message,
)
from baton.services.worker.metrics import WorkerMetrics
from baton.services.worker.runtime import make_engine, run_worker
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc

from .peers import Peers

log = logging.getLogger(__name__)

# The handle says how long the prefill worker holds the blocks from when it answered; the
# router's hop comes out of that, so a pull must start this much before it ends.
LEASE_MARGIN_S = 2.0
# A prefill worker that answers the handshake with these will not pair with us as we are.
REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
           grpc.StatusCode.PERMISSION_DENIED)


def _warm_up(receiver: KVReceiver, engine_id: str, timeout_s: float = 10.0) -> None:
    """Copy the peer's null block into ours once: the transport's first transfer sets up
    its connection (about half a second over UCX), so no request pays for that. The null
    block only pads tables; nothing reads what it holds."""
    tid = f"warm-up-{engine_id}-{uuid.uuid4().hex[:8]}"
    receiver.start_load(tid, KVHandle(engine_id, tid, 0, (0,), 0), [0], [0])
    deadline = time.monotonic() + timeout_s
    while not receiver.poll(tid)[0].done and time.monotonic() < deadline:
        time.sleep(0.001)


class DecodeServicer(wk_grpc.DecodeServiceServicer):
    def __init__(self, aengine: AsyncEngine, engine_id: str, transport: str, peers: Peers,
                 receiver: KVReceiver | None, metrics: WorkerMetrics | None = None):
        self.aengine = aengine
        self.metrics = metrics
        self.engine_id = engine_id
        self.transport = transport
        self.peers = peers
        self.receiver = receiver  # the transport itself (handshakes, warm-up)
        self.layout: KVLayout = aengine.engine.kv_layout
        peers.bind(asyncio.get_running_loop())  # built inside the server's loop

    async def _connect(self, address: str, again: bool = False, wait: bool = False) -> str:
        """Shake hands with the prefill worker at `address`; its engine id. Known
        already: nothing to do, unless `again` (it may have restarted). A peer whose
        engine id is unchanged stays as it is: pulls from it go on meanwhile. `wait`: the
        caller knows it is up (the router just polled it), so the handshake waits for our
        channel to reach it (one that saw it die retries every second) instead of failing
        at once and leaving the pair for the router's next poll."""
        async with self.peers.handshaking(address):
            known = self.peers.by_address.get(address)
            if known is not None and not again:
                return known
            stub = self.peers.stub(address)
            nonce = secrets.token_bytes(16)
            try:
                reply = await stub.Handshake(wk.HandshakeRequest(
                    engine_id=self.engine_id, layout=layout_message(self.layout),
                    nonce=nonce), timeout=10, wait_for_ready=wait)
                layout = layout_from_message(reply.layout)
                cluster = self.peers.security.cluster
                if cluster and not cluster.proven(reply.proof, nonce, reply.engine_id,
                                                  reply.transport, reply.transport_metadata,
                                                  layout):
                    # Whoever answers there now is not (or no longer) a cluster member:
                    # drop what we knew of the address, and say so (a token leaked, or
                    # a stale one, are the usual causes).
                    self.peers.forget(address)
                    log.warning("prefill worker %s failed the cluster token proof: "
                                "forgotten, no pulls from it", address)
                    raise FailedPrecondition(f"prefill worker {address} cannot prove that it "
                                             "holds the cluster token: not pulling from it")
                if reply.engine_id == known:
                    return reply.engine_id
                self.layout.check_compatible(layout)  # its tp_size bounded, before any use
                if reply.transport != self.transport:
                    raise IncompatibleLayout(f"KV transport: ours {self.transport!r}, "
                                             f"peer {reply.transport!r}")
                receiver = self.receiver
                if receiver is None:  # colocated: it never takes KV from a peer
                    raise FailedPrecondition("this worker takes no KV from prefill workers")
                await asyncio.to_thread(receiver.add_peer, reply.engine_id, layout,
                                        reply.transport_metadata)
                await asyncio.to_thread(_warm_up, receiver, reply.engine_id)
            except IncompatibleLayout as e:
                raise FailedPrecondition(f"prefill worker {address} is incompatible: {e}"
                                         ) from None
            except (ConnectionError, ValueError) as e:  # the transport could not reach it
                raise Unavailable(f"KV transport to {address}: {e}") from None
            except grpc.aio.AioRpcError as e:  # refused (a layout, or our token): for good
                cls = (FailedPrecondition if e.code() in REFUSED else Unavailable)
                raise cls(f"handshake with {address}: {e.details()}") from None
            self.peers.forget(address)  # a restart: the old engine id is gone
            self.peers.add(reply.engine_id, address, self.peers.security.verifies_peers)
            log.info("connected to prefill engine %s at %s", reply.engine_id, address)
            return reply.engine_id

    async def Connect(self, request, context):
        eid = await self._connect(request.prefill_address, again=True, wait=True)
        return wk.ConnectResponse(prefill_engine_id=eid, transport=self.transport)

    async def Decode(self, request, context):
        if not request.request_id:
            raise InvalidArgument("request_id: required")
        params = sampling_params(request.sampling, self.aengine.engine.sampling_defaults)
        rid = request.request_id
        lora_msg = request.lora if request.HasField("lora") else None
        if not request.HasField("handle"):
            grammar = await self.aengine.compile(params)
            lora = await lora_of(self.aengine, lora_msg)
            # No handle: compute the prompt's KV here (no prefill worker could, or the
            # request migrates from a dead decode worker) and go on after its outputs.
            def resume(engine: LLMEngine):
                engine.resume_request(list(request.prompt_token_ids),
                                      list(request.output_token_ids), params, request_id=rid,
                                      priority=request.priority,
                                      cache_salt=request.cache_salt or None, grammar=grammar,
                                      lora=lora)

            async with aclosing(self._stream(rid, resume, context)) as replies:
                async for reply in replies:
                    yield reply
            return
        h = request.handle
        handle = KVHandle(h.engine_id, h.request_id or rid, h.lease_id, tuple(h.block_ids),
                          h.num_tokens, fingerprint=h.fingerprint)
        handle.check(self.layout, len(request.prompt_token_ids))  # before anything else
        if h.engine_id not in self.peers.address and request.prefill_address:
            # A prefill engine we have not met (or that restarted): shake hands. If that
            # fails, the pull fails ("unknown peer") and the load-failure policy applies.
            try:
                await self._connect(request.prefill_address, again=True)
            except (Unavailable, FailedPrecondition) as e:
                log.warning("cannot reach the KV of %s: %s", rid, e)
        deadline = (time.monotonic() + h.lease_s - LEASE_MARGIN_S if h.lease_s > 0
                    else float("inf"))
        handle = replace(handle, deadline=deadline,
                         verified=h.engine_id in self.peers.verified)

        def add(engine: LLMEngine, grammar, lora):
            engine.add_remote_request(list(request.prompt_token_ids), request.first_token_id,
                                      handle, params, request_id=rid,
                                      priority=request.priority,
                                      cache_salt=request.cache_salt or None, grammar=grammar,
                                      lora=lora)

        with self.peers.holding(handle) as load_over:  # the lease released once (peers.py)
            grammar = await self.aengine.compile(params)  # a failure still releases the lease
            lora = await lora_of(self.aengine, lora_msg)
            admit = partial(add, grammar=grammar, lora=lora)
            async with aclosing(self._stream(rid, admit, context, load_over)) as replies:
                async for reply in replies:
                    yield reply

    async def _stream(self, rid: str, add, context, on_output=None):
        """The request's outputs as DecodeResponses; its part of the trace as spans: the
        pull (or queue and prefill, when it computed the prompt itself), then decode."""
        local = on_output is None  # no KV handle: this worker computes the prompt
        first, parent, decode = True, tracing.extract(context.invocation_metadata()), None
        try:
            async for out in self.aengine.generate(rid, add):
                if first and on_output is not None:
                    on_output()  # the load is over (once; peers.holding)
                if out.engine_failed:  # INTERNAL: the router moves the request elsewhere
                    raise Internal(out.error or "the engine failed")
                if out.error:  # ABORTED: a deliberate end (the router does not move it)
                    raise Aborted(out.error)
                reply = wk.DecodeResponse(delta=delta_message(out))
                if first:
                    reply.cached_tokens = out.num_cached_tokens
                    reply.timings.CopyFrom(timings_message(out))
                    # It computed the prompt: without a handle, or its pull failed.
                    reply.timings.local_prefill = local or out.kv_load_error is not None
                    first = False
                    if self.metrics is not None:
                        self.metrics.observe(out)
                    if local:
                        spans.prompt(out, parent)
                    else:
                        spans.pull(out, parent)
                    decode = tracing.child("decode", parent)[0]
                yield reply
        finally:
            if decode is not None:
                decode.end()


def serve(config: WorkerConfig) -> None:
    transport = config.kv_transport
    if transport is None:  # the CLI sets it (NIXL where it loads, else gRPC)
        raise ValueError("kv_transport: not set (nixl or grpc)")
    security = Security.of(config)
    if not security.verifies_peers:
        log.warning("no --cluster-token and no mutual TLS (--tls-ca): no prefill worker can "
                    "prove it belongs to the cluster, so the KV pulled from one serves only "
                    "its own request and never enters the prefix cache")
    peers = Peers(security)
    made: dict[str, KVReceiver] = {}

    def receiver(layout: KVLayout, rank_caches: list) -> KVReceiver:
        """The transport over the engine's caches (every rank's), its pulls checked
        against the lease."""
        made["transport"] = pulls = make_receiver(transport, config.engine_id,
                                                  layout, rank_caches, fetch=peers.fetch)
        if config.inject_kv_failure:
            log.warning("test hook: every KV pull will fail (%s)", config.inject_kv_failure)
            pulls = FailingReceiver(pulls, config.inject_kv_failure)
        made["checked"] = LeaseCheckedReceiver(pulls, peers.confirm)
        return made["checked"]

    engine = make_engine(config.engine, config.threads, kv_receiver=receiver,
                         role="decode", cpus=config.cpu_set)

    def add(server: grpc.aio.Server, aengine: AsyncEngine, metrics: WorkerMetrics) -> None:
        wk_grpc.add_DecodeServiceServicer_to_server(
            DecodeServicer(aengine, config.engine_id, transport, peers,
                           made["transport"], metrics), server)

    run_worker(config, "decode", engine, "DecodeService", add,
               closers=[made["checked"].close, peers.close])
