"""The router's one path for a request, whichever API carried it (gRPC `Generate`, or
the OpenAI-compatible HTTP routes), as it reads:

    admit                   at most max_inflight at once, else RESOURCE_EXHAUSTED
    validate and tokenize   (intake.py: every field checked, tokenizing off the loop;
                            chat.py: a chat's tools, tool_choice and reasoning)
    local or not            the decode worker that holds (nearly) all of the prompt's
                            prefix computes it itself: no prefill worker, no KV moved;
                            every prompt a decode worker computes is logged and counted
                            with its reason (fallback.py)
    prefill                 the cheapest prefill worker for the prompt (its cached prefix
                            against its load, policy.py) that answers: the first token
                            and a KV handle; a failed worker's prompt goes to the next
    decode with migration   the cheapest decode worker paired with that prefill engine
                            pulls what it lacks of the KV and streams the rest; if it dies,
                            another one recomputes the prompt and the tokens streamed so
                            far and goes on
    parse a chat's output   its text as reasoning, content and tool calls
                            (chat_output.py), on every reply of either API

The caller's deadline (or --request-timeout) goes on to each call; a caller that leaves
closes the stream, which cancels the call in flight, which aborts the request on that
worker and frees its blocks. Who releases a prefill lease is decided in one place
(lease.py). Every request is one span (and its calls child spans), and feeds the metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import grpc
from opentelemetry import trace
from opentelemetry.context import Context

from baton.services.rpc import tracing
from baton.services.rpc.errors import Overloaded, Unavailable
from baton.services.rpc.server import status_of
from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk

from .clients import WorkerError
from .fallback import LocalPrefills, why_no_prefill
from .intake import Intake, Job
from .lease import PrefillLease
from .lora.registry import RouterLoras
from .metrics import RouterMetrics
from .registry import Registry
from .reply import Caller, Reply

log = logging.getLogger(__name__)


class Admission:
    """Slots of the router's max_inflight held for one request: all of its choices' at
    once (so none is refused once the response has started), each given back as its
    choice ends, and whatever is left when the request closes."""

    def __init__(self, router: Router, count: int):
        self.router, self.held = router, count

    def release(self, count: int = 1) -> None:
        count = min(count, self.held)
        self.held -= count
        r = self.router
        r.inflight -= count
        r.metrics.labels(r.metrics.inflight).set(r.inflight)


class Router:
    def __init__(self, registry: Registry, intake: Intake, max_inflight: int = 256,
                 request_timeout: float = 600.0, metrics: RouterMetrics | None = None,
                 served_model_name: str | None = None, shared_prefix_cache: bool = False,
                 loras: RouterLoras | None = None, stream_stall_timeout: float = 30.0):
        self.registry = registry
        self.stream_stall_timeout = stream_stall_timeout  # a stream read by no one is cut
        self.loras = loras or RouterLoras()  # the LoRA adapters it serves
        self.shared_prefix_cache = shared_prefix_cache  # every key's callers in one cache
        self.served_model_name = served_model_name  # overrides what the workers say
        self.intake = intake
        self.request_timeout = request_timeout
        self.max_inflight = max_inflight  # past it, RESOURCE_EXHAUSTED at once
        self.inflight = 0
        self.metrics = metrics or RouterMetrics()
        self.local_prefills = LocalPrefills(self.metrics)
        registry.on_refresh = self._count_workers

    def _count_workers(self) -> None:
        m = self.metrics
        if not m.model:  # label the series with the model, once a worker has said it
            if self.registry.model_info() is None:
                return
            m.model = self.model_info().served_model_name
        for role, workers in (("prefill", self.registry.prefill),
                              ("decode", self.registry.decode)):
            for state in ("unknown", "up", "draining", "down"):
                m.labels(m.workers, role=role, state=state).set(
                    sum(w.state == state for w in workers))
            m.labels(m.workers, role=role, state="retired").set(
                sum(w.role == role for w in self.registry.retired))

    def model_info(self) -> gen.ModelInfo:
        """The workers' model info, named as this router serves it: its own
        --served-model-name, else the workers', else the model's file or folder name."""
        info = self.registry.model_info()
        if info is None:
            raise Unavailable("no worker has answered yet")
        name = (self.served_model_name or info.served_model_name
                or info.model.removesuffix(".gguf"))
        if name != info.served_model_name:
            named = gen.ModelInfo()
            named.CopyFrom(info)
            named.served_model_name = name
            return named
        return info

    def admit(self, count: int = 1) -> Admission:
        """`count` of the max_inflight slots at once, or RESOURCE_EXHAUSTED (none held)."""
        m = self.metrics
        if self.inflight + count > self.max_inflight:
            m.labels(m.refused).inc()
            raise Overloaded(f"router at capacity: {self.inflight} requests in flight "
                             f"(limit {self.max_inflight})")
        self.inflight += count
        m.labels(m.inflight).set(self.inflight)
        return Admission(self, count)

    async def tokenize(self, request) -> list[int]:
        admission = self.admit()  # tokenizing is work too
        try:
            return await self.intake.prompt_ids(request, self.registry.model_info())
        finally:
            admission.release()

    async def generate(self, request: gen.GenerateRequest, caller: Caller,
                       admission: Admission | None = None
                       ) -> AsyncGenerator[gen.GenerateResponse]:
        """One request's stream; it holds one of `admission`'s slots (a choice of a
        request admitted whole), or takes its own."""
        m = self.metrics
        if admission is None:
            admission = self.admit()
        seen, error = m.request(time.monotonic()), None
        span, ctx = tracing.child("generate", caller.trace_context, trace.SpanKind.SERVER,
                                  **caller.attributes)
        try:
            lora = self.loras.adapter(request.lora)  # NOT_FOUND before any work
            job = await self.intake.job(request, self.registry.model_info())
            span.set_attribute("baton.request_id", job.request_id)
            span.set_attribute("baton.prompt_tokens", len(job.prompt_ids))
            if not m.model:
                m.model = self.model_info().served_model_name
            seen.prompt(len(job.prompt_ids))
            output = job.output() if job.output is not None else None  # chat.py
            # aclosing: a caller that leaves closes the inner generator now.
            async with aclosing(self._generate(job, caller, ctx, lora)) as replies:
                async for reply in replies:
                    if output is not None:  # reasoning, content and tool calls
                        output.apply(reply)
                    seen.reply(reply)
                    yield reply
        except Exception as e:
            error = status_of(e)[0].name
            span.set_status(trace.StatusCode.ERROR, str(e))
            raise
        finally:
            admission.release()
            seen.end(error)
            span.end()

    def cache_salt(self, job: Job, caller: Caller) -> str:
        """The salt every block hash of the request folds in (routing, the workers' prefix
        caches, their KV events): its own `cache_salt` within its caller's namespace, so
        callers with different API keys never share a cached block, nor learn from
        `cached_tokens` or `expected_cached_blocks` what another one sent. The key ids
        have one length: no salt of one namespace can spell another's."""
        return self.salt(job.request.cache_salt, caller)

    def salt(self, cache_salt: str, caller: Caller) -> str:
        """`cache_salt` within `caller`'s namespace (cache_salt above)."""
        if self.shared_prefix_cache or not caller.key_id:
            return cache_salt
        return f"{caller.key_id}/{cache_salt}"

    async def _generate(self, job: Job, caller: Caller, ctx: Context,
                        lora: wk.LoraAdapter | None = None):
        reply = Reply(job, self.cache_salt(job, caller), lora)
        local, why = self.registry.local_prefill(reply.blocks)
        if local is not None and why:  # conditional disaggregation: the decode worker prefills
            self._local(reply, why, f"on {local.address}")
            first, lease = None, PrefillLease(None, job.request_id)
        else:
            first, lease = await self._prefill(reply, caller, ctx)
        async with lease:
            if first is not None:
                yield reply.first_token(first)
                if first.delta.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
                    return
            async with aclosing(self._decode(reply, lease, caller, ctx, local)) as replies:
                async for out in replies:
                    yield out

    async def _prefill(self, reply: Reply, caller: Caller, ctx: Context
                       ) -> tuple[wk.PrefillResponse | None, PrefillLease]:
        """The first token and the lease, from the cheapest prefill worker that answers.
        Prefill has no side effects, so a failed worker's prompt goes to the next. With
        none left, (None, an empty lease): the decode worker prefills. A prefill worker
        being paired (just started, or restarted) is waited for (registry.pairing)."""
        job, r = reply.job, reply.job.request
        preq = wk.PrefillRequest(request_id=job.request_id, prompt_token_ids=job.prompt_ids,
                                 sampling=r.sampling, priority=r.priority,
                                 cache_salt=reply.cache_salt, lora=reply.lora)
        overloaded, m, failed = None, self.metrics, []
        await self.registry.pairing(self._left(caller))
        for worker in self.registry.prefills(reply.blocks):
            if worker.state != "up":  # went down (or draining) since the list was made
                continue
            worker.routed += 1
            worker.routed_tokens += self._work(worker, reply)
            reply.timings.expected_cached_blocks = self.registry.policy.matched(
                worker, reply.blocks)
            worker.index.predict(reply.blocks)
            lease = PrefillLease(worker, job.request_id)
            span, call_ctx = tracing.child("prefill", ctx, trace.SpanKind.CLIENT,
                                           **{"baton.worker": worker.address})
            try:
                first = await worker.client.prefill(preq, timeout=self._left(caller),
                                                    metadata=tracing.inject(call_ctx))
            except WorkerError as e:
                span.set_status(trace.StatusCode.ERROR, e.details)
                lease.lost(e.code)
                if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    overloaded = e  # another prefill worker may have room
                # ABORTED here is the prefill engine failing: no side effects, go on.
                elif not (e.worker_down or e.code == grpc.StatusCode.ABORTED):
                    raise e.as_service_error(f"prefill worker {worker.address}") from None
                log.warning("prefill worker %s failed (%s) on %s; trying the next",
                            worker.address, e.code.name, job.request_id)
                m.labels(m.retries).inc()
                failed.append(f"{worker.address} {e.code.name}")
                continue
            except BaseException:  # the client left while it prefilled
                lease.lost(None)
                raise
            finally:
                span.end()
            lease.granted(first.handle if first.HasField("handle") else None)
            return first, lease
        if overloaded is not None:  # back-pressure, not a reason to prefill on decode
            raise overloaded.as_service_error("every prefill worker is full")
        self._local(reply, *(("prefill_failed", "failed: " + ", ".join(failed)) if failed
                             else why_no_prefill(self.registry)))
        return None, PrefillLease(None, job.request_id)

    async def _decode(self, reply: Reply, lease: PrefillLease, caller: Caller, ctx: Context,
                      local=None):
        """The rest of the stream, from a decode worker (`local`, when it was chosen to
        prefill too); if it dies mid-stream, another one recomputes the prompt and
        `reply.streamed` and goes on: no gap, no repeat."""
        exclude: set[str] = set()
        overloaded, m = None, self.metrics
        while True:
            if exclude and reply.nothing_left(self.model_info().max_model_len):
                # The worker that went away had streamed the last token, not the end:
                # end it here as the engine would have (max_tokens or the context).
                yield reply.delta(gen.TokenDelta(finish_reason=gen.FINISH_REASON_LENGTH))
                return
            try:
                worker, paired = self.registry.pick_decode(lease.engine_id, exclude,
                                                           reply.blocks, prefer=local)
            except LookupError as e:
                if overloaded is not None:
                    raise overloaded.as_service_error("every decode worker is full") from None
                raise Unavailable(str(e)) from None
            local = None
            if lease.live and not paired:
                self._local(reply, "decode_unpaired", f"no decode worker can pull from "
                            f"prefill engine {lease.engine_id}: {worker.address} computes it")
                lease.give_up()
            if not reply.streamed:  # it computes the prompt: what did we expect it holds?
                worker.routed_tokens += self._work(worker, reply)
                reply.timings.local_prefill = True
                reply.timings.expected_cached_blocks = self.registry.policy.matched(
                    worker, reply.blocks)
            worker.index.predict(reply.blocks)
            span, call_ctx = tracing.child("decode", ctx, trace.SpanKind.CLIENT,
                                           **{"baton.worker": worker.address})
            dreq = reply.decode_request(lease)
            try:
                async for msg in worker.client.decode(dreq, timeout=self._left(caller),
                                                      metadata=tracing.inject(call_ctx)):
                    lease.taken_over()
                    if msg.timings.local_prefill and dreq.HasField("handle"):
                        self._local(reply, "kv_pull_failed", f"{worker.address} could not "
                                    f"pull it from {dreq.handle.engine_id} (its log says why)")
                    yield reply.decoded(msg)
                return
            except WorkerError as e:
                span.set_status(trace.StatusCode.ERROR, e.details)
                if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    overloaded = e
                elif not e.worker_down:
                    raise e.as_service_error(f"decode worker {worker.address}") from None
                log.warning("decode worker %s failed (%s); moving %s on after %d tokens",
                            worker.address, e.code.name, reply.job.request_id,
                            len(reply.streamed))
                m.labels(m.migrations).inc()
                exclude.add(worker.address)
            finally:
                span.end()

    def _work(self, worker, reply: Reply) -> int:
        """Prompt tokens `worker` will compute for `reply`'s request (what it lacks)."""
        if reply.blocks is None:
            return len(reply.job.prompt_ids)
        return max(0, round(self.registry.policy.uncached(worker, reply.blocks)))

    def _local(self, reply: Reply, reason: str, detail: str) -> None:
        """A decode worker computes the request's prompt: logged and counted, once."""
        if reply.local_reason is None:
            reply.local_reason = reason
            reply.timings.local_prefill = True
            self.local_prefills.record(reason, reply.job.request_id, detail)

    def _left(self, caller: Caller) -> float:
        """Every hop has a deadline: the caller's, or --request-timeout if it set none."""
        left = caller.time_remaining()
        return self.request_timeout if left is None else min(left, self.request_timeout)
