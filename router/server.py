"""The router: the public Generation API in front of prefill and decode workers.

One request's path (shared/DESIGN.md): validate and tokenize; pick a prefill and a decode
worker by load; Prefill returns the first token and a KV handle, streamed to the client at
once; Decode on the decode worker pulls the KV and streams the rest. The client's deadline
goes on to each call, and a cancelled client cancels the call in flight, which aborts the
request on that worker and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing

import grpc

from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.v1 import worker_pb2 as wk
from baton.v1 import worker_pb2_grpc as wk_grpc
from router.registry import Registry
from services.serving.convert import chat_messages, sampling_kwargs, stop_reason_of
from services.serving.sampling_params import SamplingParams
from services.serving.server import run_server, service_name
from services.serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Worker errors that mean "your request is wrong", passed on as they are; others become
# UNAVAILABLE (the worker or the network failed, not the client).
PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.CANCELLED}
RETRY_AFTER_MS = 1000  # the hint sent with RESOURCE_EXHAUSTED
MAX_CHARS_PER_TOKEN = 64  # no tokenizer packs more characters than this into a token
# What a worker that died (or whose engine failed) looks like from here: the request goes
# to another worker. A worker's deliberate refusal (ABORTED: e.g. a failed KV pull under
# the "fail" policy) does not.
WORKER_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class RouterServicer(gen_grpc.GenerationServicer):
    def __init__(self, registry: Registry, tokenizer: Tokenizer, max_inflight: int = 256,
                 request_timeout: float = 600.0):
        self.registry = registry
        self.tokenizer = tokenizer
        self.request_timeout = request_timeout
        self.max_inflight = max_inflight  # past it, RESOURCE_EXHAUSTED at once
        self.inflight = 0

    async def Generate(self, request, context):
        """Admission, then the request's whole path (_generate)."""
        if self.inflight >= self.max_inflight:
            context.set_trailing_metadata((("retry-after-ms", str(RETRY_AFTER_MS)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"router at capacity: {self.inflight} requests in flight "
                                f"(limit {self.max_inflight}); retry after "
                                f"{RETRY_AFTER_MS / 1000:.1f}s")
        self.inflight += 1
        try:
            # aclosing: a client that leaves closes the inner generator now, not at GC.
            async with aclosing(self._generate(request, context)) as replies:
                async for reply in replies:
                    yield reply
        finally:
            self.inflight -= 1

    async def _prompt_ids(self, request, context) -> list[int]:
        kind = request.WhichOneof("prompt")
        info = self.registry.model_info()
        if info is not None and kind == "text" and len(request.text) > MAX_CHARS_PER_TOKEN * (
                info.max_model_len):  # certainly too long: refuse before tokenizing it
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"text: {len(request.text)} characters cannot fit in "
                                f"max_model_len {info.max_model_len} tokens")
        try:
            if kind == "text":
                ids = self.tokenizer.encode(request.text)
            elif kind == "token_ids":
                ids = list(request.token_ids.ids)
            elif kind == "chat":
                ids = self.tokenizer.apply_chat_template(chat_messages(request.chat))
            else:
                raise ValueError("the request has no prompt (text, token_ids or chat)")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "prompt: empty (send text, token_ids or chat)")
        if info is not None:
            bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"token_ids: id {bad} is outside the vocabulary "
                                    f"[0, {info.vocab_size})")
            if len(ids) >= info.max_model_len:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"prompt: {len(ids)} tokens; max_model_len is "
                                    f"{info.max_model_len}")
        return ids

    async def _generate(self, request, context):
        t0 = time.monotonic()
        client_id = request.request_id or uuid.uuid4().hex
        # Workers see a unique id, so two clients that pick the same id (or a retry) can
        # never touch each other's request or lease.
        rid = f"{client_id}-{uuid.uuid4().hex[:12]}" if request.request_id else client_id
        ids = await self._prompt_ids(request, context)
        try:  # the engine's own rules, before any worker sees the request
            SamplingParams(**sampling_kwargs(request.sampling))
        except (ValueError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {e}")
        usage = gen.Usage(prompt_tokens=len(ids))
        timings = gen.Timings()
        dreq = wk.DecodeRequest(request_id=rid, prompt_token_ids=ids,
                                sampling=request.sampling, priority=request.priority,
                                cache_salt=request.cache_salt)

        # 1. Prefill: the first token and the KV handle, from the least loaded prefill
        #    worker that answers (prefill has no side effects, so a failure moves on).
        first, prefill = await self._prefill(rid, ids, request, context)
        streamed: list[int] = []  # every token the client has, for a migration
        if first is not None:
            usage.cached_tokens = first.cached_tokens
            timings.queue_s, timings.prefill_s = first.queue_s, first.prefill_s
            timings.first_token_s = time.monotonic() - t0
            reply = gen.GenerateResponse(request_id=client_id, text=first.text,
                                         token_ids=[first.first_token_id], timings=timings)
            if first.HasField("logprobs"):
                reply.logprobs.append(first.logprobs)
            streamed.append(first.first_token_id)
            usage.completion_tokens = 1
            if first.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
                reply.finish_reason = first.finish_reason
                _copy_stop(reply, first)
                reply.usage.CopyFrom(usage)
                yield reply
                return
            dreq.first_token_id = first.first_token_id
            dreq.handle.CopyFrom(first.handle)
            dreq.prefill_address = prefill.address
            try:
                yield reply
            except BaseException:
                _release_soon(prefill, rid)  # the client left before decode took over
                raise

        # 2. Decode: the rest, streamed as it is sampled. A decode worker that dies
        #    mid-stream hands over to another, which recomputes the KV of the prompt and of
        #    `streamed` and goes on from there: no gap, no repeated token.
        exclude: set[str] = set()
        while True:
            try:
                decode = self.registry.pick_decode(
                    prefill if dreq.HasField("handle") else None, exclude)
            except LookupError as e:
                if dreq.HasField("handle"):
                    _release_soon(prefill, rid)
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            call = wk_grpc.DecodeServiceStub(decode.channel).Decode(
                dreq, timeout=self._remaining(context))
            answered = False
            holds_lease = dreq.HasField("handle")
            try:
                async for msg in call:
                    answered = True
                    if not streamed and msg.token_ids:  # this decode worker prefilled
                        timings.first_token_s = time.monotonic() - t0
                    streamed += msg.token_ids
                    usage.completion_tokens += len(msg.token_ids)
                    out = gen.GenerateResponse(request_id=client_id, token_ids=msg.token_ids,
                                               text=msg.text, logprobs=msg.logprobs)
                    if msg.kv_transfer_s:
                        timings.kv_transfer_s = msg.kv_transfer_s
                    if msg.finish_reason != gen.FINISH_REASON_UNSPECIFIED:
                        out.finish_reason = msg.finish_reason
                        _copy_stop(out, msg)
                        out.usage.CopyFrom(usage)
                        out.timings.CopyFrom(timings)
                    yield out
                return
            except grpc.aio.AioRpcError as e:
                if e.code() not in WORKER_DOWN:
                    await self._abort_from(context, e, f"decode worker {decode.address}")
                log.warning("decode worker %s failed (%s); moving %s on after %d tokens",
                            decode.address, e.code().name, rid, len(streamed))
                exclude.add(decode.address)
                dreq.ClearField("handle")
                dreq.prefill_address = ""
                del dreq.output_token_ids[:]
                dreq.output_token_ids.extend(streamed)
            finally:
                call.cancel()  # a no-op when done; else the client left: end it on the worker
                if not answered and holds_lease:
                    _release_soon(prefill, rid)

    async def _prefill(self, rid: str, ids: list[int], request, context):
        """(PrefillResponse, worker) from the first prefill worker that answers, least
        loaded first; (None, None) if none can, and then the decode worker prefills."""
        preq = wk.PrefillRequest(request_id=rid, prompt_token_ids=ids,
                                 sampling=request.sampling, priority=request.priority,
                                 cache_salt=request.cache_salt)
        for prefill in self.registry.prefills():
            first = None
            try:
                first = await wk_grpc.PrefillServiceStub(prefill.channel).Prefill(
                    preq, timeout=self._remaining(context))
                return first, prefill
            except grpc.aio.AioRpcError as e:
                # ABORTED here is the prefill engine failing: no side effects, try another.
                if e.code() not in WORKER_DOWN | {grpc.StatusCode.ABORTED}:
                    await self._abort_from(context, e, f"prefill worker {prefill.address}")
                log.warning("prefill worker %s failed (%s) on %s; trying the next",
                            prefill.address, e.code().name, rid)
            finally:
                if first is None:  # failed or cancelled: a lease may exist that nobody knows
                    _release_soon(prefill, rid)
        return None, None

    def _remaining(self, context) -> float:
        """Every hop has a deadline: the client's, or --request-timeout if it set none."""
        left = context.time_remaining()
        return self.request_timeout if left is None else min(left, self.request_timeout)

    async def _abort_from(self, context, e: grpc.aio.AioRpcError, where: str) -> None:
        code = e.code() if e.code() in PASS_THROUGH else grpc.StatusCode.UNAVAILABLE
        await context.abort(code, f"{where}: {e.details()}")

    async def Tokenize(self, request, context):
        kind = request.WhichOneof("prompt")
        try:
            if kind == "chat":
                ids = self.tokenizer.apply_chat_template(chat_messages(request.chat))
            else:
                ids = self.tokenizer.encode(request.text)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return gen.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context):
        info = self.registry.model_info()
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker has answered yet")
        return gen.GetModelInfoResponse(info=info)


def _release_soon(prefill, rid: str) -> None:
    """Free a lease the decode worker never took over (the client left, or decode failed
    before its first reply). Idempotent on the worker; a failure leaves it to expire."""

    async def release():
        try:
            await wk_grpc.PrefillServiceStub(prefill.channel).ReleaseKv(
                wk.ReleaseKvRequest(request_id=rid), timeout=10)
        except grpc.aio.AioRpcError as e:
            log.warning("release of %s on %s failed: %s", rid, prefill.address, e.code())

    task = asyncio.get_running_loop().create_task(release())
    _PENDING.add(task)
    task.add_done_callback(_PENDING.discard)


_PENDING: set[asyncio.Task] = set()  # keeps fire-and-forget tasks alive until done


def _copy_stop(dst, src) -> None:
    reason = stop_reason_of(src)
    if isinstance(reason, str):
        dst.stop_string = reason
    elif isinstance(reason, int):
        dst.stop_token_id = reason


def serve(args) -> None:
    from services.serving.default_model import default_model_path

    tokenizer = Tokenizer(args.model or default_model_path())
    registry = Registry(args.prefill, args.decode)

    async def main():
        await registry.start()

        def register(server: grpc.aio.Server) -> list[str]:
            gen_grpc.add_GenerationServicer_to_server(
                RouterServicer(registry, tokenizer, args.max_inflight,
                               args.request_timeout), server)
            return [service_name(gen, "Generation")]

        await run_server(args.address, register, on_stop=registry.close,
                         grace_s=getattr(args, "drain_grace", 30.0))

    asyncio.run(main())
