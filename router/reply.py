"""One request on its way back to its caller: who called (`Caller`: deadline, trace, API
key), and what it has been sent (`Reply`: the GenerateResponses built from the workers'
deltas, with the usage and timings, and every token the client has, which a migration to
another decode worker needs). The path that drives them is core.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.context import Context

from baton.services.rpc import tracing
from baton.services.rpc.errors import DeadlineExceeded
from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk

from .intake import Job
from .kv_index import PromptBlocks
from .lease import PrefillLease


@dataclass
class Caller:
    """What the router needs to know of whoever called: how long it may take, the trace
    it belongs to, and which API key it brought."""

    time_remaining: Callable[[], float | None] = lambda: None
    trace_context: Context | None = None
    attributes: dict = field(default_factory=dict)  # for its span (the OpenAI `user`)
    key_id: str = ""  # its key's security.key_id ("" without keys): never the key, never logged


class Reply:
    """Builds a request's GenerateResponses from the workers' deltas, and keeps what a
    migration needs: every token the client has."""

    def __init__(self, job: Job, cache_salt: str, lora: wk.LoraAdapter | None = None):
        self.job = job
        self.cache_salt = cache_salt  # the request's, in its caller's namespace
        self.lora = lora  # the LoRA adapter it runs (lora/registry.py); None: the base model
        self.blocks = PromptBlocks(job.prompt_ids, cache_salt, lora.name if lora else "")
        self.t0 = time.monotonic()
        self.local_reason: str | None = None  # why a decode worker computes its prompt
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

    def nothing_left(self, max_model_len: int) -> bool:
        """Every token the request may have is streamed (its max_tokens, or the context):
        a decode worker asked to go on would refuse it."""
        sampling, n = self.job.request.sampling, len(self.streamed)
        return ((sampling.HasField("max_tokens") and n >= sampling.max_tokens)
                or len(self.job.prompt_ids) + n >= max_model_len)

    def decode_request(self, lease: PrefillLease) -> wk.DecodeRequest:
        r = self.job.request
        dreq = wk.DecodeRequest(request_id=self.job.request_id,
                                prompt_token_ids=self.job.prompt_ids, sampling=r.sampling,
                                priority=r.priority, cache_salt=self.cache_salt,
                                lora=self.lora)
        if lease.handle is not None:  # live
            dreq.first_token_id = self.streamed[0]
            dreq.handle.CopyFrom(lease.handle)
            dreq.prefill_address = lease.worker.address
        else:
            dreq.output_token_ids.extend(self.streamed)
        return dreq


def caller_of(context, security) -> Caller:
    """The caller of a gRPC call: its deadline, its trace, and which API key it brought
    (`security`: the router's keys, which the interceptor has checked; None: no keys)."""
    metadata = context.invocation_metadata()
    key = security.grpc_key_id(metadata) if security is not None else ""
    return Caller(context.time_remaining, tracing.extract(metadata), key_id=key or "")


async def write_within(context, msg, stall: float) -> None:
    """One message of a stream to its gRPC client (a coroutine: gRPC's own flow control
    holds the write while the client's window is full); a write held for `stall` seconds
    (--stream-stall-timeout) cuts the stream, DEADLINE_EXCEEDED, and so aborts the
    request everywhere."""
    try:
        async with asyncio.timeout(stall):
            await context.write(msg)
    except TimeoutError:
        raise DeadlineExceeded(
            f"stream: the client read nothing for {stall:g} s (--stream-stall-timeout); "
            "its request was aborted") from None
