"""BlockPool, FreeBlockQueue and KVCacheManager on their own (no model).

The contract (vLLM's): block 0 is a null block that is never handed out; new blocks come
from the head of an LRU free queue and freed blocks join its tail, a request's blocks
tail-first; a block leaves the queue only when nothing references it; allocation is all
or nothing.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from baton.services.engine.kv_cache_manager import KVCacheManager
from baton.services.engine.request import Request


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _queue_ids(pool: BlockPool) -> list[int]:
    return _ids(pool.free_queue)


def _req(request_id: str = "r", computed: int = 0):
    return SimpleNamespace(request_id=request_id, num_computed_tokens=computed, token_ids=[],
                           block_hashes=[], hash_extra=b"")


# ---- BlockPool / FreeBlockQueue ------------------------------------------------------


def test_fresh_pool_all_but_null_block_free():
    pool = BlockPool(8)
    assert pool.num_blocks == 8
    assert pool.null_block.block_id == 0
    assert pool.num_free_blocks == 7
    assert _queue_ids(pool) == [1, 2, 3, 4, 5, 6, 7]
    pool.check_all_free()


@pytest.mark.parametrize("n", [0, 1, -3])
def test_pool_needs_two_blocks(n):
    with pytest.raises(ValueError, match=str(n)):
        BlockPool(n)


def test_null_block_never_handed_out():
    pool = BlockPool(5)
    for _ in range(10):  # drain, free in various orders, repeat
        got = pool.get_new_blocks(4)
        assert 0 not in _ids(got)
        assert sorted(_ids(got)) == [1, 2, 3, 4]
        assert all(b.ref_cnt == 1 for b in got)
        assert pool.null_block.ref_cnt == 0
        with pytest.raises(ValueError):
            pool.get_new_blocks(1)
        pool.free_blocks(got[::2] + got[1::2])
    pool.check_all_free()


def test_new_blocks_come_from_the_head_in_lru_order():
    pool = BlockPool(7)
    a = pool.get_new_blocks(2)
    assert _ids(a) == [1, 2]
    b = pool.get_new_blocks(3)
    assert _ids(b) == [3, 4, 5]
    # Free 4, then 1, then 5: the queue is 6 (never used), then the freed ones in the
    # order they were freed.
    pool.free_blocks([b[1]])
    pool.free_blocks([a[0]])
    pool.free_blocks([b[2]])
    assert _queue_ids(pool) == [6, 4, 1, 5]
    assert _ids(pool.get_new_blocks(3)) == [6, 4, 1]
    assert _queue_ids(pool) == [5]


def test_freed_blocks_join_the_tail_in_the_order_given():
    pool = BlockPool(6)
    got = pool.get_new_blocks(5)
    pool.free_blocks([got[2], got[0], got[4], got[1], got[3]])
    assert _queue_ids(pool) == [3, 1, 5, 2, 4]
    pool.check_all_free()


def test_remove_from_the_middle_keeps_the_rest_in_order():
    blocks = [KVCacheBlock(i) for i in range(1, 7)]
    q = FreeBlockQueue(blocks)
    assert q.num_free == 6
    q.remove(blocks[2])  # id 3, middle
    assert _ids(q) == [1, 2, 4, 5, 6] and q.num_free == 5
    q.remove(blocks[0])  # head
    q.remove(blocks[5])  # tail
    assert _ids(q) == [2, 4, 5] and q.num_free == 3
    # A removed block cannot be removed again, and the queue is untouched by the attempt.
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    assert _ids(q) == [2, 4, 5] and q.num_free == 3
    q.append(blocks[2])
    assert _ids(q) == [2, 4, 5, 3]
    assert q.popleft().block_id == 2
    assert _ids(q) == [4, 5, 3] and q.num_free == 3


def test_popleft_on_empty_queue_raises():
    q = FreeBlockQueue([KVCacheBlock(1)])
    assert q.popleft().block_id == 1
    assert q.num_free == 0 and list(q) == []
    with pytest.raises(IndexError):
        q.popleft()


def test_shared_block_stays_out_of_the_queue_until_last_reference_dropped():
    pool = BlockPool(4)
    blk, other = pool.get_new_blocks(2)
    blk.ref_cnt += 1  # a second owner (as a prefix-cache hit would add)
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1
    assert blk.block_id not in _queue_ids(pool)
    assert pool.num_free_blocks == 1
    with pytest.raises(AssertionError):
        pool.check_all_free()
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0
    assert _queue_ids(pool) == [3, blk.block_id]
    pool.free_blocks([other])
    pool.check_all_free()


def test_double_free_raises_and_does_not_corrupt_the_queue():
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    before = _queue_ids(pool)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blk])
    assert _queue_ids(pool) == before
    assert pool.num_free_blocks == 3
    assert blk.ref_cnt == 0
    pool.check_all_free()


def test_asking_for_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(6)
    held = pool.get_new_blocks(2)
    before = _queue_ids(pool)
    with pytest.raises(ValueError, match="4"):
        pool.get_new_blocks(4)
    assert _queue_ids(pool) == before and pool.num_free_blocks == 3
    assert all(pool.blocks[i].ref_cnt == 0 for i in before)
    # Exactly what is free still works.
    rest = pool.get_new_blocks(3)
    assert _ids(rest) == before
    pool.free_blocks(held + rest)
    pool.check_all_free()


def test_check_all_free_names_a_held_block():
    pool = BlockPool(4)
    pool.check_all_free()
    (blk,) = pool.get_new_blocks(1)
    with pytest.raises(AssertionError, match="1 blocks"):
        pool.check_all_free()
    pool.free_blocks([blk])
    pool.check_all_free()


# ---- KVCacheManager ------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 15, 16, 17, 31, 32, 33, 64])
def test_allocate_slots_takes_ceil_blocks(block_size, tokens):
    need = math.ceil(tokens / block_size)
    pool = BlockPool(need + 3)
    kv = KVCacheManager(pool, block_size)
    req = _req()
    assert kv.allocate_slots(req, tokens)
    ids = kv.block_ids("r")
    assert len(ids) == need
    assert len(set(ids)) == need and 0 not in ids
    assert pool.num_free_blocks == 2  # need + 3 blocks, one null, need taken
    # Asking again for the same tokens takes nothing more.
    assert kv.allocate_slots(req, tokens)
    assert kv.block_ids("r") == ids
    kv.free(req)
    pool.check_all_free()


def test_allocate_slots_grows_one_decode_at_a_time():
    bs = 4
    pool = BlockPool(12)
    kv = KVCacheManager(pool, bs)
    req = _req()
    assert kv.allocate_slots(req, 6)  # prompt of 6
    req.num_computed_tokens = 6
    held = kv.block_ids("r")
    assert len(held) == 2
    for total in range(7, 30):  # each step: one more token's KV
        assert kv.allocate_slots(req, 1)
        now = kv.block_ids("r")
        assert len(now) == math.ceil(total / bs)
        assert now[: len(held)] == held  # existing blocks are kept, in place
        held = now
        req.num_computed_tokens = total
    assert pool.num_free_blocks == 11 - math.ceil(29 / bs)
    kv.free(req)
    pool.check_all_free()


def test_allocate_slots_short_returns_false_and_changes_nothing():
    bs = 16
    pool = BlockPool(5)  # 4 usable
    kv = KVCacheManager(pool, bs)
    a, b = _req("a"), _req("b")
    assert kv.allocate_slots(a, 40)  # 3 blocks
    a_ids = kv.block_ids("a")
    free_before = _queue_ids(pool)
    assert free_before and len(free_before) == 1
    # b needs 2 blocks, only 1 is free: refused whole, nothing taken.
    assert kv.allocate_slots(b, 17) is False
    assert kv.block_ids("b") == []
    assert _queue_ids(pool) == free_before
    # a growing past what is left is refused too, and keeps what it had.
    a.num_computed_tokens = 40
    assert kv.allocate_slots(a, 40) is False  # 80 tokens -> 5 blocks, has 3, 1 free
    assert kv.block_ids("a") == a_ids
    assert _queue_ids(pool) == free_before
    # What fits still fits.
    assert kv.allocate_slots(a, 8)  # 48 tokens -> exactly 3 blocks, nothing new
    assert kv.allocate_slots(a, 9)  # 49 -> 4 blocks
    assert pool.num_free_blocks == 0
    kv.free(a)
    kv.free(b)
    pool.check_all_free()


def test_free_returns_all_blocks_tail_first():
    pool = BlockPool(8)
    kv = KVCacheManager(pool, 4)
    a, b = _req("a"), _req("b")
    assert kv.allocate_slots(a, 12)
    assert kv.allocate_slots(b, 8)
    a_ids, b_ids = kv.block_ids("a"), kv.block_ids("b")
    assert a_ids == [1, 2, 3] and b_ids == [4, 5]
    assert pool.num_free_blocks == 2
    kv.free(a)
    # Never-used blocks stay ahead; a's blocks follow, last block first.
    assert _queue_ids(pool) == [6, 7, 3, 2, 1]
    assert kv.block_ids("a") == []
    kv.free(b)
    assert _queue_ids(pool) == [6, 7, 3, 2, 1, 5, 4]
    assert pool.num_free_blocks == 7
    pool.check_all_free()
    kv.free(a)  # freeing a request with nothing held is a no-op
    pool.check_all_free()


def test_free_of_one_request_leaves_another_untouched():
    pool = BlockPool(10)
    kv = KVCacheManager(pool, 2)
    a, b = _req("a"), _req("b")
    assert kv.allocate_slots(a, 5)
    assert kv.allocate_slots(b, 7)
    b_ids = kv.block_ids("b")
    assert not set(kv.block_ids("a")) & set(b_ids)
    kv.free(a)
    assert kv.block_ids("b") == b_ids
    assert all(pool.blocks[i].ref_cnt == 1 for i in b_ids)
    with pytest.raises(AssertionError):
        pool.check_all_free()
    kv.free(b)
    pool.check_all_free()


def test_manager_with_a_real_request():
    pool = BlockPool(6)
    kv = KVCacheManager(pool, 16)
    req = Request("real", list(range(10, 60)), SamplingParams(max_tokens=4), (2,))
    assert kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    assert len(kv.block_ids("real")) == 4  # 50 tokens
    req.num_computed_tokens = req.num_tokens
    req.token_ids.append(7)
    assert kv.allocate_slots(req, 1)  # 51 tokens still fit in 4 blocks
    assert len(kv.block_ids("real")) == 4 and pool.num_free_blocks == 1
    kv.free(req)
    pool.check_all_free()
