"""KV events and the router's prefix index: what a worker tells, and what the router
concludes from it."""

from __future__ import annotations

import random
import sys
import tracemalloc

from baton.router.kv_index import PrefixIndex, PromptBlocks
from baton.services.common.kv_events import KvEventLog
from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.block_pool import BlockPool
from baton.services.engine.kv_cache_manager import KVCacheManager
from baton.services.engine.request import Request
from baton.worker.v1 import worker_pb2 as wk


def _h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _reply(log: KvEventLog, after: int, engine_id: str = "e1") -> wk.GetKvEventsResponse:
    ev = log.read(after)
    return wk.GetKvEventsResponse(engine_id=engine_id, seq=ev.seq, snapshot=ev.snapshot,
                                  stored=ev.stored, removed=ev.removed, block_size=16,
                                  enabled=True)


def test_a_read_is_the_net_change_since_the_cursor():
    log = KvEventLog()
    log.stored(_h(1))
    first = log.read(0)
    assert first.snapshot and first.stored == [_h(1)] and first.seq == 1
    log.stored(_h(2))
    log.removed(_h(1))
    log.stored(_h(1))  # back again: the last event wins
    log.stored(_h(3))
    log.removed(_h(3))
    ev = log.read(first.seq)
    assert not ev.snapshot
    assert sorted(ev.stored) == [_h(1), _h(2)] and ev.removed == [_h(3)]
    assert log.read(ev.seq).stored == [] and log.read(ev.seq).removed == []


def test_a_reader_that_lags_past_the_ring_or_a_clear_gets_a_snapshot():
    log = KvEventLog(capacity=4)
    for i in range(3):
        log.stored(_h(i))
    cursor = log.seq
    for i in range(3, 10):
        log.stored(_h(i))
    ev = log.read(cursor)
    assert ev.snapshot and sorted(ev.stored) == [_h(i) for i in range(10)]
    cursor = ev.seq
    log.cleared()
    log.stored(_h(42))
    ev = log.read(cursor)
    assert ev.snapshot and ev.stored == [_h(42)]
    assert log.read(10_000).snapshot  # a cursor from another engine's life


def test_replayed_events_mirror_the_pools_cache_map_through_random_use():
    """Whatever the pool does (publish, hit, free, evict, reset), a reader that applies
    every poll's events to its own set holds exactly the pool's cached hashes."""
    rng = random.Random(7)
    log = KvEventLog(capacity=64)
    pool = BlockPool(32, log)
    index = PrefixIndex()
    held = []
    for step in range(3000):
        op = rng.random()
        if op < 0.45 and pool.num_free_blocks:
            block = pool.get_new_blocks(1)[0]
            pool.cache_block(block, _h(rng.randrange(60)))  # duplicates happen too
            held.append(block)
        elif op < 0.6 and pool.cached:
            block = pool.get_cached(rng.choice(list(pool.cached)))
            pool.touch([block])
            held.append(block)
        elif op < 0.95 and held:
            pool.free_blocks([held.pop(rng.randrange(len(held)))])
        elif op >= 0.999:
            pool.reset_prefix_cache()
        if step % rng.choice((1, 7, 50, 200)) == 0:
            index.apply(_reply(log, index.seq))
            assert set(index._held) == set(pool.cached)
    index.apply(_reply(log, index.seq))
    assert set(index._held) == set(pool.cached)


def test_the_index_matches_leading_blocks_only_and_never_the_last_tokens_block():
    prompt = PromptBlocks(list(range(1000, 1000 + 16 * 4 + 5)), cache_salt="t1")
    hashes = prompt.hashes(16)
    log = KvEventLog()
    index = PrefixIndex()
    for h in hashes[:2] + hashes[3:]:
        log.stored(h)
    index.apply(_reply(log, 0))
    assert index.match(prompt) == 2  # the third block is missing: the run stops
    log.stored(hashes[2])
    index.apply(_reply(log, index.seq))
    assert index.match(prompt) == 4
    exact = PromptBlocks(list(range(1000, 1000 + 16 * 4)), cache_salt="t1")
    assert index.match(exact) == 3  # its last block holds the last token: recomputed
    other_salt = PromptBlocks(prompt.token_ids, cache_salt="t2")
    assert index.match(other_salt) == 0


def test_the_router_hashes_as_the_engine_does():
    """A request's blocks, published by the engine's own KV-cache manager, arrive as KV
    events that name exactly the hashes the router computes for the same prompt."""
    ids = [random.Random(3).randrange(49152) for _ in range(100)]
    log = KvEventLog()
    kv = KVCacheManager(BlockPool(16, log), 16)
    req = Request("r", ids, SamplingParams(max_tokens=4), (2,), cache_salt="tenant-7")
    assert kv.allocate_slots(req, len(ids))
    stored = log.read(0).stored
    assert len(stored) == 100 // 16
    assert sorted(PromptBlocks(ids, "tenant-7").hashes(16)) == sorted(stored)
    assert not set(PromptBlocks(ids, "tenant-8").hashes(16)) & set(stored)


def test_predictions_count_until_they_expire_and_events_confirm_them():
    prompt = PromptBlocks(list(range(16 * 3 + 1)))
    index = PrefixIndex(predict_ttl_s=5.0)
    log = KvEventLog()
    index.apply(_reply(log, 0))  # learns the block size
    index.predict(prompt, now=100.0)
    assert index.match(prompt, now=104.0) == 3
    assert index.match(prompt, now=106.0) == 0
    index.predict(prompt, now=100.0)
    for h in prompt.hashes(16):
        log.stored(h)
    index.apply(_reply(log, index.seq))
    assert index.match(prompt, now=1e9) == 3  # confirmed: no expiry


def test_memory_is_bounded_the_oldest_going_first():
    index = PrefixIndex(max_blocks=10)
    log = KvEventLog()
    log.stored(_h(99))
    index.apply(_reply(log, 0))  # a snapshot (in no order), then events in order
    for i in range(25):
        log.stored(_h(i))
    index.apply(_reply(log, index.seq))
    assert len(index) == 10 and set(index._held) == {_h(i) for i in range(15, 25)}


def test_a_restarted_engine_replaces_what_was_known():
    old, new = KvEventLog(), KvEventLog()
    old.stored(_h(1))
    index = PrefixIndex()
    index.apply(_reply(old, 0, "e1"))
    new.stored(_h(2))
    index.apply(_reply(new, 0, "e2"))
    assert set(index._held) == {_h(2)}


def test_a_prediction_costs_its_blocks_not_the_size_of_a_full_index():
    """Once an index is full, every prediction evicts its oldest hashes. That must not
    walk the whole index: the same predictions run the same Python lines, and allocate
    about as much at their peak, against 200,000 held hashes as against 1,000 (a copy of
    every key, which took milliseconds per request, allocates 1.6 MB). Counts, not
    times: the same on any machine under any load."""

    def cost(size: int) -> tuple[int, int]:
        index = PrefixIndex(max_blocks=size)
        index.apply(wk.GetKvEventsResponse(engine_id="e1", seq=1, snapshot=True,
                                           stored=[_h(i) for i in range(size)],
                                           block_size=16, enabled=True))
        prompts = [PromptBlocks([r, i] * 8 * 4 + [1]) for r in range(3) for i in range(300)]
        for p in prompts:
            p.hashes(16)  # hashed beforehand: only the index's work is counted
        lines = 0

        def trace(frame, event, arg):
            nonlocal lines
            lines += event == "line"
            return trace

        tracemalloc.start()
        sys.settrace(trace)
        try:
            for p in prompts:  # new prompts: each evicts 4 hashes
                index.predict(p, now=1.0)
        finally:
            sys.settrace(None)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert len(index) == size
        return lines, peak

    (small_lines, small_peak), (big_lines, big_peak) = cost(1_000), cost(200_000)
    assert big_lines <= 1.1 * small_lines, (small_lines, big_lines)
    assert big_peak < small_peak + 800_000, (small_peak, big_peak)
