"""Routing on the KV cache, on fake workers that report the prompts' blocks they hold:
tenants stick to the worker that holds their prefix, conditional disaggregation skips
the prefill worker, and load still wins when it should."""

from __future__ import annotations

import asyncio
import random

from baton.router.kv_index import Hit, PromptBlocks
from tests.router_fakes import cluster, expected, tokens

BS = 16


def _tenant_prompts(tenants: int, rounds: int, seed: int = 1, blocks: int = 4
                    ) -> list[tuple[int, list[int]]]:
    prefixes = [random.Random(100 + t).sample(range(1000, 40000), blocks * BS)
                for t in range(tenants)]
    rng = random.Random(seed)
    order = [t for _ in range(rounds) for t in rng.sample(range(tenants), tenants)]
    return [(t, prefixes[t] + rng.sample(range(40000, 49000), 5)) for t in order]


async def _served_by(c, prompt, **kw):
    msgs = await c.generate(prompt, 4, **kw)
    assert tokens(msgs) == expected(prompt, 4)
    d = next(d for d in c.decode if d.decodes and list(d.decodes[-1].prompt_token_ids)
             == prompt)
    await c.polled()  # the events reach the router
    return d.engine_id, msgs


def _sticky(routing: str, tok) -> dict[int, set[str]]:
    """Rounds of every tenant at once (a burst: load spreads it); which decode workers
    served each tenant."""
    async def main():
        seen: dict[int, set[str]] = {}
        async with cluster(tok, prefills=1, decodes=2, routing=routing) as c:
            # 1,024-token prefixes: a tenant's cached worker stays cheaper even with the
            # other tenant it holds queued ahead (a waiting request costs 4 x 64 tokens).
            work = _tenant_prompts(4, 4, blocks=64)
            for r in range(0, len(work), 4):
                burst = work[r:r + 4]
                for (_, prompt), msgs in zip(burst, await asyncio.gather(
                        *(c.generate(p, 4) for _, p in burst)), strict=True):
                    assert tokens(msgs) == expected(prompt, 4)
                await c.polled()  # the events reach the router
                for t, prompt in burst:
                    seen.setdefault(t, set()).update(
                        d.engine_id for d in c.decode
                        if any(list(q.prompt_token_ids) == prompt for q in d.decodes))
        return seen
    return asyncio.run(main())


def test_tenants_stick_to_the_decode_worker_that_holds_their_prefix(tok):
    seen = _sticky("kv", tok)
    assert all(len(workers) == 1 for workers in seen.values())
    assert len(set().union(*seen.values())) == 2  # and both workers serve


def test_load_only_routing_ignores_the_cache(tok):
    # The baseline W4 compares with: a burst is spread by load alone.
    assert any(len(workers) == 2 for workers in _sticky("load", tok).values())


def test_a_prompt_the_decode_worker_mostly_holds_is_prefilled_there(tok):
    async def main():
        async with cluster(tok, prefills=1, decodes=2, local_prefill_hit=0.9) as c:
            (_, first), (_, second) = _tenant_prompts(1, 2)
            eid, msgs = await _served_by(c, first)
            assert len(c.prefill[0].prefills) == 1 and not msgs[0].timings.local_prefill
            assert msgs[0].timings.expected_cached_blocks == 0
            eid2, msgs = await _served_by(c, second)
            assert eid2 == eid and len(c.prefill[0].prefills) == 1  # no prefill worker
            d = next(d for d in c.decode if d.engine_id == eid)
            assert not d.decodes[-1].HasField("handle")  # it computes the prompt
            assert msgs[0].timings.local_prefill
            assert msgs[0].timings.expected_cached_blocks == 4  # the tenant's prefix
            await c.settle()
            assert c.leases_held() == 0
    asyncio.run(main())


def test_a_short_uncached_part_is_prefilled_on_the_decode_worker(tok):
    async def main():
        async with cluster(tok, prefills=1, decodes=1, local_prefill_tokens=8) as c:
            assert tokens(await c.generate([5, 6, 7], 4)) == expected([5, 6, 7], 4)
            long = list(range(200, 240))
            assert tokens(await c.generate(long, 4)) == expected(long, 4)
            assert len(c.prefill[0].prefills) == 1  # only the long one
            short, longer = c.decode[0].decodes
            assert not short.HasField("handle") and longer.HasField("handle")
    asyncio.run(main())


def test_the_prefill_worker_that_holds_the_prefix_gets_it_unless_much_busier(tok):
    async def main():
        async with cluster(tok, prefills=2, decodes=1) as c:
            (_, prompt), = _tenant_prompts(1, 1)
            c.prefill[1].cache(prompt)
            await c.polled()
            msgs = await c.generate(prompt, 4)
            assert len(c.prefill[1].prefills) == 1 and not c.prefill[0].prefills
            assert msgs[0].timings.expected_cached_blocks == 4
            # Now make it look busy: 16 requests routed since its last stats.
            c.registry.poll_s = 3600  # no poll resets the count in between: once the
            await c.polled(1)  # round under way (or the next) is done, the next is far
            p1 = next(w for w in c.registry.prefill if w.engine_id == "p1")
            p1.routed += 16
            await c.generate(prompt, 4)
            assert len(c.prefill[0].prefills) == 1
    asyncio.run(main())


def test_evicted_blocks_stop_attracting_requests(tok):
    async def main():
        async with cluster(tok, prefills=2, decodes=1) as c:
            (_, prompt), = _tenant_prompts(1, 1)
            c.prefill[1].cache(prompt)
            await c.polled()
            p1 = next(w for w in c.registry.prefill if w.engine_id == "p1")
            assert p1.index.match(PromptBlocks(prompt)) == 4  # the router saw them
            c.prefill[1].kv.cleared()  # evicted everything
            await c.polled()
            msgs = await c.generate(prompt, 4)
            assert msgs[0].timings.expected_cached_blocks == 0
    asyncio.run(main())


def test_a_prefix_in_an_offload_tier_attracts_its_prompt_less_than_one_in_the_pool(tok):
    """Through the registry's polls of the workers' KV events (each medium on the wire):
    pool over host over disk over nothing, each prompt to the best-placed prefill worker."""
    async def main():
        async with cluster(tok, prefills=3, decodes=1) as c:
            pool_host, host_disk, disk_none = (p for _, p in sorted(_tenant_prompts(3, 1)))
            c.prefill[0].cache(pool_host)
            c.prefill[1].cache(pool_host, medium="host")
            c.prefill[1].cache(host_disk, medium="host")
            c.prefill[2].cache(host_disk, medium="disk")
            c.prefill[2].cache(disk_none, medium="disk")
            await c.polled()
            index = {w.engine_id: w.index for w in c.registry.prefill}
            assert index["p1"].hit(PromptBlocks(pool_host)) == Hit(0, 4, 0)
            assert index["p2"].hit(PromptBlocks(host_disk)) == Hit(0, 0, 4)
            for prompt, want in ((pool_host, 0), (host_disk, 1), (disk_none, 2)):
                await c.polled()  # the last request's load is gone from every worker
                before = [len(p.prefills) for p in c.prefill]
                assert tokens(await c.generate(prompt, 4)) == expected(prompt, 4)
                got = [len(p.prefills) - n for p, n in zip(c.prefill, before, strict=True)]
                assert got == [i == want for i in range(3)], (want, got)
    asyncio.run(main())
