"""The router: the public Generation API in front of prefill and decode workers.

One request's path (shared/DESIGN.md), as `Generate` reads:

    validate and tokenize   (intake.py: every field checked, tokenizing off the loop)
    prefill                 the least loaded prefill worker that answers: the first token
                            and a KV handle; a failed worker's prompt goes to the next
    decode with migration   a decode worker paired with that prefill engine pulls the KV
                            and streams the rest; if it dies, another one recomputes the
                            prompt and the tokens streamed so far and goes on

The client's deadline (or --request-timeout) goes on to each call; a client that leaves
cancels the call in flight, which aborts the request on that worker and frees its
blocks. Who releases a prefill lease is decided in one place (lease.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

import grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.v1 import worker_pb2 as wk
from router.clients import GrpcWorkerClient, WorkerError
from router.config import RouterConfig
from router.intake import Intake, Job
from router.lease import PrefillLease
from router.registry import Registry, Worker
from services.serving.errors import Overloaded, Unavailable
from services.serving.server import Lifecycle, method_name, run_server, service_name
from services.serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Reply:
    """Builds a request's GenerateResponses from the workers' deltas, and keeps what a
    migration needs: every token the client has."""

    def __init__(self, job: Job):
        self.job = job
        self.t0 = time.monotonic()
        self.streamed: list[int] = []
        self.usage = gen.Usage(prompt_tokens=len(job.prompt_ids))
        self.timings = gen.Timings()

    def first_token(self, prefill: wk.PrefillResponse) -> gen.GenerateResponse:
        self.usage.cached_tokens = prefill.cached_tokens
        self.timings.MergeFrom(prefill.timings)
        return self.delta(prefill.delta)

    def decoded(self, msg: wk.DecodeResponse) -> gen.GenerateResponse:
        if msg.HasField("timings"):  # the first reply of a decode worker
            self.timings.kv_transfer_s = msg.timings.kv_transfer_s
            if not self.streamed:  # it computed the prompt itself
                self.timings.queue_s = msg.timings.queue_s
                self.timings.prefill_s = msg.timings.prefill_s
                self.usage.cached_tokens = msg.cached_tokens
        return self.delta(msg.delta)

    def delta(self, delta: gen.TokenDelta) -> gen.GenerateResponse:
        out = gen.GenerateResponse(request_id=self.job.client_id, delta=delta)
        if not self.streamed and delta.token_ids:
            self.timings.first_token_s = time.monotonic() - self.t0
            out.timings.CopyFrom(self.timings)
        self.streamed += delta.token_ids
        if delta.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
            self.usage.completion_tokens = len(self.streamed)
            out.usage.CopyFrom(self.usage)
            out.timings.CopyFrom(self.timings)
        return out

    def decode_request(self, lease: PrefillLease) -> wk.DecodeRequest:
        r = self.job.request
        dreq = wk.DecodeRequest(request_id=self.job.request_id,
                                prompt_token_ids=self.job.prompt_ids, sampling=r.sampling,
                                priority=r.priority, cache_salt=r.cache_salt)
        if lease.live:
            dreq.first_token_id = self.streamed[0]
            dreq.handle.CopyFrom(lease.handle)
            dreq.prefill_address = lease.worker.address
        else:
            dreq.output_token_ids.extend(self.streamed)
        return dreq


class RouterServicer(gen_grpc.GenerationServicer):
    def __init__(self, registry: Registry, intake: Intake, max_inflight: int = 256,
                 request_timeout: float = 600.0):
        self.registry = registry
        self.intake = intake
        self.request_timeout = request_timeout
        self.max_inflight = max_inflight  # past it, RESOURCE_EXHAUSTED at once
        self.inflight = 0

    async def Generate(self, request, context):
        if self.inflight >= self.max_inflight:
            raise Overloaded(f"router at capacity: {self.inflight} requests in flight "
                             f"(limit {self.max_inflight})")
        self.inflight += 1
        try:
            job = await self.intake.job(request, self.registry.model_info())
            # aclosing: a client that leaves closes the inner generator now, not at GC.
            async with aclosing(self._generate(job, context)) as replies:
                async for reply in replies:
                    yield reply
        finally:
            self.inflight -= 1

    async def _generate(self, job: Job, context):
        reply = Reply(job)
        first, lease = await self._prefill(job, context)
        async with lease:
            if first is not None:
                yield reply.first_token(first)
                if first.delta.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
                    return
            async with aclosing(self._decode(reply, lease, context)) as replies:
                async for out in replies:
                    yield out

    async def _prefill(self, job: Job, context) -> tuple[wk.PrefillResponse | None,
                                                          PrefillLease]:
        """The first token and the lease, from the least loaded prefill worker that
        answers. Prefill has no side effects, so a failed worker's prompt goes to the
        next. With none left, (None, an empty lease): the decode worker prefills."""
        r = job.request
        preq = wk.PrefillRequest(request_id=job.request_id, prompt_token_ids=job.prompt_ids,
                                 sampling=r.sampling, priority=r.priority,
                                 cache_salt=r.cache_salt)
        overloaded = None
        for worker in self.registry.prefills():
            if worker.state != "up":  # went down (or draining) since the list was made
                continue
            worker.routed += 1
            lease = PrefillLease(worker, job.request_id)
            try:
                first = await worker.client.prefill(preq, timeout=self._left(context))
            except WorkerError as e:
                lease.give_up()
                if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    overloaded = e  # another prefill worker may have room
                # ABORTED here is the prefill engine failing: no side effects, go on.
                elif not (e.worker_down or e.code == grpc.StatusCode.ABORTED):
                    raise e.as_service_error(f"prefill worker {worker.address}") from None
                log.warning("prefill worker %s failed (%s) on %s; trying the next",
                            worker.address, e.code.name, job.request_id)
                continue
            except BaseException:  # the client left while it prefilled
                lease.give_up()
                raise
            lease.granted(first.handle if first.HasField("handle") else None)
            return first, lease
        if overloaded is not None:  # back-pressure, not a reason to prefill on decode
            raise overloaded.as_service_error("every prefill worker is full")
        return None, PrefillLease(None, job.request_id)

    async def _decode(self, reply: Reply, lease: PrefillLease, context):
        """The rest of the stream, from a decode worker; if it dies mid-stream, another
        one recomputes the prompt and `reply.streamed` and goes on: no gap, no repeat."""
        exclude: set[str] = set()
        overloaded = None
        while True:
            try:
                worker, paired = self.registry.pick_decode(lease.engine_id, exclude)
            except LookupError as e:
                if overloaded is not None:
                    raise overloaded.as_service_error("every decode worker is full") from None
                raise Unavailable(str(e)) from None
            if lease.live and not paired:
                log.warning("no decode worker can pull from prefill engine %s; %s "
                            "recomputes the prompt", lease.engine_id, worker.address)
                lease.give_up()
            try:
                async for msg in worker.client.decode(reply.decode_request(lease),
                                                      timeout=self._left(context)):
                    lease.taken_over()
                    yield reply.decoded(msg)
                return
            except WorkerError as e:
                if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    overloaded = e
                elif not e.worker_down:
                    raise e.as_service_error(f"decode worker {worker.address}") from None
                log.warning("decode worker %s failed (%s); moving %s on after %d tokens",
                            worker.address, e.code.name, reply.job.request_id,
                            len(reply.streamed))
                exclude.add(worker.address)

    def _left(self, context) -> float:
        """Every hop has a deadline: the client's, or --request-timeout if it set none."""
        left = context.time_remaining()
        return self.request_timeout if left is None else min(left, self.request_timeout)

    async def Tokenize(self, request, context):
        ids = await self.intake.prompt_ids(request, self.registry.model_info())
        return gen.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context):
        info = self.registry.model_info()
        if info is None:
            raise Unavailable("no worker has answered yet")
        return gen.GetModelInfoResponse(info=info)


def build(config: RouterConfig, lifecycle: Lifecycle, prefill: list, decode: list
          ) -> tuple[RouterServicer, Registry]:
    """The router over the given worker clients: its registry tells `lifecycle` when it
    can serve (NOT_SERVING until then), and the servicer."""
    from services.serving.default_model import default_model_path

    registry = Registry([Worker(c.address, "prefill", c) for c in prefill],
                        [Worker(c.address, "decode", c) for c in decode],
                        poll_s=config.poll_interval, worker_timeout_s=config.worker_timeout,
                        on_ready=lambda ready, why: lifecycle.set_serving(ready))
    intake = Intake(Tokenizer(config.model or default_model_path()))
    return RouterServicer(registry, intake, config.max_inflight,
                          config.request_timeout), registry


def serve(config: RouterConfig) -> None:
    """Run the router until SIGTERM, then drain its streams."""
    lifecycle = Lifecycle((method_name(gen, "Generation", "Generate"),))

    async def main():
        servicer, registry = build(config, lifecycle,
                                   [GrpcWorkerClient(a) for a in config.prefill],
                                   [GrpcWorkerClient(a) for a in config.decode])

        def register(server: grpc.aio.Server) -> list[str]:
            gen_grpc.add_GenerationServicer_to_server(servicer, server)
            return [service_name(gen, "Generation")]

        async def stop() -> None:
            await registry.close()
            servicer.intake.close()

        # Listening first (NOT_SERVING until the registry finds a worker to serve with).
        await run_server(config.address, register, lifecycle, on_start=registry.start,
                         on_stop=stop, grace_s=config.drain_grace, serving_at_start=False)

    asyncio.run(main())
