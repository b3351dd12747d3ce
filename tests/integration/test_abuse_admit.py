"""The abuse suite, before admission: what a caller may hold of the router before its
request counts against --max-inflight (router/openai/server.py, the Guard of
router/openai/app.py, router/unparsed.py, the model-length count of router/wire.py and
router/openai/body.py). Slow clients (headers or bodies trickled) are cut, connections
past the limit refused, a 7 MB body of a million prompt token ids (and its gRPC twin)
refused on its count, and an API key that floods the parse threads waits its own turn
while another key is served; each while a poller of /health on the same router sees
every answer within 0.5 s, and then a normal request is served. (Each bound alone:
test_before_admission.py.)"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from contextlib import asynccontextmanager

import grpc
import httpx
import pytest

from baton.router import wire
from baton.router.config import RouterConfig
from baton.router.openai import app as app_module
from baton.router.openai import body as body_module
from baton.router.openai.body import parse_body
from baton.router.openai.protocol import CompletionRequest
from baton.router.openai.server import HttpServer
from baton.services.common.limits import Limits
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.errors import InvalidArgument
from baton.services.rpc.security import Security
from baton.v1 import generation_pb2 as gen
from tests.e2e.topology import free_port
from tests.integration.test_abuse import GENERATE, _poll, served_as_ever
from tests.router_fakes import MAX_LEN, PROMPT, cluster, expected

MILLION = 1_000_000
KEYS = ("key-a", "key-b")
HANG_S = 10  # how long a test waits for what must come at once: past it, a hang


@asynccontextmanager
async def _router(tok, keys=(), **bounds):
    """The real router over fakes, its HTTP API with `bounds` (RouterConfig fields), and
    a poller of /health on a connection of its own; yields (cluster, base URL, the
    poller's latencies), and checks every poll was answered within 0.5 s."""
    async with cluster(tok, worker_timeout=30, api_keys=keys, **bounds) as c:
        port = free_port()
        config = RouterConfig(service=ServiceConfig("127.0.0.1:0"), http_port=port,
                              api_keys=keys, **bounds)
        http = HttpServer(config, c.router, Security(ServiceConfig(), keys), c.lifecycle)
        await http.start()
        base = f"http://127.0.0.1:{port}"
        gc.freeze()  # as the router's run() does once loaded (test_abuse.py)
        stop, latencies = asyncio.Event(), []
        poller = None
        try:
            async with httpx.AsyncClient(base_url=base) as client:
                deadline = time.monotonic() + 60  # until the router found its workers
                while (await client.get("/health")).status_code != 200:
                    assert time.monotonic() < deadline, "the router never became ready"
                    await asyncio.sleep(0.01)
            poller = asyncio.ensure_future(_poll(f"{base}/health", stop, latencies))
            while not latencies:  # its connection is open before any abuser's
                await asyncio.sleep(0.01)
            c.http = http
            yield c, base, latencies
            stop.set()
            await poller
        finally:
            stop.set()
            if poller is not None and not poller.done():
                poller.cancel()
            gc.unfreeze()
            await http.stop()
    # Idle, the slowest poll takes about 30 ms.
    assert len(latencies) > 1 and max(latencies) < 0.5, sorted(latencies)[-3:]


async def _served(base: str, c, key: str | None = None) -> None:
    """A normal request, over both APIs, answered as ever."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=base, timeout=HANG_S, headers=headers) as client:
        await served_as_ever(client, c, key)


async def _connect(port: int, first: bytes):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(first)
    await writer.drain()
    return reader, writer


async def _answer(reader) -> bytes:
    """What the router sent before it closed (a reset after its answer included)."""
    got = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), HANG_S):
            got += chunk
    except ConnectionError:
        pass
    return got


async def _trickle(writer, byte: bytes) -> None:
    """One byte at a time, as a slow client sends, until the router closes on it."""
    try:
        while not writer.is_closing():
            writer.write(byte)
            await writer.drain()
            await asyncio.sleep(0.05)
    except (ConnectionError, OSError):
        pass


def test_slow_clients_are_cut_and_connections_past_the_limit_refused(tok):
    async def main():
        bounds = {"max_http_connections": 6, "http_header_timeout": 0.5,
                  "http_body_timeout": 0.5}
        async with _router(tok, **bounds) as (c, base, _):
            port = int(base.rsplit(":", 1)[1])
            # Three trickle their headers, two their bodies: with the poller's, the six
            # connections of the limit.
            slow = [await _connect(port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
                    for _ in range(3)]
            slow += [await _connect(port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                                    b"content-type: application/json\r\n"
                                    b"content-length: 100000\r\n\r\n{") for _ in range(2)]
            trickles = [asyncio.ensure_future(_trickle(w, b"x" if i < 3 else b" "))
                        for i, (_, w) in enumerate(slow)]
            connections = c.http.server.server_state.connections
            deadline = time.monotonic() + HANG_S
            while len(connections) < 6:
                assert time.monotonic() < deadline, len(connections)
                await asyncio.sleep(0.01)
            for _ in range(3):  # past the limit: 503 at once, nothing read
                reader, writer = await _connect(port, b"")
                reply = await _answer(reader)
                assert reply.startswith(b"HTTP/1.1 503 ") and b"--max-http-connections" \
                    in reply, reply
                writer.close()
            replies = [await _answer(r) for r, _ in slow]
            for w in (w for _, w in slow):
                w.close()
            await asyncio.gather(*trickles)
            for reply in replies[:3]:
                assert reply.startswith(b"HTTP/1.1 408 ") and b"--http-header-timeout" \
                    in reply, reply
            for reply in replies[3:]:
                assert reply.startswith(b"HTTP/1.1 408 ") and b"--http-body-timeout" \
                    in reply, reply
            assert c.router.intake.unparsed.held == 0  # the cut bodies' bytes given back
            await _served(base, c)

    asyncio.run(main())


def test_a_million_prompt_token_ids_are_refused_on_their_count(tok):
    body = b'{"model": "fake", "prompt": [' + b"12345, " * (MILLION - 1) + b"12345]}"
    assert len(body) > 7_000_000
    ids = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[12345] * MILLION),
                              sampling=gen.SamplingParams(max_tokens=4))

    async def main():
        async with _router(tok) as (c, base, _):
            async with httpx.AsyncClient(base_url=base, timeout=HANG_S) as client:
                t0 = time.perf_counter()
                reply = await client.post("/v1/completions", content=body,
                                          headers={"content-type": "application/json"})
                took = time.perf_counter() - t0
            error = reply.json()["error"]
            assert reply.status_code == 400 and error["param"] == "prompt", reply.text
            # Counted up to the model's length, never parsed whole (1.9 s idle).
            assert f"{MAX_LEN} or more token ids; max_model_len is {MAX_LEN}" \
                in error["message"], error
            # Idle it takes 0.1 s: latency is the contract, bounded at 20 times that.
            assert took < 2.0, took
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.stub.Generate(ids, timeout=HANG_S).read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith(f"token_ids: {MILLION} or more token ids; "
                                                f"max_model_len is {MAX_LEN}")
            await _served(base, c)

    asyncio.run(main())


@pytest.mark.parametrize("prompt", [[7] * 10, [[7], [7] * 10]])
@pytest.mark.parametrize("counting", [False, True])
def test_a_prompt_of_token_ids_that_cannot_fit_the_model_is_refused(prompt, counting,
                                                                     monkeypatch):
    if counting:  # the parse that counts as it goes, which big bodies take
        monkeypatch.setattr(body_module, "CHEAP", 0)
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()
    assert parse_body(raw, CompletionRequest, Limits(), 11).prompt == prompt
    with pytest.raises(InvalidArgument, match="^prompt: 10 .*max_model_len is 10$"):
        parse_body(raw, CompletionRequest, Limits(), 10)
    ids = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[7] * 6)).SerializeToString()
    wire.check_generate(Limits(), lambda: 10)(ids)
    wire.check_generate(Limits(), lambda: None)(ids * 2)  # no worker has said it yet
    with pytest.raises(InvalidArgument, match="^token_ids: 12 or more token ids; "
                                              "max_model_len is 10$"):
        wire.check_generate(Limits(), lambda: 10)(ids * 2)  # protobuf merges the two


class _Blocked:
    """Parses that wait for `go` while their request holds `marker`: how many ever ran
    at once, and how many are waiting now."""

    def __init__(self, marker: bytes):
        self.marker, self.go = marker, threading.Event()
        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def wrap(self, fn):
        def blocked(raw, *args):
            flood = self.marker in (raw if isinstance(raw, bytes) else b"".join(raw))
            if flood:
                with self.lock:
                    self.now += 1
                    self.most = max(self.most, self.now)
                self.go.wait(HANG_S)
                with self.lock:
                    self.now -= 1
            return fn(raw, *args)

        return blocked


async def _until(condition) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, "waited in vain"
        await asyncio.sleep(0.01)


def test_a_key_that_floods_the_parse_threads_waits_its_own_turn(tok, monkeypatch):
    http_flood = _Blocked(b'"flood"')
    monkeypatch.setattr(app_module, "parse_body", http_flood.wrap(app_module.parse_body))

    async def main():
        async with _router(tok, keys=KEYS) as (c, base, _):
            a = httpx.AsyncClient(base_url=base, timeout=HANG_S,
                                  headers={"Authorization": "Bearer key-a"})
            async with a:
                flood = [asyncio.ensure_future(a.post("/v1/completions", json={
                    "model": "fake", "prompt": PROMPT, "max_tokens": 2, "user": "flood"}))
                    for _ in range(4)]
                await _until(lambda: http_flood.now)
                # key-a's parses wait their turn; key-b's is served meanwhile.
                await asyncio.wait_for(_served(base, c, key="key-b"), HANG_S)
                http_flood.go.set()
                assert all(r.status_code == 200 for r in await asyncio.gather(*flood))
            assert http_flood.most == 1  # --max-parses-per-key

            grpc_flood = _Blocked(b"flood")
            check = c.lifecycle.request_checks[GENERATE]
            c.lifecycle.request_checks[GENERATE] = grpc_flood.wrap(check)
            calls = [asyncio.ensure_future(c.generate(PROMPT, 2, key="key-a",
                                                      request_id=f"flood-{i}"))
                     for i in range(4)]
            await _until(lambda: grpc_flood.now)
            await asyncio.wait_for(_served(base, c, key="key-b"), HANG_S)
            grpc_flood.go.set()
            for msgs in await asyncio.gather(*calls):
                assert [t for m in msgs for t in m.delta.token_ids] == expected(PROMPT, 2)
            assert grpc_flood.most == 1
            assert c.router.intake.turns.keys() == 0  # idle keys are forgotten

    asyncio.run(main())
