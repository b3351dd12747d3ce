"""`vllm.grpc.engine.VllmEngine` on the router's port, beside baton.v1's Generation: the
API that vLLM's own gRPC servicer serves and that the Shepherd Model Gateway (and vLLM's
router) drive. Generate goes through the router's one path (vllm_request.py turns it into
baton.v1 requests: the same admission, checks, limits, API keys and namespaces); the rest
tells what the router knows:

    GetModelInfo       the workers' model, its defaults of unset sampling values
    GetServerInfo      a "baton" server, one data-parallel rank, no vLLM KV connector
    GetLoads           the workers' last stats, summed: running, waiting, KV use, the
                       prompt tokens queued, the prefix-cache hit rate, tokens per second
    SubscribeKvEvents  the prefix-cache blocks the workers hold (their KV events, as the
                       router's prefix index has them), as stored and removed events
                       with each block's tokens where the router has seen them
    GetTokenizer       the router's tokenizer files (with the chat template it uses), one
                       zip streamed in chunks, its SHA-256 on the last
    Abort              ends a request's stream (finish reason "abort"); its blocks are
                       freed on every worker, as for a client that leaves
    HealthCheck        whether the router can serve (a worker is up)

Embed, FlushCache and the profiler's StartProfile and StopProfile are UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import tempfile
import time
import zipfile
from collections import OrderedDict
from contextlib import aclosing
from datetime import UTC, datetime
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2 as common
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from baton.services.common.block_hash import extend_hashes, extra_keys
from baton.v1 import generation_pb2 as gen

from . import vllm_request
from .core import Router
from .reply import Caller, caller_of, write_within
from .runs import Run, answer_size

TOKENIZER_CHUNK = 1 << 20  # bytes of the tokenizer's zip per message
EVENTS_POLL_S = 0.25  # how often a KV event stream looks at the prefix index
KNOWN_BLOCKS = 65536  # blocks whose tokens the servicer remembers, for KV events
# The last reply of a choice that Abort ended.
ABORTED = gen.GenerateResponse(delta=gen.TokenDelta(finish_reason=gen.FINISH_REASON_ABORT))


def block_id(h: bytes) -> int:
    """A Baton block hash (bytes) as the signed 64-bit id vLLM's events carry."""
    return int.from_bytes(h[:8], "little", signed=True)


class VllmEngineServicer(vllm_grpc.VllmEngineServicer):
    def __init__(self, router: Router, security=None):
        self.router = router
        self.security = security
        self._running: dict[str, asyncio.Task] = {}  # client request id -> its Generate
        self._aborted: set[asyncio.Task] = set()  # Generates that Abort cancelled
        self._started = time.time()
        self._last_request = 0.0
        self._rate: tuple[float, int] | None = None  # (when, tokens generated) at the last
        self._throughput = 0.0
        # block hash -> (parent hash or None, its tokens), for the blocks of the requests
        # served here: what a KV event says of a block (Baton's events carry hashes only)
        self._blocks: OrderedDict[bytes, tuple[bytes | None, list[int]]] = OrderedDict()
        self._tokenizer: tuple[bytes, str] | None = None
        self._remembered = 0  # requests whose blocks were remembered, so far

    # ---- Generate -------------------------------------------------------------------

    async def Generate(self, request, context):
        router = self.router
        self._last_request = time.time()
        info = router.model_info()
        requests = vllm_request.choices(request, info.max_model_len,
                                        router.intake.limits.max_n)
        # choices x max_tokens x (1 + top logprobs), as the OpenAI API's answers are held
        router.intake.limits.check("max_answer_tokens", answer_size(requests)[2],
                                   "sampling_params.max_tokens")
        s = request.sampling_params
        top_n = s.logprobs if s.HasField("logprobs") else None
        ids = (list(requests[0].token_ids.ids)
               if requests[0].WhichOneof("prompt") == "token_ids" else None)
        replies = [vllm_request.Replies(i, request.stream, ids, top_n)
                   for i in range(len(requests))]
        caller = caller_of(context, self.security)
        rid, me = request.request_id, asyncio.current_task()
        assert me is not None  # a gRPC handler runs in a task of its own
        # Every choice's slot of --max-inflight at once (RESOURCE_EXHAUSTED, else none).
        run = Run(router, requests, len(requests), caller, router.admit(len(requests)))
        stall = router.stream_stall_timeout
        try:
            if rid:
                self._running[rid] = me
            run.start()
            async with aclosing(run.events()) as events:
                async for i, reply in events:
                    self._remember(replies[i], reply, caller)
                    for out in replies[i].of(reply):
                        await write_within(context, out, stall)
        except asyncio.CancelledError:
            if me not in self._aborted:  # the client left: the call ends cancelled
                raise
            me.uncancel()  # Abort: every unfinished choice ends with "abort"
            for r in replies:
                for out in [] if r.done else r.of(ABORTED):
                    await write_within(context, out, stall)
        finally:
            if rid and self._running.get(rid) is me:
                del self._running[rid]  # first: an Abort from now on finds nothing to end
            self._aborted.discard(me)
            await run.close()

    async def Abort(self, request, context):
        """Cancels each named request's Generate, which then ends its stream ("abort");
        closing its run frees its blocks on every worker."""
        for rid in request.request_ids:
            task = self._running.get(rid)
            if task is not None:
                self._aborted.add(task)
                task.cancel()
        return vllm.AbortResponse()

    # ---- What the router knows ------------------------------------------------------

    async def HealthCheck(self, request, context):
        ready, why = self.router.registry.readiness()
        return vllm.HealthCheckResponse(healthy=ready, message=why or "serving")

    async def GetModelInfo(self, request, context):
        router = self.router
        info = router.model_info()
        eos = list(info.eos_token_ids)
        return vllm.GetModelInfoResponse(
            model_path=info.model, is_generation=True,
            max_context_length=info.max_model_len, vocab_size=info.vocab_size,
            served_model_name=info.served_model_name, tokenizer_path=info.model,
            model_type=info.family, architectures=[info.architecture] if info.architecture
            else [], eos_token_ids=eos, pad_token_id=-1, bos_token_id=-1,
            max_req_input_len=info.max_model_len - 1,
            default_sampling_params_json=json.dumps(router.intake.sampling_defaults))

    async def GetServerInfo(self, request, context):
        router = self.router
        info = router.model_info()
        return vllm.GetServerInfoResponse(
            active_requests=router.inflight, is_paused=False,
            last_receive_timestamp=self._last_request,
            uptime_seconds=time.time() - self._started, server_type="baton",
            data_parallel_size=1, block_size=info.block_size, model_dtype=info.dtype)

    def _up(self):
        return [w for w in self.router.registry.workers
                if w.stats is not None and w.state == "up"]

    async def GetLoads(self, request, context):
        workers = self._up()
        stats = [w.stats for w in workers if w.stats is not None]
        running = sum(s.num_running for s in stats)
        waiting = sum(s.num_waiting + s.num_loading for s in stats)
        block = stats[0].model_info.block_size if stats else 0
        total = sum(s.num_blocks for s in stats) * block
        used = sum(s.num_blocks - s.num_free_blocks for s in stats) * block
        queries = sum(s.prefix_cache_queries for s in stats)
        hits = sum(s.prefix_cache_hits for s in stats)
        generated = sum(s.num_generation_tokens for s in stats)
        now = time.monotonic()
        if self._rate is not None and now > self._rate[0] and generated >= self._rate[1]:
            self._throughput = (generated - self._rate[1]) / (now - self._rate[0])
        self._rate = (now, generated)
        load = vllm.SchedulerLoad(
            dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting,
            num_total_reqs=running + waiting, num_used_tokens=used,
            max_total_num_tokens=total, token_usage=used / total if total else 0.0,
            gen_throughput=self._throughput,
            cache_hit_rate=hits / queries if queries else 0.0,
            utilization=used / total if total else 0.0,
            max_running_requests=self.router.max_inflight,
            num_waiting_uncached_tokens=sum(w.queued_prefill_tokens for w in workers))
        return vllm.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(),
                                     version="baton", dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request, context):
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(self._bundle)
        data, sha = self._tokenizer
        for start in range(0, len(data), TOKENIZER_CHUNK):
            last = start + TOKENIZER_CHUNK >= len(data)
            yield common.GetTokenizerChunk(data=data[start:start + TOKENIZER_CHUNK],
                                           sha256=sha if last else "")

    def _bundle(self) -> tuple[bytes, str]:
        """The tokenizer's files as one zip, and its SHA-256."""
        buf = io.BytesIO()
        with tempfile.TemporaryDirectory() as tmp:
            self.router.intake.tokenizer.save(tmp)
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
                for f in sorted(Path(tmp).iterdir()):
                    z.write(f, f.name)
        data = buf.getvalue()
        return data, hashlib.sha256(data).hexdigest()

    # ---- KV events ------------------------------------------------------------------

    def _remember(self, reply: vllm_request.Replies, msg, caller: Caller) -> None:
        """On a choice's last reply: the hashes and tokens of its blocks (prompt and
        output), so the events of the blocks it left cached can say their tokens."""
        if msg.delta.finish_reason == 0 or reply.prompt_ids is None:
            return
        block = self.router.model_info().block_size
        if not block:
            return
        ids = reply.prompt_ids + reply.ids
        hashes: list[bytes] = []
        extend_hashes(hashes, ids, block, extra_keys(self.router.salt("", caller)))
        for i, h in enumerate(hashes):
            self._blocks[h] = (hashes[i - 1] if i else None, ids[i * block:(i + 1) * block])
            self._blocks.move_to_end(h)
        while len(self._blocks) > KNOWN_BLOCKS:
            self._blocks.popitem(last=False)
        self._remembered += 1

    def _held(self) -> set[bytes]:
        """The blocks of requests served here (those whose tokens and parent are known:
        a block sent without its parent would read as a chain's first) that the workers'
        prefix caches hold now, as the router's index has them: at most KNOWN_BLOCKS
        lookups."""
        indexes = [w.index for w in self._up()]
        return {h for h in self._blocks if any(i.holds(h) for i in indexes)}

    def _marks(self) -> tuple:
        """What changes when `_held` may: each worker's last KV event, and the blocks
        remembered here."""
        return (tuple((w.address, w.index.engine_id, w.index.seq) for w in self._up()),
                self._remembered)

    async def SubscribeKvEvents(self, request, context):
        """Stored and removed blocks since the last batch, every EVENTS_POLL_S; the first
        batch stores every block held now (after a cleared event)."""
        sent: set[bytes] = set()
        seq = 0
        event_id = 0
        first, marks = True, None
        while True:
            if not first and self._marks() == marks:  # nothing new: no set built
                await asyncio.sleep(EVENTS_POLL_S)
                continue
            marks, held = self._marks(), self._held()
            events = []
            if first:
                event_id += 1
                events.append(common.KvCacheEvent(event_id=event_id,
                                                  cleared=common.KvCacheCleared()))
            removed = [h for h in sent - held]
            block = self._block_size()
            for h in self._in_order(held - sent):
                event_id += 1
                parent, tokens = self._blocks[h]
                stored = common.KvBlocksStored(blocks=[common.KvBlock(
                    block_hash=block_id(h), token_ids=tokens, block_size=block)])
                if parent is not None:
                    stored.parent_block_hash = block_id(parent)
                events.append(common.KvCacheEvent(event_id=event_id, stored=stored))
            if removed:
                event_id += 1
                events.append(common.KvCacheEvent(event_id=event_id, removed=(
                    common.KvBlocksRemoved(block_hashes=[block_id(h) for h in removed]))))
            if events:
                seq += 1
                yield common.KvEventBatch(sequence_number=seq, timestamp=time.time(),
                                          events=events, dp_rank=0)
            sent, first = held, False
            await asyncio.sleep(EVENTS_POLL_S)

    def _block_size(self) -> int:
        info = self.router.registry.model_info()
        return info.block_size if info is not None else 0

    def _in_order(self, hashes: set[bytes]) -> list[bytes]:
        """`hashes` with every parent before its children (the order they were
        remembered in, which is each chain's own)."""
        return [h for h in self._blocks if h in hashes]

    # ---- Not served -----------------------------------------------------------------

    async def Embed(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Embed: Baton serves "
                            "generation only")

    async def FlushCache(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "FlushCache: not supported")

    async def StartProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StartProfile: not supported")

    async def StopProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StopProfile: not supported")
