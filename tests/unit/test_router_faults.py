"""What an outside fault probe found at the router, against fake workers on loopback: a
huge prompt must not stall other clients, chat input is validated, the retry hint
survives the router, a stream whose decode worker dies moves on even when no remaining
decode worker can pull from its prefill worker, and a frozen worker counts as dead."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.v1 import generation_pb2 as gen
from tests.unit.router_fakes import MAX_LEN, PROMPT, cluster, expected, request, tokens


def run(coro):
    return asyncio.run(coro)


def test_a_huge_prompt_does_not_stall_other_streams_or_health_checks(tok):
    """Tokenizing megabytes takes seconds: it runs off the event loop, so a stream in
    flight keeps its pace and health checks answer meanwhile."""

    async def main():
        async with cluster(tok) as c:
            c.decode[0].token_delay_s = 0.02
            huge = gen.GenerateRequest(text="The quick brown fox jumps over the dog. " * 60000,
                                       sampling=gen.SamplingParams(max_tokens=4))
            gaps, health_waits = [], []

            async def stream():
                last = time.monotonic()
                async for _ in c.stub.Generate(request(PROMPT, 120), timeout=30):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            async def probe_health():
                async with grpc.aio.insecure_channel(c.address) as ch:
                    stub = health_pb2_grpc.HealthStub(ch)
                    for _ in range(10):
                        t0 = time.monotonic()
                        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                        health_waits.append(time.monotonic() - t0)
                        await asyncio.sleep(0.1)

            async def send_huge():
                await asyncio.sleep(0.2)
                with pytest.raises(grpc.aio.AioRpcError) as e:  # too many tokens, once known
                    await c.stub.Generate(huge, timeout=60).read()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            t0 = time.monotonic()
            await asyncio.gather(stream(), probe_health(), send_huge())
            assert time.monotonic() - t0 > 1.0  # the huge prompt did take a while
            assert max(gaps[1:]) < 0.5, max(gaps[1:])
            assert max(health_waits) < 0.5, max(health_waits)

    run(main())


@pytest.mark.parametrize("kind", ["text", "chat", "tokenize-text", "tokenize-chat"])
def test_every_prompt_is_bounded_before_tokenizing(tok, kind):
    async def main():
        async with cluster(tok) as c:
            limit = 64 * MAX_LEN
            big = "x" * (limit + 1)
            half = gen.ChatMessage(role="user", content="y" * (limit // 2 + 1))
            chat = gen.ChatMessages(messages=[half, half])  # each fits; their sum does not
            with pytest.raises(grpc.aio.AioRpcError) as e:
                if kind == "text":
                    await c.stub.Generate(gen.GenerateRequest(text=big)).read()
                elif kind == "chat":
                    await c.stub.Generate(gen.GenerateRequest(chat=chat)).read()
                elif kind == "tokenize-text":
                    await c.stub.Tokenize(gen.TokenizeRequest(text=big))
                else:
                    await c.stub.Tokenize(gen.TokenizeRequest(chat=chat))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            field = "text" if kind.endswith("text") else "chat.messages"
            assert e.value.details().startswith(field), e.value.details()
            assert not c.prefill[0].prefills

    run(main())


@pytest.mark.parametrize("messages, field", [
    ([], "chat.messages: empty"),
    ([("user", "hi"), ("robot", "beep")], "chat.messages[1].role"),
    ([("", "hi")], "chat.messages[0].role"),
])
def test_chat_input_is_validated_naming_the_field(tok, messages, field):
    async def main():
        async with cluster(tok) as c:
            chat = gen.ChatMessages(messages=[gen.ChatMessage(role=r, content=t)
                                              for r, t in messages])
            for call in (c.stub.Generate(gen.GenerateRequest(chat=chat)).read(),
                         c.stub.Tokenize(gen.TokenizeRequest(chat=chat))):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details().startswith(field), e.value.details()
            assert not c.prefill[0].prefills and not c.decode[0].decodes

    run(main())


@pytest.mark.parametrize("full", ["prefill", "decode"])
def test_a_workers_retry_hint_reaches_the_client(tok, full):
    async def main():
        async with cluster(tok) as c:
            worker = c.prefill[0] if full == "prefill" else c.decode[0]
            worker.fail_with = grpc.StatusCode.RESOURCE_EXHAUSTED
            worker.retry_after_ms = 2500
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate(PROMPT, 4)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            hints = dict(e.value.trailing_metadata())
            assert hints["retry-after-ms"] == hints["grpc-retry-pushback-ms"] == "2500"
            await c.settle()
            assert c.leases_held() == 0

    run(main())


def test_the_routers_own_refusal_carries_both_hints(tok):
    async def main():
        async with cluster(tok, max_inflight=1) as c:
            c.decode[0].token_delay_s = 0.2
            first = asyncio.ensure_future(c.generate(PROMPT, 4))
            await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate(PROMPT, 4)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            hints = dict(e.value.trailing_metadata())
            assert hints["retry-after-ms"] == hints["grpc-retry-pushback-ms"]
            await first

    run(main())


@pytest.mark.parametrize("when", ["mid-stream", "before-answering"])
def test_no_decode_worker_left_that_pairs_with_the_prefill_worker_recomputes(tok, when):
    """d0 (paired with p0) dies; d1 cannot pull from p0. d1 recomputes the prompt and the
    tokens streamed so far, and the lease is released."""

    async def main():
        async with cluster(tok, decodes=2, poll_interval=10) as c:
            d0, d1 = c.decode
            d1.connect_error = "KV layout mismatch (dtype: ours float16, peer float32)"
            c.registry.decode[1].pairs.clear()
            await c.registry.refresh()
            await c.registry.handshakes(timeout=5)
            d0.die_after = 3 if when == "mid-stream" else 0
            msgs = await c.generate(PROMPT, 10)
            assert tokens(msgs) == expected(PROMPT, 10)
            [handed] = d1.decodes
            assert not handed.HasField("handle")
            await c.settle()
            assert c.leases_held() == 0

    run(main())


async def _stream_striking_its_decode_worker(c, fault: str):
    """Streams 12 tokens of PROMPT, checked; after the third message, the decode worker
    serving it suffers `fault` (a fake worker's method). Returns that worker and the
    seconds from the fault to the next message."""
    msgs = []
    async for m in c.stub.Generate(request(PROMPT, 12), timeout=20):
        msgs.append(m)
        if len(msgs) == 3:
            victim = next(d for d in c.decode if d.decodes)
            getattr(victim, fault)()
            struck = time.monotonic()
        elif len(msgs) == 4:
            moved_after = time.monotonic() - struck
    assert tokens(msgs) == expected(PROMPT, 12)
    return victim, moved_after


def test_a_frozen_decode_worker_counts_as_dead_within_the_worker_timeout(tok):
    """SIGSTOP-like: alive, silent. The registry's polls get no answer for worker_timeout
    (0.5 s here), so it is marked down and the stream moves on to the other worker."""

    async def main():
        async with cluster(tok, decodes=2) as c:
            _, moved_after = await _stream_striking_its_decode_worker(c, "freeze")
            assert moved_after < 0.5 + 0.05 + 1.0  # timeout + poll interval + slack

    run(main())


@pytest.mark.parametrize("frozen", ["one", "both"])
def test_a_frozen_prefill_worker_counts_as_dead_and_the_prompt_moves_on(tok, frozen):
    """A prompt stuck on a frozen prefill worker moves on when the worker is found
    silent: to the other prefill worker, or, when that one froze too, to a decode worker
    (never to a worker already known to be down)."""

    async def main():
        async with cluster(tok, prefills=2) as c:
            for p in c.prefill:
                p.freeze()
            if frozen == "one":
                c.prefill[1].thaw()
            t0 = time.monotonic()
            results = await asyncio.gather(*(c.generate(PROMPT, 4, timeout=20)
                                             for _ in range(3)))
            assert all(tokens(m) == expected(PROMPT, 4) for m in results)
            assert time.monotonic() - t0 < 3.0

    run(main())


def test_a_handshake_that_hangs_does_not_delay_noticing_a_frozen_worker(tok):
    async def main():
        async with cluster(tok, decodes=2) as c:
            d0, d1 = c.decode
            d1.connect_hangs = True
            c.registry.decode[1].pairs.clear()  # as if d1 restarted: handshake again
            await asyncio.sleep(0.3)  # the handshake is under way (and hangs)
            msgs = []
            t0 = time.monotonic()
            async for m in c.stub.Generate(request(PROMPT, 12), timeout=20):
                msgs.append(m)
                if len(msgs) == 2:
                    next(d for d in c.decode if d.decodes).freeze()
            assert tokens(msgs) == expected(PROMPT, 12)
            assert time.monotonic() - t0 < 3.0
            d1.connect_hangs = False

    run(main())


def test_a_decode_worker_whose_engine_stalled_counts_as_dead(tok):
    """It answers its polls, saying its engine thread is stuck (engine_stalled_since):
    marked down at the next poll, well within the worker timeout, so the stream moves on
    to the other worker; once its engine steps again, it is up again."""

    async def main():
        async with cluster(tok, decodes=2) as c:
            victim, moved_after = await _stream_striking_its_decode_worker(c, "stall_engine")
            assert moved_after < 1.0  # a poll (0.05 s) and the move: no need to go silent
            worker = next(w for w in c.registry.decode if w.address == victim.address)
            assert worker.state == "down"
            victim.thaw()
            deadline = time.monotonic() + 5
            while worker.state != "up":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)

    run(main())
