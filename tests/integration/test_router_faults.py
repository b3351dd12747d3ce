"""What an outside fault probe found at the router, against fake workers on loopback: a
huge prompt must not stall other clients, chat input is validated, the retry hint
survives the router, a stream whose decode worker dies moves on even when no remaining
decode worker can pull from its prefill worker, and a frozen worker counts as dead."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.v1 import generation_pb2 as gen
from tests.router_fakes import MAX_LEN, PROMPT, cluster, expected, request, tokens

# Latency is the contract of the frozen-worker tests: found silent within the worker
# timeout (0.5 s here; a poll every 0.05 s), so a request moves on at about 0.55 s idle.
# Ten times that: a loaded machine passes, a stream left waiting on the frozen worker
# (until its deadline) does not.
MOVED_S = 10 * 0.56
# A worker that says its engine stalled is down at the next poll: 0.05 s idle.
STALL_MOVED_S = 2.0


def run(coro):
    return asyncio.run(coro)


def test_a_huge_prompt_does_not_stall_other_streams_or_health_checks(tok, monkeypatch):
    """Tokenizing megabytes takes seconds: it runs off the event loop, so a stream in
    flight keeps its pace and health checks answer meanwhile."""

    async def main():
        async with cluster(tok) as c:
            c.decode[0].token_delay_s = 0.02
            huge = gen.GenerateRequest(text="The quick brown fox jumps over the dog. " * 60000,
                                       sampling=gen.SamplingParams(max_tokens=4))
            gaps, health_waits = [], []
            # The huge prompt's tokenizing, once done, waits until health checks and the
            # stream's tokens came meanwhile (however fast this machine tokenizes): were it
            # on the event loop, nothing would come, and the request would fail.
            tokenizing, probed = threading.Event(), threading.Event()
            during = {"health": 0, "tokens": 0}
            tokenizer = c.router.intake.tokenizer
            encode = tokenizer.encode

            def encode_huge(text: str) -> list[int]:
                if len(text) < len(huge.text):
                    return encode(text)
                tokenizing.set()
                ids = encode(text)
                assert probed.wait(60), during
                return ids

            monkeypatch.setattr(tokenizer, "encode", encode_huge)

            def seen(what: str) -> None:
                if tokenizing.is_set():
                    during[what] += 1
                    if min(during.values()) >= 3:
                        probed.set()

            done = asyncio.Event()  # the huge request has its answer

            async def stream():
                call = c.stub.Generate(request(PROMPT, 60000), timeout=120)
                last = time.monotonic()
                async for _ in call:
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    seen("tokens")
                    if done.is_set():
                        break
                call.cancel()

            async def probe_health():
                async with grpc.aio.insecure_channel(c.address) as ch:
                    stub = health_pb2_grpc.HealthStub(ch)
                    while not done.is_set():
                        t0 = time.monotonic()
                        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                        health_waits.append(time.monotonic() - t0)
                        seen("health")
                        await asyncio.sleep(0.05)

            async def send_huge():
                while not gaps:  # the stream is under way
                    await asyncio.sleep(0.01)
                try:
                    with pytest.raises(grpc.aio.AioRpcError) as e:  # too many tokens, once known
                        await c.stub.Generate(huge, timeout=120).read()
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
                finally:
                    done.set()

            await asyncio.gather(stream(), probe_health(), send_huge())
            assert probed.is_set()
            # The latency is the contract here: 20 ms a token and a few ms a health check
            # idle; a stalled loop would add the seconds of the tokenizing.
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
            c.decode[0].gate = asyncio.Event()  # the first request stays in flight
            first = asyncio.ensure_future(c.generate(PROMPT, 4))
            while c.router.inflight < 1:  # admitted
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate(PROMPT, 4)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            hints = dict(e.value.trailing_metadata())
            assert hints["retry-after-ms"] == hints["grpc-retry-pushback-ms"]
            c.decode[0].gate.set()
            assert tokens(await first) == expected(PROMPT, 4)

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


async def _stream_striking_its_decode_worker(c, fault: str, after: int = 3):
    """Streams 12 tokens of PROMPT, checked; after message `after` (the prefill worker's
    first token, then the decode worker's), the decode worker serving it suffers `fault`
    (a fake worker's method) before it sends another. Returns that worker and the seconds
    from the fault to the next message."""
    for d in c.decode:  # each stream holds its decode worker's tokens past `after` ...
        d.gate, d.ungated = asyncio.Event(), after - 1
    msgs = []
    async for m in c.stub.Generate(request(PROMPT, 12), timeout=60):
        msgs.append(m)
        if len(msgs) == after:
            victim = next(d for d in c.decode if d.decodes)
            getattr(victim, fault)()
            struck = time.monotonic()
            for d in c.decode:  # ... until the fault has struck
                d.gate.set()
        elif len(msgs) == after + 1:
            moved_after = time.monotonic() - struck
    assert tokens(msgs) == expected(PROMPT, 12)
    assert len(victim.decodes) == 1 and sum(len(d.decodes) for d in c.decode) == 2  # moved
    return victim, moved_after


def test_a_frozen_decode_worker_counts_as_dead_within_the_worker_timeout(tok):
    """SIGSTOP-like: alive, silent. The registry's polls get no answer for worker_timeout
    (0.5 s here), so it is marked down and the stream moves on to the other worker."""

    async def main():
        async with cluster(tok, decodes=2) as c:
            _, moved_after = await _stream_striking_its_decode_worker(c, "freeze")
            assert moved_after < MOVED_S

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
            results = await asyncio.gather(*(c.generate(PROMPT, 4, timeout=60)
                                             for _ in range(3)))
            assert all(tokens(m) == expected(PROMPT, 4) for m in results)
            assert time.monotonic() - t0 < MOVED_S

    run(main())


def test_a_handshake_that_hangs_does_not_delay_noticing_a_frozen_worker(tok):
    async def main():
        async with cluster(tok, decodes=2) as c:
            d0, d1 = c.decode
            d1.connect_hangs = True
            c.registry.decode[1].pairs.clear()  # as if d1 restarted: handshake again
            await c.polled()  # a poll starts the handshake ...
            assert d1.connects and not c.registry.decode[1].pairs  # ... which hangs
            victim, moved_after = await _stream_striking_its_decode_worker(c, "freeze", 2)
            assert victim is d0  # the paired one (d1 recomputes the prompt)
            assert moved_after < MOVED_S
            d1.connect_hangs = False

    run(main())


def test_a_decode_worker_whose_engine_stalled_counts_as_dead(tok):
    """It answers its polls, saying its engine thread is stuck (engine_stalled_since):
    marked down at the next poll, well within the worker timeout, so the stream moves on
    to the other worker; once its engine steps again, it is up again."""

    async def main():
        async with cluster(tok, decodes=2) as c:
            victim, moved_after = await _stream_striking_its_decode_worker(c, "stall_engine")
            assert moved_after < STALL_MOVED_S  # a poll and the move: it need not go silent
            worker = next(w for w in c.registry.decode if w.address == victim.address)
            assert worker.state == "down"
            victim.thaw()
            deadline = time.monotonic() + 60
            while worker.state != "up":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)

    run(main())
