"""Prefix caching: same text as without it, exact cached-token accounting, salts that
isolate, and eviction that stays correct. On the tiny serving model: what is checked is
the cache's bookkeeping, against the same model without a cache."""

from __future__ import annotations

import random

import pytest

from baton.services.common.block_hash import extend_hashes, hash_block
from baton.services.engine import SamplingParams
from tests.integration.engine_helpers import kv_gib

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(100, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def cached(make_llm, tiny_model):
    return make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=256,
                    max_num_seqs=16, kv_cache_gib=kv_gib(tiny_model, 1000))


@pytest.fixture(scope="module")
def uncached(make_llm, tiny_model):
    return make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=256,
                    max_num_seqs=16, kv_cache_gib=kv_gib(tiny_model, 1000),
                    enable_prefix_caching=False)


def test_hash_chain_names_the_whole_prefix():
    a, b = [1] * 16, [2] * 16
    assert hash_block(None, a) != hash_block(None, b)
    assert hash_block(hash_block(None, a), b) != hash_block(hash_block(None, b), b)
    assert hash_block(None, a, b"salt") != hash_block(None, a)
    hashes: list[bytes] = []
    extend_hashes(hashes, a + b + [3] * 5, 16)
    assert len(hashes) == 2  # the partial third block is never hashed


def test_same_text_with_caching_on_and_off(cached, uncached):
    rng = random.Random(3)
    shared = _ids(rng, 200)
    # Shared prefixes of several lengths, one ending mid-block (37), plus repeats.
    prompts = [shared[:n] + _ids(rng, 20) for n in (16, 37, 64, 100, 200)]
    prompts += [shared[:37] + _ids(rng, 5), shared[:100], shared[:100], prompts[0]]
    want = [o.token_ids for o in uncached.generate(prompts, GREEDY)]
    cached.reset_prefix_cache()
    first = cached.generate(prompts, GREEDY)
    again = cached.generate(prompts, GREEDY)  # now mostly from the cache
    assert [o.token_ids for o in first] == want
    assert [o.token_ids for o in again] == want
    assert sum(o.num_cached_tokens for o in again) > sum(o.num_cached_tokens for o in first) > 0
    assert all(o.num_cached_tokens == 0 for o in uncached.generate(prompts, GREEDY))


def test_two_prompts_sharing_40_tokens_cache_exactly_32(cached):
    cached.reset_prefix_cache()
    rng = random.Random(4)
    shared = _ids(rng, 40)
    a, b = shared + _ids(rng, 30), shared + _ids(rng, 30)
    out_a, out_b = cached.generate([a, b], GREEDY)
    assert out_a.num_cached_tokens == 0
    assert out_b.num_cached_tokens == 32  # two full blocks; the third diverges at token 40


@pytest.mark.parametrize("length", [16, 17, 31, 32, 33, 100])
def test_same_prompt_twice_caches_all_but_the_last_tokens_block(cached, length):
    cached.reset_prefix_cache()
    prompt = _ids(random.Random(length), length)
    first = cached.generate([prompt], GREEDY)[0]
    second = cached.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (length - 1) // 16 * 16
    assert second.token_ids == first.token_ids


def test_cache_salt_isolates(cached):
    cached.reset_prefix_cache()
    prompt = _ids(random.Random(5), 64)
    a = cached.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    b = cached.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    a2 = cached.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    plain = cached.generate([prompt], GREEDY)[0]
    assert (a.num_cached_tokens, b.num_cached_tokens, plain.num_cached_tokens) == (0, 0, 0)
    assert a2.num_cached_tokens == 48
    assert a.token_ids == b.token_ids == a2.token_ids == plain.token_ids


def test_stats_and_reset(cached):
    cached.reset_prefix_cache()
    engine = cached.engine
    before = engine.prefix_cache_stats()
    prompt = _ids(random.Random(6), 48)
    cached.generate([prompt, prompt], GREEDY)
    after = engine.prefix_cache_stats()
    assert after["queries"] - before["queries"] == 96
    assert after["hits"] - before["hits"] == 32
    assert cached.reset_prefix_cache() > 0
    assert cached.generate([prompt], GREEDY)[0].num_cached_tokens == 0


def test_eviction_keeps_outputs_identical(make_llm, uncached, tiny_model):
    # 40 blocks: the cached blocks of earlier prompts get evicted and reused.
    tiny = make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=128,
                    max_num_seqs=4, kv_cache_gib=kv_gib(tiny_model, 40))
    rng = random.Random(7)
    shared = _ids(rng, 150)
    prompts = [shared[: rng.choice([20, 70, 150])] + _ids(rng, rng.randint(5, 120))
               for _ in range(14)]
    want = [o.token_ids for o in uncached.generate(prompts, GREEDY)]
    got = []
    for i in range(0, len(prompts), 3):  # waves, so later waves meet evicted blocks
        got += [o.token_ids for o in tiny.generate(prompts[i:i + 3], GREEDY)]
    assert got == want
    stats = tiny.engine.prefix_cache_stats()
    assert stats["evictions"] > 0 and stats["hits"] > 0


def test_pool_hit_leaves_the_free_queue_middle_and_eviction_is_lazy():
    from baton.services.engine.block_pool import BlockPool

    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(b, b"hash-b")
    pool.free_blocks([c, b, a])  # free queue: 4 5 c b a
    assert [x.block_id for x in pool.free_queue] == [4, 5, c.block_id, b.block_id, a.block_id]
    hit = pool.get_cached(b"hash-b")
    assert hit is b
    pool.touch([hit])  # out of the middle; the rest keep their order
    assert [x.block_id for x in pool.free_queue] == [4, 5, c.block_id, a.block_id]
    assert b.ref_cnt == 1
    pool.free_blocks([b])  # back at the tail, still cached
    assert pool.get_cached(b"hash-b") is b and pool.num_evictions == 0
    pool.get_new_blocks(4)  # 4, 5, c, a: b is not reached yet
    assert pool.get_cached(b"hash-b") is b
    (reused,) = pool.get_new_blocks(1)  # now b is reused: its entry goes
    assert reused is b and pool.get_cached(b"hash-b") is None
    assert b.block_hash is None and pool.num_evictions == 1
