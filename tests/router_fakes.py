"""Fake prefill and decode workers on loopback grpc.aio, and the real router in front of
them: the router's logic tested without a model, fast.

The fakes' "model" is a formula: output token k of prompt P is `token(P, k)`, whichever
worker computes it. So a stream that moved between workers must still read
token(P, 0), token(P, 1), ... with no gap and no repeat. Leases are real enough: a prefill
fake holds each handle's lease until someone releases it, and a decode fake that takes a
handle releases it at the source, as the real decode worker's lease check does.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from baton.router.clients import GrpcWorkerClient
from baton.router.config import RouterConfig
from baton.router.core import Router
from baton.router.server import WORK_METHODS, authorize, build, services
from baton.services.common.block_hash import extend_hashes
from baton.services.common.kv_events import KvEventLog
from baton.services.rpc.errors import retry_metadata
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle, make_server, service_name
from baton.services.worker.messages import kv_events_message
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc

VOCAB, MAX_LEN = 49152, 65536
PROMPT = list(range(100, 140))
FAKES: dict[str, FakeWorker] = {}  # engine id -> fake, so a decode fake reaches its source
_lease_ids = itertools.count(1)


def token(prompt: list[int], k: int) -> int:
    return (sum(prompt) * 31 + k * 7) % 997 + 3


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    return [token(prompt, k) for k in range(max_tokens)]


def request(prompt: list[int], max_tokens: int, **kw) -> gen.GenerateRequest:
    return gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt),
                               sampling=gen.SamplingParams(max_tokens=max_tokens), **kw)


def tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.delta.token_ids]


def _delta(prompt: list[int], k: int, last: bool, sampling: gen.SamplingParams
           ) -> gen.TokenDelta:
    t = token(prompt, k)
    out = gen.TokenDelta(token_ids=[t], text=f"<{t}>",
                         finish_reason=gen.FINISH_REASON_LENGTH if last else 0)
    if sampling.HasField("logprobs"):  # the token's own, then the top N (it first)
        out.logprobs.add().entries.extend(
            [gen.Logprob(token_id=t, logprob=-0.5)] + [
                gen.Logprob(token_id=t + j, logprob=-0.5 - j) for j in range(
                    sampling.logprobs)])
    return out


@dataclass
class FakeWorker(wk_grpc.PrefillServiceServicer, wk_grpc.DecodeServiceServicer,
                 wk_grpc.WorkerServiceServicer):
    role: str
    engine_id: str
    address: str = ""
    draining: bool = False
    fail_with: grpc.StatusCode | None = None  # refuse Prefill / Decode with this code
    retry_after_ms: int | None = None  # with RESOURCE_EXHAUSTED
    die_after: int | None = None  # decode: fail (UNAVAILABLE) after this many messages
    die_before_finish: bool = False  # decode: stream the last token, then fail, no finish
    token_delay_s: float = 0.0
    queued_prefill_tokens: int = 0  # what its stats say it has yet to compute
    connect_error: str | None = None  # decode: every handshake fails with this
    connect_hangs: bool = False  # decode: handshakes never answer
    connects: int = 0  # decode: handshakes asked of it
    pull_fails: bool = False  # decode: says it computed a prompt it was given a handle for
    gate: asyncio.Event | None = None  # decode: each token past `ungated` waits for it
    ungated: int = 0  # decode: tokens of a stream sent before the gate is heeded
    frozen: bool = False  # answers nothing (stats, decode) until thawed
    stalled_since: float = 0.0  # its engine stuck since (Unix time): streams wait, stats say so
    leases: dict[str, int] = field(default_factory=dict)  # request id -> held lease id
    released: list[tuple[str, int, bool]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # AbortPrefill's request ids
    busy_answers: int = 0  # ReleaseKv and AbortPrefill: this many fail UNAVAILABLE first
    prefills: list[str] = field(default_factory=list)
    decodes: list[wk.DecodeRequest] = field(default_factory=list)
    active: int = 0
    # decode: request id -> the KV blocks its stream holds (its prompt's and its tokens'
    # so far), as an engine's pool would; freed when the stream ends, however it ends.
    blocks: dict[str, int] = field(default_factory=dict)
    prefilling: int = 0  # Prefill calls under way
    kv: KvEventLog = field(default_factory=KvEventLog)  # the prompts' blocks it "caches"
    _thaw: asyncio.Event | None = None

    def cache(self, prompt: list[int], salt: str = "", medium: str = "pool") -> None:
        """Hold the prompt's full blocks, as an engine's prefix cache (or one of its
        offload tiers: `medium`) would."""
        hashes: list[bytes] = []
        extend_hashes(hashes, prompt, 16, salt.encode())
        for h in hashes:
            self.kv.stored(h, medium)

    def cached_tokens(self, prompt: list[int], salt: str = "") -> int:
        """The prompt's leading tokens an engine would take from this cache (never the
        block with the last token)."""
        hashes: list[bytes] = []
        extend_hashes(hashes, prompt[:-1], 16, salt.encode())
        held = set(self.kv.read(0).stored)
        return 16 * next((i for i, h in enumerate(hashes) if h not in held), len(hashes))

    def freeze(self) -> None:
        self.frozen = True
        self._thaw = asyncio.Event()

    def stall_engine(self) -> None:
        """Its engine thread hangs: streams and prefills wait, stats answer saying so."""
        self.freeze()
        self.stalled_since = time.time()

    def thaw(self) -> None:
        self.frozen = False
        self.stalled_since = 0.0
        if self._thaw is not None:
            self._thaw.set()

    async def _stall_if_frozen(self) -> None:
        if self.frozen and self._thaw is not None:
            await self._thaw.wait()

    async def _refuse(self, context) -> None:
        if self.fail_with is not None:
            if self.retry_after_ms is not None:
                context.set_trailing_metadata(retry_metadata(self.retry_after_ms / 1000))
            await context.abort(self.fail_with, f"{self.engine_id} refused")

    # ---- prefill ---------------------------------------------------------------------

    async def Prefill(self, request, context):
        self.prefilling += 1
        try:
            return await self._prefill(request, context)
        finally:
            self.prefilling -= 1

    async def _prefill(self, request, context):
        await self._refuse(context)
        await self._stall_if_frozen()
        prompt = list(request.prompt_token_ids)
        self.prefills.append(request.request_id)
        cached = self.cached_tokens(prompt, request.cache_salt)
        self.cache(prompt, request.cache_salt)
        max_tokens = request.sampling.max_tokens or 16
        reply = wk.PrefillResponse(delta=_delta(prompt, 0, max_tokens == 1, request.sampling),
                                   cached_tokens=cached)
        if max_tokens > 1:
            lease = next(_lease_ids)
            self.leases[request.request_id] = lease
            reply.handle.CopyFrom(wk.KvHandle(
                engine_id=self.engine_id, request_id=request.request_id, lease_id=lease,
                block_ids=list(range(1, 1 + -(-len(prompt) // 16))), num_tokens=len(prompt),
                lease_s=30))
            # As a prefill worker does: a call that ends cancelled, or past its deadline,
            # hands the lease to nobody.
            context.add_done_callback(
                lambda ctx: (ctx.cancelled() or (ctx.time_remaining() or 1) <= 0)
                and self.release(request.request_id, lease))
        return reply

    def release(self, rid: str, lease_id: int) -> bool:
        held = rid in self.leases and lease_id == self.leases[rid]
        if held:
            del self.leases[rid]
        self.released.append((rid, lease_id, held))
        return held

    async def _busy(self, context) -> None:  # as a worker too loaded to answer in time
        if self.busy_answers > 0:
            self.busy_answers -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "busy")

    async def ReleaseKv(self, request, context):
        await self._busy(context)
        if not request.lease_id:  # as a prefill worker does: only the handle's lease
            self.released.append((request.request_id, 0, False))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lease_id: required")
        return wk.ReleaseKvResponse(released=self.release(request.request_id, request.lease_id))

    async def AbortPrefill(self, request, context):
        # As a prefill worker does: whatever lease the request holds ends, by its id.
        await self._busy(context)
        self.aborted.append(request.request_id)
        return wk.AbortPrefillResponse(
            released=self.leases.pop(request.request_id, None) is not None)

    # ---- decode ----------------------------------------------------------------------

    async def Connect(self, request, context):
        self.connects += 1
        while self.connect_hangs:
            await asyncio.sleep(0.05)
        if self.connect_error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.connect_error)
        source = next(f for f in FAKES.values() if f.address == request.prefill_address)
        return wk.ConnectResponse(prefill_engine_id=source.engine_id, transport="fake")

    async def Decode(self, request, context):
        await self._refuse(context)
        self.decodes.append(request)
        prompt = list(request.prompt_token_ids)
        self.cache(prompt, request.cache_salt)
        max_tokens = request.sampling.max_tokens or 16
        if request.HasField("handle"):  # pull, then confirm (and release) at the source
            FAKES[request.handle.engine_id].release(request.handle.request_id,
                                                    request.handle.lease_id)
            start = 1
        else:
            start = len(request.output_token_ids)
        self.active += 1
        rid = request.request_id
        try:
            for n, k in enumerate(range(start, max_tokens)):
                self.blocks[rid] = -(-(len(prompt) + k + 1) // 16)
                if self.die_after is not None and n >= self.die_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "worker died")
                if self.gate is not None and n >= self.ungated:
                    await self.gate.wait()
                await self._stall_if_frozen()
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                last = k == max_tokens - 1
                ends = last and not self.die_before_finish
                msg = wk.DecodeResponse(delta=_delta(prompt, k, ends, request.sampling))
                if n == 0:  # the first reply: did it compute the prompt itself?
                    msg.timings.local_prefill = self.pull_fails or not request.HasField(
                        "handle")
                yield msg
                if last and self.die_before_finish:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "worker died")
        finally:
            self.active -= 1
            self.blocks.pop(rid, None)

    # ---- every worker ----------------------------------------------------------------

    async def GetStats(self, request, context):
        if not self.stalled_since:  # a stuck engine's worker still answers
            await self._stall_if_frozen()
        return wk.GetStatsResponse(
            engine_id=self.engine_id, role=self.role, draining=self.draining,
            num_running=self.active, num_leases=len(self.leases),
            num_queued_prefill_tokens=self.queued_prefill_tokens,
            engine_stalled_since=self.stalled_since,
            model_info=gen.ModelInfo(model="fake", max_model_len=MAX_LEN, vocab_size=VOCAB,
                                     block_size=16, dtype="float32"))


    async def GetKvEvents(self, request, context):
        ev = self.kv.read(request.after if request.engine_id == self.engine_id else 0)
        return kv_events_message(ev, self.engine_id, 16, True)


async def _serve(worker: FakeWorker, host: str = "127.0.0.1", port: int = 0
                 ) -> grpc.aio.Server:
    def register(server):
        wk_grpc.add_PrefillServiceServicer_to_server(worker, server)
        wk_grpc.add_DecodeServiceServicer_to_server(worker, server)
        wk_grpc.add_WorkerServiceServicer_to_server(worker, server)
        return [service_name(wk, "WorkerService")]

    server = make_server(register, Lifecycle())
    port = server.add_insecure_port(f"{host}:{port}")
    worker.address = f"{host}:{port}"
    await server.start()
    return server


@dataclass
class Cluster:
    stub: gen_grpc.GenerationStub
    prefill: list[FakeWorker]
    decode: list[FakeWorker]
    registry: object
    lifecycle: Lifecycle
    address: str
    router: Router
    rounds: list[int] = field(default_factory=lambda: [0])  # the registry's polls so far
    servers: list[grpc.aio.Server] = field(default_factory=list)  # as prefill + decode
    vllm: vllm_grpc.VllmEngineStub | None = None  # VllmEngine on the router's port

    async def restart(self, worker: FakeWorker) -> FakeWorker:
        """Kill `worker` (its server stops), wait until the registry has seen it down,
        and start a worker of its role on its address under a new engine id, as a
        restarted process comes back. Returns the new one (in `prefill` or `decode`)."""
        workers = self.prefill + self.decode
        i = workers.index(worker)
        await self.servers[i].stop(0)
        known = next(w for w in self.registry.workers if w.address == worker.address)
        deadline = time.monotonic() + 60
        while known.state != "down":
            assert time.monotonic() < deadline, "the registry never saw it down"
            await asyncio.sleep(0.005)
        new = FakeWorker(worker.role, f"{worker.engine_id}-restarted")
        host, port = worker.address.rsplit(":", 1)
        self.servers[i] = await _serve(new, host, int(port))
        del FAKES[worker.engine_id]
        FAKES[new.engine_id] = new
        same = self.prefill if worker.role == "prefill" else self.decode
        same[same.index(worker)] = new
        return new

    async def polled(self, rounds: int = 2) -> None:
        """Until the registry has polled every worker (stats, then KV events) `rounds`
        more times: twice, and one round began after this call."""
        until, deadline = self.rounds[0] + rounds, time.monotonic() + 60
        while self.rounds[0] < until:
            assert time.monotonic() < deadline, "the registry stopped polling"
            await asyncio.sleep(0.005)

    async def generate(self, prompt: list[int], max_tokens: int = 8, timeout: float = 10,
                       key: str | None = None, **kw) -> list[gen.GenerateResponse]:
        """`key`: sent as the caller's API key."""
        metadata = (("authorization", f"Bearer {key}"),) if key is not None else ()
        return [m async for m in self.stub.Generate(request(prompt, max_tokens, **kw),
                                                    timeout=timeout, metadata=metadata)]

    def leases_held(self) -> int:
        return sum(len(p.leases) for p in self.prefill)

    async def settle(self) -> None:
        """Let fire-and-forget releases land (a leak shows in the caller's check after)."""
        deadline = time.monotonic() + 30
        while self.leases_held() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)


@asynccontextmanager
async def cluster(tokenizer_model, prefills: int = 1, decodes: int = 1, **router_kw):
    """Fakes, and the real router (registry, clients, intake, servicer, interceptor)."""
    workers = ([FakeWorker("prefill", f"p{i}") for i in range(prefills)]
               + [FakeWorker("decode", f"d{i}") for i in range(decodes)])
    servers = [await _serve(w) for w in workers]
    FAKES.clear()
    FAKES.update({w.engine_id: w for w in workers})
    router_kw.setdefault("poll_interval", 0.05)
    router_kw.setdefault("worker_timeout", 0.5)
    # Every request disaggregated, unless a test asks for conditional disaggregation.
    for name in ("local_prefill_hit", "local_prefill_tokens", "local_prefill_queue"):
        router_kw.setdefault(name, 0)
    config = RouterConfig(prefill=tuple(w.address for w in workers[:prefills]),
                          decode=tuple(w.address for w in workers[prefills:]),
                          model=str(tokenizer_model), http_port=0, **router_kw)
    lifecycle = Lifecycle(WORK_METHODS)
    router = build(config, lifecycle, [GrpcWorkerClient(a) for a in config.prefill],
                   [GrpcWorkerClient(a) for a in config.decode])
    registry = router.registry
    rounds = [0]
    count_workers = registry.on_refresh  # the router's metrics, after every round

    def refreshed() -> None:
        rounds[0] += 1
        count_workers()

    registry.on_refresh = refreshed
    security = Security.of(config)  # the API keys, as `run` sets them up
    authorize(lifecycle, router, security)

    server = make_server(services(router, security), lifecycle)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await lifecycle.set_serving(False)
    await registry.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Cluster(gen_grpc.GenerationStub(channel), workers[:prefills],
                      workers[prefills:], registry, lifecycle, f"127.0.0.1:{port}", router,
                      rounds, servers, vllm=vllm_grpc.VllmEngineStub(channel))
    finally:
        for w in workers:
            w.thaw()
        await channel.close()
        await registry.close()
        router.intake.close()
        await server.stop(0)
        for s in servers:
            await s.stop(0)
