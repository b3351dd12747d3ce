"""What the router knows of each worker's prefix cache, and what a prompt would find there.

Each worker's index is fed by its KV events (services/common/kv_events.py): block hashes
it stored or evicted, the same chained hashes its engine computes (block_hash.py), so a
prompt's hashes computed here name the same blocks. Between two polls the router also
*predicts*: a prompt it sends to a worker will be stored there, so the next request of
the same prefix follows it at once. A prediction that no event confirms within
`predict_ttl_s` is forgotten (the request failed, or the worker evicted it unseen).

Memory is bounded: at most `max_blocks` hashes per worker (the oldest go first); the
confirmed ones mirror the worker's own cache, which its KV budget bounds. A prediction or
an event costs O(its blocks), however full the index: hashes are kept oldest first, each
one (re)inserted moves to the end, and the bound takes from the front.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from baton.services.common.block_hash import extend_hashes, extra_keys

DEFAULT_MAX_BLOCKS = 1 << 20  # per worker: about 120 MB at most (~117 bytes an entry)
PREDICT_TTL_S = 10.0


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
        self._pruned = time.monotonic()  # when expired predictions were last dropped

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, reply) -> None:
        """A GetKvEventsResponse. A snapshot replaces every confirmed hash (predictions
        stay until they expire: the worker may not have stored them yet)."""
        self.block_size, self.enabled = reply.block_size, reply.enabled
        if reply.snapshot or reply.engine_id != self.engine_id:
            self._held = OrderedDict((h, t) for h, t in self._held.items() if t)
        for h in reply.removed:
            self._held.pop(h, None)
        for h in reply.stored:
            self._held[h] = 0.0
            self._held.move_to_end(h)  # the newest are the last to go
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

    def match(self, prompt: PromptBlocks, now: float | None = None,
              confirmed: bool = False) -> int:
        """How many of the prompt's leading blocks the worker holds (as far as known; with
        `confirmed`, as its events said), counting only blocks its engine would reuse."""
        if not self.block_size or not self.enabled:
            return 0
        now = time.monotonic() if now is None else now
        hashes = prompt.hashes(self.block_size)[:prompt.reusable(self.block_size)]
        n = 0
        for h in hashes:
            t = self._held.get(h)
            if t is None or (t and (confirmed or now - t > self.predict_ttl_s)):
                break
            n += 1
        return n

    def reset(self) -> None:
        """The worker restarted or went away: it holds nothing we know of."""
        self._held.clear()
        self.engine_id, self.seq = "", 0

    def _bound(self) -> None:
        while len(self._held) > self.max_blocks:
            self._held.popitem(last=False)  # the oldest
