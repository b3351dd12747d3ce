"""Where the router computes each prompt (--disaggregation, router/policy.py): `never` on
the decode worker, `always` on a prefill worker however short, `auto` on the decode
worker only for a short prompt or when the prefill workers' queue is the longer by more
than computing it would stall the decode worker's streams; each choice
counted with its reason. And what a planner reads: each role's queue and queued prompt
tokens, and the requests past the SLOs the router was given."""

from __future__ import annotations

import asyncio
import time

from tests.router_fakes import PROMPT, cluster, expected, tokens

LONG = list(range(1, 200))  # 199 tokens
OTHER = list(range(300, 499))  # 199 more, none cached with LONG
THIRD = list(range(600, 799))  # and 199 more


def sample(c, name: str, **labels) -> float:
    return c.router.metrics.registry.get_sample_value(
        name, {"model_name": "fake", **labels}) or 0.0


async def polled(c) -> None:
    """Until the registry has polled every worker twice more (their stats are in)."""
    start = c.rounds[0]
    deadline = time.monotonic() + 30
    while c.rounds[0] < start + 2:
        assert time.monotonic() < deadline, "the registry stopped polling"
        await asyncio.sleep(0.01)


def test_never_computes_every_prompt_on_the_decode_worker(tok):
    async def main():
        async with cluster(tok, disaggregation="never") as c:
            for prompt in (PROMPT, LONG):
                msgs = await c.generate(prompt, 4)
                assert tokens(msgs) == expected(prompt, 4) and msgs[-1].timings.local_prefill
            assert c.prefill[0].prefills == []
            assert not any(d.HasField("handle") for d in c.decode[0].decodes)
            assert sample(c, "baton:local_prefills_total", reason="disaggregation_never") == 2
    asyncio.run(main())


def test_always_sends_even_a_short_prompt_to_a_prefill_worker(tok):
    async def main():
        async with cluster(tok, disaggregation="always", local_prefill_tokens=10_000,
                           local_prefill_queue=1.0) as c:
            c.prefill[0].queued_prefill_tokens = 10**6  # however long its queue
            await polled(c)
            msgs = await c.generate(PROMPT, 4)
            assert tokens(msgs) == expected(PROMPT, 4) and not msgs[-1].timings.local_prefill
            assert len(c.prefill[0].prefills) == 1
    asyncio.run(main())


def test_auto_computes_a_short_prompt_locally_and_a_long_one_remotely(tok):
    async def main():
        async with cluster(tok, local_prefill_tokens=64) as c:
            short, long = await c.generate(PROMPT, 4), await c.generate(LONG, 4)
            assert short[-1].timings.local_prefill and not long[-1].timings.local_prefill
            assert len(c.prefill[0].prefills) == 1
            assert sample(c, "baton:local_prefills_total", reason="short_prompt") == 1
    asyncio.run(main())


def test_auto_computes_locally_while_the_prefill_queue_is_the_longer(tok):
    async def main():
        async with cluster(tok, local_prefill_queue=2.0) as c:
            p, d = c.prefill[0], c.decode[0]
            p.queued_prefill_tokens, d.queued_prefill_tokens = 1000, 300
            await polled(c)
            # There: 1,000 queued + 199; here: 300 + 199, x 2 = 998 < 1,199: local.
            assert (await c.generate(LONG, 4))[-1].timings.local_prefill
            assert sample(c, "baton:local_prefills_total", reason="prefill_queue") == 1
            d.queued_prefill_tokens = 500  # (500 + 199) x 2 > 1,199: the prefill worker
            await polled(c)
            assert not (await c.generate(OTHER, 4))[-1].timings.local_prefill
            assert len(p.prefills) == 1
            # Queues as at first, but the decode worker runs a stream, which computing the
            # prompt there would stall: 998 x (1 + 1) > 1,199, the prefill worker.
            d.queued_prefill_tokens, d.active = 300, 1
            await polled(c)
            assert not (await c.generate(THIRD, 4))[-1].timings.local_prefill
            assert len(p.prefills) == 2
            d.active, d.queued_prefill_tokens = 0, 500
            # Each role's queue as the planner reads it, from the last polls.
            await polled(c)
            assert sample(c, "baton:role_queued_prefill_tokens", role="prefill") == 1000
            assert sample(c, "baton:role_queued_prefill_tokens", role="decode") == 500
            assert sample(c, "baton:role_queue_depth", role="decode") == 0
    asyncio.run(main())


def test_requests_past_an_slo_are_counted_by_slo(tok):
    async def main():
        async with cluster(tok, slo_ttft_ms=60_000, slo_itl_ms=20) as c:
            c.decode[0].token_delay_s = 0.04  # every token 40 ms after the last
            for _ in range(3):
                await c.generate(PROMPT, 4)
            c.decode[0].token_delay_s = 0.0
            await c.generate(PROMPT, 4)
            assert sample(c, "baton:slo_requests_total") == 4
            assert sample(c, "baton:slo_misses_total", slo="itl") == 3
            assert sample(c, "baton:slo_misses_total", slo="ttft") == 0
            assert sample(c, "baton:slo_misses_total", slo="any") == 3
    asyncio.run(main())
