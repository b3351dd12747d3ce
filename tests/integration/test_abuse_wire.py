"""The abuse suite, third pass (issue 38, items 1 and 6): a 16 MB Generate whose
structured output holds 16M packed one-byte start_after ids (it passed the wire count as
one field, then took the event loop seconds and GBs to copy and quote), and a
16M-character tool_call_id, over gRPC and HTTP (30M characters; counted by no bound).
Each is refused naming its field while a poller of /health on the same router sees every
answer within 0.5 s; then a normal request is served by both APIs. The requests are built
before the poller starts, and sent from the router's own loop: any stall they cause, the
poller sees.

Fourth pass (item 6): a 64 MB Generate, past the largest legal request, is refused by
gRPC itself (RESOURCE_EXHAUSTED) before a byte of it reaches Python, while /health and
gRPC health answer every poll within 0.3 s."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.v1 import generation_pb2 as gen
from tests.integration.test_abuse import (
    GENERATE,
    _number,
    _poll,
    _send_all,
    served_as_ever,
    serving_router,
)
from tests.unit.test_limits import _len_field

IDS = 16_000_000  # one byte each: a 16 MB request, within what gRPC lets through
CHARS = 16_000_000
HTTP_CHARS = 30_000_000
BIG_IDS = 16_000_000  # four bytes each: a 64 MB request


def _packed_start_after(n: int, one: bytes = b"\x05") -> bytes:
    """Generate with a regex constraint whose start marker is `n` packed ids, each `one`
    (built as bytes: a list of 16M ints would take seconds)."""
    structured = gen.StructuredOutput(regex="a").SerializeToString() + _len_field(
        _number(gen.StructuredOutput, "start_after_token_ids"), one * n)
    sampling = _len_field(_number(gen.SamplingParams, "structured_output"), structured)
    return gen.GenerateRequest(text="hi").SerializeToString() + _len_field(
        _number(gen.GenerateRequest, "sampling"), sampling)


def _grpc_requests() -> list[tuple[str, bytes, str]]:
    """(method, request bytes, the field its refusal names)"""
    tool = gen.ChatMessage(role="tool", content="hi", tool_call_id="c" * CHARS)
    return [
        (GENERATE, _packed_start_after(IDS),
         "sampling.structured_output.start_after_token_ids"),
        (GENERATE, gen.GenerateRequest(chat=gen.ChatMessages(messages=[
            gen.ChatMessage(role="user", content="hi"), tool])).SerializeToString(),
         "chat.messages"),
    ]


def _http_bodies() -> list[tuple[str, bytes, str]]:
    """(path, body, the field its refusal names)"""
    messages = [{"role": "user", "content": "hi"},
                {"role": "tool", "content": "hi", "tool_call_id": "c" * HTTP_CHARS}]
    return [("/v1/chat/completions",
             json.dumps({"model": "fake", "messages": messages}).encode(), "messages")]


def test_packed_ids_and_giant_tool_call_ids_are_refused_while_health_answers(tok):
    bodies, requests = _http_bodies(), _grpc_requests()

    async def main():
        async with serving_router(tok) as (c, base, client):
            stop, latencies = asyncio.Event(), []
            poller = asyncio.ensure_future(_poll(f"{base}/health", stop, latencies))
            rounds = []  # every giant request each, until enough polls came meanwhile
            while len(latencies) <= 10:
                rounds.append(await _send_all(base, c.address, bodies, requests))
            stop.set()
            await poller
            await served_as_ever(client, c)
        return rounds, latencies

    rounds, latencies = asyncio.run(main())
    for r in (r for results in rounds for r in results):
        assert r["status"] in (400, "INVALID_ARGUMENT") and r["param"] == r["want"], r
    # Before the fix, the packed ids alone held the loop for seconds (6.6 s measured).
    assert max(latencies) < 0.5, sorted(latencies)[-3:]


async def _poll_grpc(address: str, stop: asyncio.Event, latencies: list[float]) -> None:
    """gRPC health, on a channel of its own, as _poll asks /health."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            t0 = time.perf_counter()
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            latencies.append(time.perf_counter() - t0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await asyncio.sleep(0.01)


def _send(address: str, raw: bytes, times: int, out: list[str]) -> None:
    """`raw` as a Generate, `times` over, from a thread and a channel of its own: what
    it costs this process to send 64 MB is the client's, not the router's."""
    with grpc.insecure_channel(address, [("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_stream(GENERATE)
        for _ in range(times):
            try:
                list(call(raw, timeout=30))
                out.append("OK")
            except grpc.RpcError as e:
                out.append(f"{e.code().name}: {e.details()}")  # type: ignore[attr-defined]


def test_a_64_mb_generate_is_refused_by_grpc_while_health_answers_every_poll(tok):
    """Past the largest legal request (17 MB at the default limits) gRPC refuses the
    message itself: the router's raw check, the first to read a Generate's bytes, never
    sees it. Every poll of /health and of gRPC health, each on a connection opened
    before, is answered within 0.3 s meanwhile."""
    raw = _packed_start_after(BIG_IDS, b"\x80\x80\x80\x01")
    assert len(raw) > 64_000_000

    async def main():
        async with serving_router(tok) as (c, base, client):
            seen, check = [], c.lifecycle.request_checks[GENERATE]

            def counted(raw: bytes) -> None:  # the first to read a Generate's bytes
                seen.append(len(raw))
                check(raw)

            c.lifecycle.request_checks[GENERATE] = counted
            stop, http, health = asyncio.Event(), [], []
            pollers = [asyncio.ensure_future(_poll(f"{base}/health", stop, http)),
                       asyncio.ensure_future(_poll_grpc(c.address, stop, health))]
            while not (http and health):  # connected, before any abuse
                await asyncio.sleep(0.01)
            warm = len(http), len(health)
            statuses: list[str] = []
            sender = threading.Thread(target=_send, args=(c.address, raw, 5, statuses))
            sender.start()
            while sender.is_alive():
                await asyncio.sleep(0.01)
            stop.set()
            await asyncio.gather(*pollers)
            refused = list(seen)
            await served_as_ever(client, c)  # (its Generate goes through the check)
        return statuses, refused, http[warm[0]:], health[warm[1]:]

    statuses, seen, http, health = asyncio.run(main())
    assert len(statuses) == 5 and all(
        s.startswith("RESOURCE_EXHAUSTED") and "larger than max" in s for s in statuses), \
        statuses
    assert seen == [], "a message past the bound reached the router's Python"
    assert len(http) >= 10 and len(health) >= 10, (len(http), len(health))
    assert max(http) < 0.3 and max(health) < 0.3, (sorted(http)[-3:], sorted(health)[-3:])
