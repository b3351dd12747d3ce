"""The abuse suite, for what the router sends back: an answer too big to render, a
/tokenize answer bigger than any prompt, and clients that stop reading their stream (SSE
and gRPC). Each is refused or cut while a poller of /health on the same router sees every
answer within 0.5 s, and a cut stream's request ends on the workers with every block
free; then a normal request is served. (test_abuse.py holds the giant requests.)"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import httpx

from baton.router.config import RouterConfig
from baton.router.openai.server import HttpServer
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from tests.e2e.topology import free_port
from tests.integration.test_abuse import _poll, served_as_ever
from tests.router_fakes import MAX_LEN, PROMPT, Cluster, cluster

STALL_S = 0.5  # --stream-stall-timeout here: each stalled stream is cut this long after
LONG = 40_000  # tokens: a stream that outlasts every test (x 21 within the answer bound)


async def _until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


@dataclass
class Door:
    c: Cluster
    client: httpx.AsyncClient
    port: int
    latencies: list[float]  # of the polls of /health so far
    poller: asyncio.Future

    def polls(self) -> int:
        if self.poller.done():  # a poll failed: say why
            self.poller.result()
        return len(self.latencies)


@asynccontextmanager
async def _front_door(tok):
    """The router (HTTP and gRPC) over fake workers, and a poller of its /health; after
    the body, a normal request is served by both APIs, and every poll was answered within
    0.5 s."""
    # Workers are not what is tested: slow polls on a busy machine must not mark them down.
    async with cluster(tok, worker_timeout=30, stream_stall_timeout=STALL_S) as c:
        port = free_port()
        config = RouterConfig(service=ServiceConfig("127.0.0.1:0"), http_port=port)
        http = HttpServer(config, c.router, Security(ServiceConfig(), ()), c.lifecycle)
        await http.start()
        gc.freeze()  # as the router's run() does once loaded (test_abuse.py says why)
        try:
            base = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                await _until(lambda: c.router.registry.readiness()[0], "never ready")
                stop, latencies = asyncio.Event(), []
                poller = asyncio.ensure_future(_poll(f"{base}/health", stop, latencies))
                try:
                    yield Door(c, client, port, latencies, poller)
                finally:
                    stop.set()
                    await poller
                await served_as_ever(client, c)
        finally:
            gc.unfreeze()
            await http.stop()
    # Idle, the slowest poll takes about 30 ms; on loop, the renders and parses refused
    # here would take seconds.
    assert latencies and max(latencies) < 0.5, sorted(latencies)[-3:]


def _blocks_free(c) -> bool:
    return (not any(w.blocks for w in c.decode) and c.leases_held() == 0
            and c.router.inflight == 0)


def test_a_giant_answer_and_a_huge_tokenize_are_refused_while_health_answers(tok):
    giant = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "n": 128,
             "max_tokens": 4096, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}
    huge = " a" * (MAX_LEN + 4000)  # a token each: more than max_model_len

    async def main():
        async with _front_door(tok) as door:
            c, client, rounds = door.c, door.client, 0
            while door.polls() < 10 or not rounds:  # each, until enough polls came
                rounds += 1
                t0 = time.perf_counter()
                reply = await client.post("/v1/chat/completions", json=giant)
                took = time.perf_counter() - t0
                error = reply.json()["error"]
                assert reply.status_code == 400 and error["param"] == "max_tokens", error
                for named in ("n 128", "max_tokens 4096", "top_logprobs 20",
                              "--max-answer-tokens"):
                    assert named in error["message"], error
                # Refused before anything ran (0.05 s idle; latency is the contract).
                assert took < 2.0 and not c.prefill[0].prefills, took
                reply = await client.post("/tokenize", json={"prompt": huge})
                error = reply.json()["error"]
                assert reply.status_code == 400 and error["param"] == "prompt", error
                assert f"max_model_len is {MAX_LEN}" in error["message"], error
                try:
                    await c.stub.Tokenize(gen.TokenizeRequest(text=huge), timeout=30)
                    raise AssertionError("a Tokenize past max_model_len was answered")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
                    assert e.details().startswith("prompt: "), e.details()
            assert c.router.inflight == 0

    asyncio.run(main())


async def _stalled_sse(address: tuple[str, int], body: dict) -> socket.socket:
    """A client that sends a streamed chat completion, then reads nothing: a small receive
    buffer (set before connecting, so the window stays small) fills fast."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, address)
    raw = json.dumps(body).encode()
    await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                            b"Content-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
    return sock


async def _read_all(sock: socket.socket) -> bytes:
    """What the server had sent, to the end of the connection."""
    loop, out = asyncio.get_running_loop(), []
    while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 30):
        out.append(chunk)
    return b"".join(out)


def test_a_client_that_stops_reading_its_sse_stream_is_cut_and_its_blocks_freed(tok):
    async def main():
        async with _front_door(tok) as door:
            c, polls = door.c, door.polls()
            # Each chunk a few KB (20 logprobs), so its buffers fill fast.
            sock = await _stalled_sse(("127.0.0.1", door.port), {
                "model": "fake", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": LONG, "logprobs": True, "top_logprobs": 20, "stream": True})
            try:
                await _until(lambda: c.decode[0].decodes, "the stream never started")
                # Its buffers fill, it reads nothing for STALL_S: cut, and the request
                # ends on the workers, every block free.
                await _until(lambda: _blocks_free(c), "the stalled stream was never cut")
                got = await _read_all(sock)  # the server closes once it is read
            finally:
                sock.close()
            assert got.startswith(b"HTTP/1.1 200") and b"data: {" in got
            # Cut, not ended: no [DONE], and no last chunk of the chunked body.
            assert b"[DONE]" not in got and not got.endswith(b"0\r\n\r\n"), got[-200:]
            assert door.polls() >= polls + 3  # polled while the stream stalled

    asyncio.run(main())


def test_a_client_that_stops_reading_its_grpc_stream_is_cut_and_its_blocks_freed(tok):
    async def main():
        async with _front_door(tok) as door:
            c = door.c
            # No BDP probing: the stream's window stays at 64 KiB, and fills fast with
            # 20 logprobs a token.
            async with grpc.aio.insecure_channel(
                    c.address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
                call = gen_grpc.GenerationStub(channel).Generate(gen.GenerateRequest(
                    token_ids=gen.TokenIds(ids=PROMPT),
                    sampling=gen.SamplingParams(max_tokens=LONG, logprobs=20)), timeout=120)
                replies = call.__aiter__()
                await replies.__anext__()  # then nothing is read
                await _until(lambda: _blocks_free(c), "the stalled stream was never cut")
                try:
                    async for _ in replies:  # what was sent before the cut, then its end
                        pass
                    raise AssertionError("a cut stream ended as if whole")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
                    assert "--stream-stall-timeout" in e.details(), e.details()

    asyncio.run(main())
