"""What the router knows of each worker's prefix cache, and what a prompt would find there.

Each worker's index is fed by its KV events (services/common/kv_events.py): block hashes
it stored or evicted, the same chained hashes its engine computes (block_hash.py), so a
prompt's hashes computed here name the same blocks. Between two polls the router also
*predicts*: a prompt it sends to a worker will be stored there, so the next request of
the same prefix follows it at once. A prediction that no event confirms within
`predict_ttl_s` is forgotten (the request failed, or the worker evicted it unseen).

A worker may also keep blocks in offload tiers ("host", "disk"; their events name the
medium). Its engine takes a prompt's leading blocks from its pool, then, from the first
block the pool lacks, loads the blocks that follow from a tier (host, else disk) until
one is in neither. `hit` says how many of each a prompt would find; the tiers are known
from events only (a prompt sent there is predicted into the pool, not a tier).

Memory is bounded: at most `max_blocks` hashes per worker, pool and tiers together (tier
hashes go first, the oldest first, then the pool's: a tier may be many times the size of
the pool, and a pool hit is worth more); the pool's confirmed ones mirror the worker's
own cache, which its KV budget bounds. A prediction or an event costs O(its blocks),
however full the index: hashes are kept oldest first, each one (re)inserted moves to the
end, and the bound takes from the front.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from typing import NamedTuple

from baton.services.common.block_hash import extend_hashes, extra_keys

DEFAULT_MAX_BLOCKS = 1 << 20  # per worker: about 120 MB at most (~117 bytes an entry)
PREDICT_TTL_S = 10.0
TIER_BITS = {"host": 1, "disk": 2}  # a tier hash's media, as bits (an engine asks host first)


class PromptBlocks:
    """A prompt's chained block hashes, per block size (computed once, when first asked)."""

    def __init__(self, token_ids: list[int], cache_salt: str = "", lora_name: str = ""):
        self.token_ids = token_ids
        self.lora = lora_name  # the LoRA adapter it runs ("": the base model)
        self.extra = extra_keys(cache_salt, lora_name)
        self._hashes: dict[int, list[bytes]] = {}

    def hashes(self, block_size: int) -> list[bytes]:
        out = self._hashes.get(block_size)
        if out is None:
            out = self._hashes[block_size] = []
            extend_hashes(out, self.token_ids, block_size, self.extra)
        return out

    def reusable(self, block_size: int) -> int:
        """Blocks an engine can take from its cache: never the one with the last token,
        which it recomputes to have logits to sample from."""
        return (len(self.token_ids) - 1) // block_size


class Hit(NamedTuple):
    """What a prompt finds on a worker: leading pool blocks, then the tier blocks that
    continue them, by the medium each is loaded from."""
    pool: int = 0
    host: int = 0
    disk: int = 0


class PrefixIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 predict_ttl_s: float = PREDICT_TTL_S):
        self.max_blocks = max_blocks
        self.predict_ttl_s = predict_ttl_s
        self.engine_id = ""  # whose events `seq` counts
        self.seq = 0  # the last event applied
        self.block_size = 0  # 0 until the first events: nothing known
        self.enabled = True  # the worker caches prefixes at all
        # hash -> 0.0 if confirmed, else when predicted; oldest first
        self._held: OrderedDict[bytes, float] = OrderedDict()
        # the tiers' hashes -> TIER_BITS of the media holding each; confirmed only
        self._tiers: OrderedDict[bytes, int] = OrderedDict()
        self._pruned = time.monotonic()  # when expired predictions were last dropped

    def __len__(self) -> int:
        return len(self._held) + len(self._tiers)

    def apply(self, reply) -> None:
        """A GetKvEventsResponse. A snapshot replaces every confirmed hash (predictions
        stay until they expire: the worker may not have stored them yet)."""
        self.block_size, self.enabled = reply.block_size, reply.enabled
        if reply.snapshot or reply.engine_id != self.engine_id:
            self._held = OrderedDict((h, t) for h, t in self._held.items() if t)
            self._tiers = OrderedDict()
        for h in reply.removed:
            self._held.pop(h, None)
        for h in reply.stored:
            self._held[h] = 0.0
            self._held.move_to_end(h)  # the newest are the last to go
        for tier in reply.tiers:
            self._apply_tier(TIER_BITS.get(tier.medium, 0), tier)
        self.engine_id, self.seq = reply.engine_id, reply.seq
        now = time.monotonic()
        if now - self._pruned > self.predict_ttl_s:
            self._pruned = now
            self._held = OrderedDict((h, t) for h, t in self._held.items()
                                     if not t or now - t <= self.predict_ttl_s)
        self._bound()

    def predict(self, prompt: PromptBlocks, now: float | None = None) -> None:
        if not self.block_size or not self.enabled:
            return
        now = time.monotonic() if now is None else now
        for h in prompt.hashes(self.block_size):
            if self._held.get(h, 1.0):  # absent or predicted: (re)predict
                self._held[h] = now
                self._held.move_to_end(h)
        self._bound()

    def _apply_tier(self, bit: int, tier) -> None:
        if not bit:
            return  # a medium this router does not know (a newer worker's)
        for h in tier.removed:
            bits = self._tiers.get(h, 0) & ~bit
            if bits:
                self._tiers[h] = bits
            else:
                self._tiers.pop(h, None)
        for h in tier.stored:
            self._tiers[h] = self._tiers.get(h, 0) | bit
            self._tiers.move_to_end(h)

    def match(self, prompt: PromptBlocks, now: float | None = None,
              confirmed: bool = False) -> int:
        """How many of the prompt's leading blocks the worker's pool holds (as far as
        known; with `confirmed`, as its events said), counting only blocks its engine
        would reuse."""
        return self.hit(prompt, now, confirmed).pool

    def hit(self, prompt: PromptBlocks, now: float | None = None,
            confirmed: bool = False) -> Hit:
        """`match`'s pool blocks, then the run of tier blocks that continues them."""
        if not self.block_size or not self.enabled:
            return Hit()
        now = time.monotonic() if now is None else now
        hashes = prompt.hashes(self.block_size)[:prompt.reusable(self.block_size)]
        n = 0
        for h in hashes:
            t = self._held.get(h)
            if t is None or (t and (confirmed or now - t > self.predict_ttl_s)):
                break
            n += 1
        host = disk = 0
        if self._tiers:
            for h in itertools.islice(hashes, n, None):
                bits = self._tiers.get(h, 0)
                if not bits:
                    break
                if bits & TIER_BITS["host"]:
                    host += 1
                else:
                    disk += 1
        return Hit(n, host, disk)

    def holds(self, h: bytes) -> bool:
        """Whether the worker's KV events say it holds block `h` (not only predicted)."""
        predicted = self._held.get(h)
        return predicted is not None and not predicted

    def reset(self) -> None:
        """The worker restarted or went away: it holds nothing we know of."""
        self._held.clear()
        self._tiers.clear()
        self.engine_id, self.seq = "", 0

    def _bound(self) -> None:
        while len(self._held) + len(self._tiers) > self.max_blocks:
            # the oldest, of the tiers first
            (self._tiers or self._held).popitem(last=False)
