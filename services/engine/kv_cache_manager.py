"""Which blocks each request holds, growing that set one step at a time, and the prefix
cache lookups in front of it."""

from __future__ import annotations

from ..common.block_hash import extend_hashes
from .block_pool import BlockPool, KVCacheBlock
from .request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_published: dict[str, int] = {}  # leading blocks already in the cache map
        self._private: set[str] = set()  # requests whose blocks are never published
        # Blocks published since take_published(): (hash, block id, LoRA adapter), for
        # the connectors that save them (kv_loads.py). Kept only when one does.
        self.record_published = False
        self._published: list[tuple[bytes, int, str | None]] = []
        self.num_queries = 0  # prompt tokens looked up
        self.num_hits = 0  # of which found cached

    def _hashes(self, request: Request) -> list[bytes]:
        extend_hashes(request.block_hashes, request.token_ids, self.block_size,
                      request.hash_extra)
        return request.block_hashes

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached blocks that starts the request's tokens.

        Never the block holding the last token: that token is always recomputed, so the
        step has logits to sample from. Changes nothing; allocate_slots takes the hits.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for h in self._hashes(request)[:max_blocks]:
            block = self.pool.get_cached(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_cached: int) -> None:
        self.num_queries += num_tokens
        self.num_hits += num_cached

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None,
                       publish: bool = True) -> bool:
        """Make room for `num_new_tokens` more KV entries after the computed ones (and after
        `computed_blocks`, prefix-cache hits for a request that holds no block yet).
        False, with nothing changed, if the pool cannot: the scheduler may preempt.

            |<-- cache hits -->|<- num_computed ->|<-- num_new_tokens -->|
            [ hit ][ hit ][ held ........ ][ held ..][ new ][ new ]
                                     full blocks get published ->|

        Blocks needed = ceil(total / block_size); only the shortfall is taken. Hits that
        sit free in the queue stop counting as free once taken, so they count here too.
        `publish=False` is for blocks filled from elsewhere (remote KV): publish() them
        once their contents have arrived.
        """
        computed_blocks = computed_blocks or []
        blocks = self._blocks.setdefault(request.request_id, [])
        total = (len(computed_blocks) * self.block_size + request.num_computed_tokens
                 + num_new_tokens)
        need = -(-total // self.block_size) - len(blocks) - len(computed_blocks)
        free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(need, 0) > self.pool.num_free_blocks - free_hits:
            if not blocks:
                del self._blocks[request.request_id]
            return False
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        if publish:
            self.publish(request, total)
        return True

    def publish(self, request: Request, total: int) -> None:
        """Put every block that is full once this step has run into the cache map. Another
        request may hit it in this same step: each layer writes the step's K/V before any
        attention reads them, so its contents are there in time."""
        if not self.enable_prefix_caching or request.request_id in self._private:
            return
        blocks = self._blocks.get(request.request_id, [])
        hashes = self._hashes(request)
        num_full = min(total // self.block_size, len(hashes))
        done = self._num_published.get(request.request_id, 0)
        for i in range(done, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
            if self.record_published:
                self._published.append((hashes[i], blocks[i].block_id, request.lora_name))
        self._num_published[request.request_id] = max(done, num_full)

    def keep_private(self, request: Request) -> None:
        """Never publish the blocks the request holds now or gets later (its KV came from
        a source nobody vouched for, and what it computes next attends to that KV), until
        it lets them go: after free() (a preemption), what it recomputes is its own."""
        self._private.add(request.request_id)

    def free(self, request: Request) -> None:
        """Return every block of the request to the pool, tail blocks first (so they are
        evicted first, and the shared head of a prefix stays cached longest)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_published.pop(request.request_id, None)
        self._private.discard(request.request_id)
        self.pool.free_blocks(reversed(blocks))

    def take(self, request: Request) -> list[KVCacheBlock]:
        """Stop tracking the request's blocks without freeing them: the caller holds them
        (a pull that timed out, whose transport may still write) and frees them later
        with free_blocks."""
        self._num_published.pop(request.request_id, None)
        self._private.discard(request.request_id)
        return self._blocks.pop(request.request_id, [])

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def take_published(self) -> list[tuple[bytes, int, str | None]]:
        """The blocks published since the last call, as (hash, block id, LoRA adapter),
        that still hold that hash: a block freed since (a preemption, a failed load) may
        have been taken by another request in this step, and one published for a step
        that failed was never written (the engine then drops every hash)."""
        out, self._published = self._published, []
        return [p for p in out if self.pool.blocks[p[1]].block_hash == p[0]]
