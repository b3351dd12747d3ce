"""The paged KV block pool: fixed-size blocks, reference counts and an LRU free queue.

Block 0 is the null block: it pads block tables and is never handed out. Freed blocks
go to the tail of the free queue and new blocks come from its head, so the block freed
longest ago is reused first. The queue is a doubly linked list through the blocks
themselves, so a block can leave it from the middle in O(1) (a prefix-cache hit).

Prefix cache: a full block may carry a hash (see block_hash.py) and sit in the
`hash -> block` map. It stays cached while free, in LRU order, until the pool hands it
out again; only then (lazily) is its map entry removed. An optional KvEventLog hears of
every hash that enters or leaves the map: the routers' view of this cache.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..common.kv_events import KvEventLog


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels, in LRU order."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, events: KvEventLog | None = None):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs >= 2 blocks (one is null), got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0
        self.events = events

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks from the head of the free queue, each with ref_cnt 1."""
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks with {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # lazy eviction of a cached free block
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    if self.events is not None:
                        self.events.removed(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the queue's middle."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Publish a full block under its hash. If an equal block is already published, the
        first one stays the cache entry and this one simply is not shared."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        if self.cached.setdefault(block_hash, block) is block and self.events is not None:
            self.events.stored(block_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every hash; blocks in use keep their data but will not be shared."""
        n = len(self.cached)
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return n

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; a block at zero joins the tail of the free queue.

        Callers pass a request's blocks last-first, so its tail blocks are reused first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def check_all_free(self) -> None:
        """Debug invariant: no request holds a block. Raises AssertionError naming a culprit."""
        held = [b for b in self.blocks[1:] if b.ref_cnt != 0]
        if held:
            raise AssertionError(f"{len(held)} blocks still referenced, e.g. {held[:3]}")
        in_queue = list(self.free_queue)
        if len(in_queue) != self.num_blocks - 1 or len({b.block_id for b in in_queue}) != len(
            in_queue
        ):
            raise AssertionError(
                f"free queue holds {len(in_queue)} blocks, expected {self.num_blocks - 1}"
            )
