"""The offload tiers as a connector: blocks the pool computed are copied out to a host
tier and a disk tier (kv_offload/store.py), and a prefix found there is loaded back
instead of recomputed.

    save (engine thread, after a step)          saver thread
    new full blocks ──gather per rank──> [n, layers, block bytes] ──> host, disk files
    load (loader thread)
    host (else disk) file per rank ──MAC checked──> the request's blocks in every layer

Keys. A block's bytes are valid for a reader exactly when its hash matches (the chained
token hash with the namespace, salt and LoRA adapter in it: block_hash.py) and the cache
that wrote it had the same layout (the P/D handshake's fingerprint: model and revision,
KV dtype and scales, block size, heads, layout) and held the same heads (the
tensor-parallel slice) and computed it with the same weights (the P/D fingerprint names
the model, not the files: a folder updated in place keeps its name). So a key is
`<fingerprint and weights>-r<rank>of<size>/<hash>`: one file per rank's slice, and a
block counts as present in a tier only if every rank's slice is. LoRA requests stay out
of the tiers: their hashes carry the adapter's name as this process bound it
(services/lora/registry.py), which another process may bind to other weights.

The save copies the blocks out on the engine thread (a gather: ~0.4 MB a block for the
default model), because a freed block may be reused by the next step; the files are
written behind the steps by the saver thread, and dropped (counted) rather than queued
past `MAX_QUEUED_BYTES`. A load that finds a block missing (evicted by another worker
since the match) or rejected (corrupt, forged, foreign: kv_offload/store.py) stops
there: the blocks before it count, the rest is recomputed (kv_loads.py). The tiers' MAC
key is the cluster token's where there is one (every worker of the cluster shares it),
else each tier folder's key file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import Counter

import torch

from ...common.kv_events import KvEventLog
from ..kv_offload.store import REJECTED, BlockStore
from ..private_files import shared_memory_dir
from ..request import Request
from .base import KVConnector, LoadResult, SavedBlock
from .context import ConnectorContext

log = logging.getLogger(__name__)

GIB = 1 << 30
MAX_QUEUED_BYTES = 256 << 20  # copied-out blocks waiting for the saver, at most
SWEEP_S = 30.0  # how often the saver re-reads the tiers' contents into the KV events


def default_host_path() -> str:
    """Shared memory every process on the host sees (tmpfs), one folder per user (made
    0700 by the first of its workers; one that another user made first is refused)."""
    return os.path.join(shared_memory_dir(), f"baton-kv-{os.getuid()}")


class OffloadConnector(KVConnector):
    name = "offload"
    saves = True

    def __init__(self, tiers: list[BlockStore], rank_caches: list[list], fingerprint: str,
                 block_size: int, events: KvEventLog | None = None):
        self.tiers = tiers  # fastest first: host, then disk
        self.events = events
        # Byte views of the caches: a block's bytes move whatever the dtype (fp8 too).
        self.rank_caches = [[c.view(torch.uint8) for c in caches] for caches in rank_caches]
        self.payload_bytes = [len(caches) * caches[0][0].numel()
                              for caches in self.rank_caches]
        self.block_size = block_size
        size = len(rank_caches)
        self.namespaces = [f"{fingerprint}-r{r}of{size}" for r in range(size)]
        self.counts: Counter[str] = Counter()
        self._sweep()  # what the tiers hold already: a restart's disk, other workers' blocks
        self._lock = threading.Lock()  # counts and results, between threads
        self._results: dict[str, LoadResult] = {}
        self._loads: queue.Queue = queue.Queue()
        self._saves: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._threads = [threading.Thread(target=self._run, args=(q, f), daemon=True,
                                          name=f"kv-offload-{n}")
                         for n, q, f in (("load", self._loads, self._load),
                                         ("save", self._saves, self._save))]
        for t in self._threads:
            t.start()

    @classmethod
    def from_context(cls, ctx: ConnectorContext) -> OffloadConnector:
        config = ctx.config
        tiers = []
        secret = config.cluster_token
        if config.kv_offload_gib > 0:
            tiers.append(BlockStore(config.kv_offload_host_path or default_host_path(),
                                    int(config.kv_offload_gib * GIB), "host", secret))
        if config.kv_offload_disk_path:
            tiers.append(BlockStore(config.kv_offload_disk_path,
                                    int(config.kv_offload_disk_gib * GIB), "disk", secret))
        namespace = hashlib.sha256(f"{ctx.layout.fingerprint}|{ctx.weights}".encode())
        return cls(tiers, ctx.rank_caches, namespace.hexdigest()[:16], config.block_size,
                   ctx.events)

    def _sweep(self) -> None:
        """Make the KV events say what the tiers hold (rank 0's slices stand for the
        block): what other workers saved to a shared tier or evicted from it, and what
        was found corrupt, is told like this worker's own saves and evictions."""
        self._next_sweep = time.monotonic() + SWEEP_S
        if self.events is None:
            return
        for tier in self.tiers:
            there = {h for k in tier.keys(self.namespaces[0])
                     if (h := _hash(k.split("/")[1])) is not None}
            told = self.events.hashes(tier.medium)
            for h in told - there:
                self.events.removed(h, tier.medium)
            for h in there - told:
                self.events.stored(h, tier.medium)

    def _keys(self, block_hash: bytes) -> list[str]:
        return [f"{ns}/{block_hash.hex()}" for ns in self.namespaces]

    def _tier_of(self, block_hash: bytes) -> BlockStore | None:
        keys = self._keys(block_hash)
        return next((t for t in self.tiers if all(t.contains(k) for k in keys)), None)

    # ---- scheduler side ------------------------------------------------------------

    def match(self, req: Request, num_hit_blocks: int) -> int | None:
        if req.remote is not None or req.lora_name:  # pulled from its prefill worker; LoRA
            return None
        # Never the block with the last token: it is computed, for logits to sample.
        last = (req.num_tokens - 1) // self.block_size
        n = 0
        for h in req.block_hashes[num_hit_blocks:last]:
            if self._tier_of(h) is None:
                break
            n += 1
        return n * self.block_size if n else None

    # ---- worker side ---------------------------------------------------------------

    def start_load(self, load_id: str, req: Request, first_block: int,
                   block_ids: list[int]) -> None:
        hashes = req.block_hashes[first_block:first_block + len(block_ids)]
        self._loads.put((load_id, list(zip(hashes, block_ids, strict=True))))

    def poll(self, load_id: str) -> LoadResult | None:
        with self._lock:
            return self._results.pop(load_id, None)

    def _load(self, item) -> None:
        load_id, blocks = item
        result = LoadResult(len(blocks))
        for i, (h, block_id) in enumerate(blocks):
            if not self._load_block(h, block_id):
                result = LoadResult(i, f"block {i} of the load was missing or corrupt in "
                                       f"every tier")
                break
        with self._lock:
            self._results[load_id] = result

    def _load_block(self, block_hash: bytes, block_id: int) -> bool:
        keys = self._keys(block_hash)
        for tier in self.tiers:
            payloads = [tier.get(k, n) for k, n in zip(keys, self.payload_bytes, strict=True)]
            if any(p is None for p in payloads):
                continue
            for caches, payload in zip(self.rank_caches, payloads, strict=True):
                rows = _rows(payload, caches)  # type: ignore[arg-type]
                for layer, cache in enumerate(caches):
                    cache[block_id].copy_(rows[layer])
            with self._lock:
                self.counts[f"{tier.medium}_hits"] += 1
                self.counts[f"{tier.medium}_load_bytes"] += sum(map(len, payloads))  # type: ignore[arg-type]
            return True
        with self._lock:
            self.counts["load_misses"] += 1
        return False

    def save(self, blocks: list[SavedBlock]) -> None:
        new = [b for b in blocks if b.lora_name is None and any(
            not t.contains(k) for t in self.tiers for k in self._keys(b.block_hash))]
        if not new:
            return
        per_block = sum(self.payload_bytes)
        with self._lock:  # as many as the queue has room for, before any copy
            room = max(0, MAX_QUEUED_BYTES - self._queued_bytes) // per_block
            if room < len(new):
                self.counts["save_dropped"] += len(new) - room
                new = new[:room]
            size = per_block * len(new)
            self._queued_bytes += size
        if not new:
            return
        ids = torch.tensor([b.block_id for b in new])
        # [block, layer, ...] per rank: each block's slice of every layer, contiguous.
        rows = [torch.stack([c.index_select(0, ids.to(c.device)) for c in caches], dim=1
                            ).cpu() for caches in self.rank_caches]
        self._saves.put(([b.block_hash for b in new], rows, size))

    def _save(self, item) -> None:
        hashes, rows, size = item
        try:
            for i, h in enumerate(hashes):
                for tier in self.tiers:
                    stored = 0
                    for key, r in zip(self._keys(h), rows, strict=True):
                        data = r[i].contiguous().view(torch.uint8).numpy().data
                        if tier.contains(key) or not tier.put(key, data):
                            continue
                        stored += 1
                        with self._lock:
                            self.counts[f"{tier.medium}_save_bytes"] += data.nbytes
                    if stored:
                        with self._lock:
                            self.counts[f"{tier.medium}_saves"] += 1
                        if self.events is not None:
                            self.events.stored(h, tier.medium)
                    self._evicted(tier)
        finally:
            with self._lock:
                self._queued_bytes -= size

    def _evicted(self, tier: BlockStore) -> None:
        """Blocks this process evicted from the tier: counted, and told to the routers."""
        for key in tier.evicted():
            namespace, hex_hash = key.split("/")
            if namespace != self.namespaces[0]:
                continue  # another rank's slice, or another layout's block
            with self._lock:
                self.counts[f"{tier.medium}_evictions"] += 1
            if self.events is not None:
                self.events.removed(bytes.fromhex(hex_hash), tier.medium)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every save queued so far is written (tests, benchmarks)."""
        done = threading.Event()
        self._saves.put(done)
        return done.wait(timeout_s)

    def _run(self, q: queue.Queue, work) -> None:
        sweeps = work == self._save  # the saver also sweeps, when idle or when due
        while True:
            try:
                item = q.get(timeout=SWEEP_S if sweeps else None)
            except queue.Empty:
                item = False  # nothing saved for a while
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                if item is not False:
                    work(item)
                if sweeps and time.monotonic() >= self._next_sweep:
                    self._sweep()
            except Exception:  # a tier's I/O error must not kill the thread
                log.exception("KV offload %s failed", work.__name__)
                if work == self._load and item:  # the load ends, failed as a whole
                    with self._lock:
                        self._results[item[0]] = LoadResult(0, "the tier load failed")

    def stats(self) -> dict[str, int]:
        """The counts, and each tier's rejected files by why ("<medium>_forged", ...)."""
        with self._lock:
            out = dict(self.counts)
        for tier in self.tiers:
            for why in REJECTED:
                if n := getattr(tier.stats, why):
                    out[f"{tier.medium}_{why}"] = n
        return out

    def close(self) -> None:
        for q in (self._loads, self._saves):
            q.put(None)


def _rows(payload: bytes, caches: list) -> torch.Tensor:
    """A block's file payload as `[layer, *block shape]` (bytes, as the caches' views)."""
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(len(caches), *caches[0].shape[1:])


def _hash(name: str) -> bytes | None:
    try:
        return bytes.fromhex(name)
    except ValueError:  # a file no worker of ours wrote
        return None
