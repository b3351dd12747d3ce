"""The router and its registry against fake workers on loopback (router_fakes.py): prefill
retry, decode migration, the lease released on every way out, pairing failures, burst
routing, readiness. Each test checks the stream token by token against the fakes'
formula, and that no prefill lease is left held."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.router.clients import WorkerError
from baton.v1 import generation_pb2 as gen
from tests.router_fakes import PROMPT, cluster, expected, request, tokens


def run(coro):
    return asyncio.run(coro)


async def _until(check, timeout: float = 60.0) -> None:
    """Until `check()` (a bool, or a coroutine of one) holds."""
    deadline = time.monotonic() + timeout
    while True:
        ok = check()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _status_is(health, status: int) -> bool:
    return (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == status


def test_prefill_then_decode_pulls_the_handle(tok):
    async def main():
        async with cluster(tok) as c:
            msgs = await c.generate(PROMPT, 8)
            assert tokens(msgs) == expected(PROMPT, 8)
            assert msgs[-1].usage.completion_tokens == 8 and msgs[0].timings.first_token_s > 0
            [d] = c.decode[0].decodes
            assert d.HasField("handle") and d.handle.engine_id == "p0"
            await c.settle()
            assert c.leases_held() == 0

    run(main())


def test_a_failed_prefill_worker_is_retried_on_the_next(tok):
    async def main():
        async with cluster(tok, prefills=2) as c:
            for p in c.prefill:  # whichever is tried first fails
                p.fail_with = grpc.StatusCode.UNAVAILABLE
            c.prefill[1].fail_with = None
            for _ in range(4):
                assert tokens(await c.generate(PROMPT, 6)) == expected(PROMPT, 6)
            assert len(c.prefill[1].prefills) == 4
            await c.settle()
            # It answered no handle, so nothing is released there: a release names the
            # lease a handle gave (the worker cleans up a call that failed itself).
            assert c.prefill[0].released == []

    run(main())


def test_with_no_prefill_worker_the_decode_worker_prefills(tok):
    async def main():
        async with cluster(tok) as c:
            c.prefill[0].fail_with = grpc.StatusCode.UNAVAILABLE
            assert tokens(await c.generate(PROMPT, 5)) == expected(PROMPT, 5)
            [d] = c.decode[0].decodes
            assert not d.HasField("handle") and list(d.output_token_ids) == []

    run(main())


def test_a_decode_worker_that_dies_after_the_last_token_ends_the_request_there(tok):
    """Gone after its last token but before the end: nothing is left to decode, so the
    router ends the request (length) and asks no other worker, which would refuse it."""
    async def main():
        async with cluster(tok, decodes=2, poll_interval=10) as c:
            for d in c.decode:
                d.die_before_finish = True
            msgs = [m async for m in c.stub.Generate(request(PROMPT, 6), timeout=10)]
            assert tokens(msgs) == expected(PROMPT, 6)
            assert msgs[-1].delta.finish_reason == gen.FINISH_REASON_LENGTH
            assert msgs[-1].usage.completion_tokens == 6
            assert sum(len(d.decodes) for d in c.decode) == 1

    run(main())


def test_a_decode_worker_that_dies_mid_stream_hands_over_without_gap_or_repeat(tok):
    async def main():
        async with cluster(tok, decodes=2, poll_interval=10) as c:
            for d in c.decode:
                d.die_after = 3  # whichever is picked first dies after 3 tokens
            msgs = []
            async for m in c.stub.Generate(request(PROMPT, 12), timeout=10):
                msgs.append(m)
                if len(msgs) == 2:
                    first = next(d for d in c.decode if d.decodes)
                    other = next(d for d in c.decode if d is not first)
                    other.die_after = None
            assert tokens(msgs) == expected(PROMPT, 12)
            handed = other.decodes[0]
            assert not handed.HasField("handle")
            assert list(handed.output_token_ids) == expected(PROMPT, 4)

    run(main())


@pytest.mark.parametrize("exit_path", ["client-cancels", "no-decode-worker",
                                       "decode-refuses", "decode-dies-before-answering",
                                       "deadline-in-prefill"])
def test_the_prefill_lease_is_released_on_every_way_out(tok, exit_path):
    async def main():
        async with cluster(tok, decodes=2, poll_interval=10) as c:
            d0, d1 = c.decode
            if exit_path == "client-cancels":
                d0.token_delay_s = d1.token_delay_s = 0.5
                call = c.stub.Generate(request(PROMPT, 8), timeout=10)
                await call.read()  # the first token, from prefill
                call.cancel()
            elif exit_path == "no-decode-worker":
                for w in c.registry.decode:
                    w.state = "down"
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.generate(PROMPT, 8)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            elif exit_path == "decode-refuses":
                d0.fail_with = d1.fail_with = grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.generate(PROMPT, 8)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            elif exit_path == "decode-dies-before-answering":
                d0.die_after = d1.die_after = 0
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.generate(PROMPT, 8)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            else:
                c.prefill[0].token_delay_s = 0
                c.prefill[0].freeze()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.generate(PROMPT, 8, timeout=0.3)
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                c.prefill[0].thaw()  # the call, if it still runs, grants its lease late
                await _until(lambda: not c.prefill[0].prefilling)
            await c.settle()
            assert c.leases_held() == 0, c.prefill[0].leases
            # Every release named its lease: a worker refuses lease 0 ("any lease").
            assert all(lease for _, lease, _ in c.prefill[0].released)

    run(main())


def test_a_prefill_answer_that_arrives_after_the_deadline_has_its_lease_aborted(tok):
    """The prefill worker answered, lease granted, but the router's call had ended
    DEADLINE_EXCEEDED: nobody saw the handle, and the worker saw no cancellation. The
    router ends the lease by request id (AbortPrefill)."""
    async def main():
        async with cluster(tok) as c:
            client = c.registry.prefill[0].client
            answer = client.prefill

            async def late(req, timeout, metadata=()):
                await answer(req, timeout, metadata)  # granted, on the worker...
                raise WorkerError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")

            client.prefill = late  # ...and lost on the way back
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate(PROMPT, 8)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await c.settle()
            assert c.leases_held() == 0, c.prefill[0].leases
            assert c.prefill[0].aborted == c.prefill[0].prefills != []

    run(main())


@pytest.mark.parametrize("how", ["abort", "release"])
def test_an_end_of_lease_that_fails_on_the_way_is_tried_again(tok, how):
    """A prefill worker too busy to answer the router's AbortPrefill (a Prefill answer
    lost past its deadline) or ReleaseKv (no decode worker can take the handle) in time:
    the router tries again until the lease ends, rather than leave it held until it
    expires (router/lease.py)."""
    async def main():
        async with cluster(tok) as c:
            c.prefill[0].busy_answers = 2
            client = c.registry.prefill[0].client
            if how == "abort":
                answer = client.prefill

                async def late(req, timeout, metadata=()):
                    await answer(req, timeout, metadata)
                    raise WorkerError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")

                client.prefill = late
            else:
                for d in c.decode:  # every decode worker refuses: the handle goes nowhere
                    d.fail_with = grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError):
                await c.generate(PROMPT, 8)
            await _until(lambda: c.leases_held() == 0, timeout=10)
            assert c.prefill[0].busy_answers == 0  # both failures were tried past

    run(main())


def test_a_handle_passes_to_the_next_decode_worker_if_the_first_never_answered(tok):
    async def main():
        async with cluster(tok, decodes=2, poll_interval=10) as c:
            for d in c.decode:
                d.fail_with = grpc.StatusCode.UNAVAILABLE  # e.g. draining
            c.decode[1].fail_with = None
            assert tokens(await c.generate(PROMPT, 6)) == expected(PROMPT, 6)
            [d] = c.decode[1].decodes
            assert d.HasField("handle")  # not recomputed: the KV still moves
            await c.settle()
            assert c.leases_held() == 0

    run(main())


def test_an_unpairable_prefill_worker_is_skipped_and_decode_prefills(tok):
    async def main():
        async with cluster(tok, decodes=1) as c:
            c.decode[0].connect_error = "KV layout mismatch (block_size: ours 32, peer 16)"
            c.registry.decode[0].pairs.clear()
            await c.registry.refresh()
            await c.registry.handshakes(timeout=5)
            ready, why = c.registry.readiness()
            assert ready and "block_size" in why
            assert tokens(await c.generate(PROMPT, 5)) == expected(PROMPT, 5)
            assert not c.prefill[0].prefills  # its work would be thrown away

    run(main())


def test_a_burst_between_two_polls_spreads_over_every_worker(tok):
    async def main():
        async with cluster(tok, prefills=2, decodes=2, poll_interval=30) as c:
            for d in c.decode:
                d.token_delay_s = 0.05
            prompts = [list(range(200 + i, 240 + i)) for i in range(16)]
            outs = await asyncio.gather(*(c.generate(p, 4) for p in prompts))
            assert [tokens(o) for o in outs] == [expected(p, 4) for p in prompts]
            assert sorted(len(p.prefills) for p in c.prefill) == [8, 8]
            assert sorted(len(d.decodes) for d in c.decode) == [8, 8]

    run(main())


def test_not_serving_until_a_pair_is_ready_then_serving_then_not_when_draining(tok):
    async def main():
        async with cluster(tok) as c:
            async with grpc.aio.insecure_channel(c.address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                req = health_pb2.HealthCheckRequest()
                assert (await health.Check(req)).status == health_pb2.HealthCheckResponse.SERVING
                c.decode[0].freeze()  # the only decode worker stops answering
                await _until(lambda: c.registry.readiness()[0] is False)
                await _until(lambda: _status_is(health, health_pb2.HealthCheckResponse.NOT_SERVING))
                c.decode[0].thaw()
                await _until(lambda: _status_is(health, health_pb2.HealthCheckResponse.SERVING))

    run(main())


def test_a_draining_prefill_worker_gets_no_new_prompt_but_its_handles_still_pair(tok):
    async def main():
        async with cluster(tok, prefills=2) as c:
            c.prefill[0].draining = True
            await c.polled()  # a poll sees it
            for _ in range(3):
                assert tokens(await c.generate(PROMPT, 4)) == expected(PROMPT, 4)
            assert not c.prefill[0].prefills and len(c.prefill[1].prefills) == 3
            worker, paired = c.registry.pick_decode("p0")
            assert paired  # a handle it still holds can be pulled

    run(main())


@pytest.mark.parametrize("own", [None, "router-name"])
def test_model_info_carries_the_served_name(tok, own):
    """GetModelInfo names the model as it is served: the router's --served-model-name,
    else the workers' (the fakes say none: then the model's name without .gguf)."""
    async def main():
        async with cluster(tok, served_model_name=own) as c:
            await c.generate(PROMPT, 1)  # the workers have answered
            info = (await c.stub.GetModelInfo(gen.GetModelInfoRequest())).info
            assert info.model == "fake"
            assert info.served_model_name == (own or "fake")

    run(main())
