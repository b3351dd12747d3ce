"""The abuse suite, third pass (issue 38, items 1 and 6): a 60 MB Generate whose
structured output holds 60M packed one-byte start_after ids (it passed the wire count as
one field, then took the event loop seconds and GBs to copy and quote), and a 30M-character
tool_call_id, over gRPC and HTTP (counted by no bound). Each is refused naming its field
while a poller of /health on the same router sees every answer within 0.5 s; then a normal
request is served by both APIs. The requests are built before the poller starts, and sent
from the router's own loop: any stall they cause, the poller sees."""

from __future__ import annotations

import asyncio
import gc
import json
import time

import httpx

from baton.router.config import RouterConfig
from baton.router.openai.server import HttpServer
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security
from baton.v1 import generation_pb2 as gen
from tests.e2e.topology import free_port
from tests.integration.test_abuse import GENERATE, _number, _poll, _send_all, served_as_ever
from tests.router_fakes import cluster
from tests.unit.test_limits import _len_field

IDS = 60_000_000  # one byte each: a 60 MB request
CHARS = 30_000_000


def _packed_start_after(n: int) -> bytes:
    """Generate with a regex constraint whose start marker is `n` packed one-byte ids
    (built as bytes: a list of 60M ints would take seconds)."""
    structured = gen.StructuredOutput(regex="a").SerializeToString() + _len_field(
        _number(gen.StructuredOutput, "start_after_token_ids"), b"\x05" * n)
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
                {"role": "tool", "content": "hi", "tool_call_id": "c" * CHARS}]
    return [("/v1/chat/completions",
             json.dumps({"model": "fake", "messages": messages}).encode(), "messages")]


def test_packed_ids_and_giant_tool_call_ids_are_refused_while_health_answers(tok):
    bodies, requests = _http_bodies(), _grpc_requests()

    async def main():
        async with cluster(tok, worker_timeout=30) as c:  # slow polls mark no worker down
            port = free_port()
            config = RouterConfig(service=ServiceConfig("127.0.0.1:0"), http_port=port)
            http = HttpServer(config, c.router, Security(ServiceConfig(), ()), c.lifecycle)
            await http.start()
            base = f"http://127.0.0.1:{port}"
            gc.freeze()  # as the router's run() does once loaded
            try:
                async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                    deadline = time.monotonic() + 60  # until the router found its workers
                    while (await client.get("/health")).status_code != 200:
                        assert time.monotonic() < deadline, "the router never became ready"
                        await asyncio.sleep(0.01)
                    stop, latencies = asyncio.Event(), []
                    poller = asyncio.ensure_future(_poll(f"{base}/health", stop, latencies))
                    rounds = []  # every giant request each, until enough polls came meanwhile
                    while len(latencies) <= 10:
                        rounds.append(await _send_all(base, c.address, bodies, requests))
                    stop.set()
                    await poller
                    await served_as_ever(client, c)
            finally:
                gc.unfreeze()
                await http.stop()
        return rounds, latencies

    rounds, latencies = asyncio.run(main())
    for r in (r for results in rounds for r in results):
        assert r["status"] in (400, "INVALID_ARGUMENT") and r["param"] == r["want"], r
    # Before the fix, the packed ids alone held the loop for seconds (6.6 s measured).
    assert max(latencies) < 0.5, sorted(latencies)[-3:]
