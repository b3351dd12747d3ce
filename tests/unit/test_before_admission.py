"""The bounds before admission, each alone (the abuse suite, test_abuse_admit.py, sends
them the real thing): bodies and gRPC messages not yet parsed share one budget
(router/unparsed.py, the Guard of router/openai/app.py), a parse keeps its API key's
turn until it ends, and the router's gRPC server serves at most --max-grpc-calls calls
at once."""

from __future__ import annotations

import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from baton.router import server as router_server
from baton.router.config import RouterConfig
from baton.router.intake import Intake
from baton.router.openai import app as app_module
from baton.router.openai.body import parsed
from baton.router.unparsed import ByteBudget, ParseTurns
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.errors import Overloaded
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle
from tests.integration.test_abuse_admit import HANG_S, _until


def test_bodies_not_yet_parsed_share_one_budget():
    entered, go = asyncio.Event(), asyncio.Event()

    async def route(scope, receive, send):  # reads the body, "parses" on /parsed
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/v1/parsed":
            parsed(scope)
        entered.set()
        await go.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        budget = ByteBudget(100)
        guard = app_module.Guard(route, Security(ServiceConfig(), ()), Lifecycle(), budget)
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            first = asyncio.ensure_future(client.post("/v1/held", content=b"x" * 60))
            await asyncio.wait_for(entered.wait(), HANG_S)
            assert budget.held == 60
            for size in (41, 100):  # over what is left: refused, the body never read
                refused = await asyncio.wait_for(client.post("/v1/x", content=b"x" * size),
                                                 HANG_S)
                assert refused.status_code == 429 and "--max-unparsed-bytes" in \
                    refused.json()["error"]["message"] and "retry-after" in refused.headers
            assert budget.held == 60
            go.set()
            assert (await first).status_code == 200 and budget.held == 0
            go.clear()
            entered.clear()
            first = asyncio.ensure_future(client.post("/v1/parsed", content=b"x" * 60))
            await asyncio.wait_for(entered.wait(), HANG_S)
            assert budget.held == 0  # the route parsed it: no longer held
            go.set()
            assert (await first).status_code == 200

    asyncio.run(main())


def test_grpc_messages_not_yet_parsed_share_the_budget():
    async def main():
        intake = Intake(tokenizer=None, unparsed_bytes=10)
        try:
            assert await intake.parse_message("k", len, b"x" * 10) == 10
            with pytest.raises(Overloaded, match="--max-unparsed-bytes"):
                await intake.parse_message("k", len, b"x" * 11)
            assert intake.unparsed.held == 0
        finally:
            intake.close()

    asyncio.run(main())


def test_a_parse_keeps_its_keys_turn_until_it_ends_even_if_its_caller_left():
    async def main():
        pool = ThreadPoolExecutor(3)
        turns, started, go, ran = ParseTurns(pool, per_key=1), threading.Event(), \
            threading.Event(), []
        try:
            first = asyncio.ensure_future(turns.run(
                "a", lambda: (started.set(), go.wait(HANG_S))))
            await _until(started.is_set)
            first.cancel()  # its caller left; the parse runs on, in key a's one turn
            with pytest.raises(asyncio.CancelledError):
                await first
            assert turns.keys() == 1 and turns._turns["a"].locked()
            second = asyncio.ensure_future(turns.run("a", ran.append, "a2"))
            assert await turns.run("b", ran.append, "b") is None  # another key: at once
            assert ran == ["b"] and turns._turns["a"].locked()
            go.set()
            await asyncio.wait_for(second, HANG_S)
            assert ran == ["b", "a2"] and turns.keys() == 0  # idle keys are forgotten
        finally:
            go.set()
            pool.shutdown()

    asyncio.run(main())




def test_the_router_serves_its_grpc_calls_within_the_bound(monkeypatch):
    served = {}

    async def run_server(*args, **kw):
        served.update(kw)

    monkeypatch.setattr(router_server, "run_server", run_server)
    router = SimpleNamespace(metrics=SimpleNamespace(registry=None))
    try:
        asyncio.run(router_server.run(RouterConfig(http_port=0, max_grpc_calls=7), router,
                                      Lifecycle()))
    finally:
        gc.unfreeze()  # run() freezes what is loaded by then
    assert served["max_calls"] == 7
