"""The KV connector interface (see the package docstring for the split).

A connector is asked, for a waiting request, how many tokens past the pool's prefix-cache
hits it can supply (`match`). The first connector in the stack that answers takes the
request: kv_loads.KVLoads allocates the blocks and calls `start_load` with the local
block ids to fill, then `poll`s until the load ends. A load that ends with an error says
how many of its leading blocks did land (`LoadResult.num_ok_blocks`): those count as
computed, only the rest is recomputed.

After every step, every connector may `save` the blocks the step made full (and those
loads landed): their contents are final then, and each still holds the hash it is given
with (KVCacheManager.take_published drops a block freed and taken since). A freed block
may be reused by the next schedule, so a connector copies what it keeps in `save` (on
the engine thread) and may write the copy anywhere later, behind the steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from ..request import Request


@dataclass(frozen=True)
class LoadResult:
    """A load that ended: `error` None if every block landed, else why it stopped and how
    many of its leading blocks are good anyway."""

    num_ok_blocks: int
    error: str | None = None


@dataclass(frozen=True)
class SavedBlock:
    """A full block the last step computed (or a load landed): its chained hash and id,
    and the LoRA adapter of the request that published it (its hash names it)."""

    block_hash: bytes
    block_id: int
    lora_name: str | None = None


class KVConnector(ABC):
    name: ClassVar[str]
    # Seconds a load may take before it fails like any other (a transport stuck on a peer
    # that froze). Its blocks are set aside until `poll` says the load is over.
    load_timeout_s: ClassVar[float] = 10.0
    saves: ClassVar[bool] = False  # True: give it every block the steps make full

    # ---- scheduler side ------------------------------------------------------------

    @abstractmethod
    def match(self, req: Request, num_hit_blocks: int) -> int | None:
        """Tokens this connector can load after the request's first `num_hit_blocks`
        blocks (pool hits), or None if it has nothing for the request. 0 takes the
        request with nothing to load (its KV is all in the pool already)."""

    def publishable(self, req: Request) -> bool:
        """May the blocks this connector loads for `req` enter the shared prefix cache?"""
        return True

    # ---- worker side ---------------------------------------------------------------

    @abstractmethod
    def start_load(self, load_id: str, req: Request, first_block: int,
                   block_ids: list[int]) -> None:
        """Fill local `block_ids` with the request's blocks `first_block`, `first_block+1`,
        ... Never blocks, never raises for a transfer problem: `poll` reports it."""

    @abstractmethod
    def poll(self, load_id: str) -> LoadResult | None:
        """None while the load runs; its result once, after which the id is forgotten
        (a later poll of it is a LoadResult with an error). The blocks must stay
        allocated until then: the load may still write them."""

    def save(self, blocks: list[SavedBlock]) -> None:  # noqa: B027 - optional hook
        """Blocks the step just made full (or a load just landed), in the pool now."""

    def stats(self) -> dict[str, int]:
        return {}

    def busy(self) -> bool:
        """Work in flight that the engine should wait for before it says it is idle."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
