"""Which blocks each request holds, and growing that set one step at a time."""

from __future__ import annotations

from services.engine.block_pool import BlockPool, KVCacheBlock
from services.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self._blocks: dict[str, list[KVCacheBlock]] = {}

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more KV entries; False (and no change) if the pool
        cannot, so the scheduler can preempt someone and try again.

            |<----- num_computed_tokens ----->|<-- num_new_tokens -->|
            [ block 0 ][ block 1 ][ block 2 .........][ new block ]
            |<------- blocks already held -------->|<- allocated ->|

        Blocks needed = ceil((computed + new) / block_size); only the shortfall is taken.
        """
        blocks = self._blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        need = -(-total // self.block_size) - len(blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        blocks.extend(self.pool.get_new_blocks(need))
        return True

    def free(self, request: Request) -> None:
        """Return every block of the request to the pool, tail blocks first."""
        blocks = self._blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / max(1, self.pool.num_blocks - 1)
