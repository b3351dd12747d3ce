"""KV connector over NIXL: the receiver READs a peer's blocks straight out of its KV tensors.

Each layer tensor is block-major (kernels/kv_layout.py): block b of a layer is one
contiguous range of `layout.layer_block_bytes` (K of every KV head, then V), at offset
`b * layer_block_bytes`. Under tensor parallelism every rank has its own layer tensors,
holding its heads (kv_layout.rank_heads); all are registered, and the metadata carries
every rank's base addresses. Both sides describe every (rank, layer, block) range in one
prepped descriptor list:

    index(r, l, b) = (r * num_layers + l) * num_blocks + b

A pull between peers of one TP size pairs remote block r[i] with local block d[i], rank
by rank and layer by layer; each side uses its own num_blocks, which is all two such
peers may differ in.

Between TP sizes a local rank's heads come from one or more peer ranks (head_map.py's
runs). Inside a block the K heads are contiguous, then the V heads, so a run is two
ranges per (layer, block): its K heads and its V heads. At add_peer both sides get a
descriptor list of those ranges, the peer's and ours in the same order,

    index(run, l, b, kv) = ((run * num_layers + l) * num_blocks + b) * 2 + kv

and a pull takes, for every run, layer and block, the K and the V range.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
from nixl_cu12 import (
    nixl_agent,
    nixl_agent_config,
    nixl_prepped_dlist_handle,
    nixl_xfer_handle,
)

import baton.kernels.kv_layout as kv_layout

from .base import (
    KVHandle,
    KVLayout,
    KVReceiver,
    KVSender,
    TransferState,
    check_caches,
)
from .head_map import HeadRun, head_runs, rank_block_bytes
from .nixl_metadata import PeerMemory, encode, read


def _rank_heads(layout: KVLayout, rank: int) -> int:
    return len(kv_layout.rank_heads(layout.num_kv_heads, layout.tp_size, rank))


def _table(addrs: np.ndarray, length: int, device_id: int) -> np.ndarray:
    table = np.empty((addrs.size, 3), dtype=np.uint64)
    table[:, 0], table[:, 1], table[:, 2] = addrs.ravel(), length, device_id
    return table


def _block_table(base_addrs: list[list[int]], num_blocks: int, layout: KVLayout,
                 device_ids: list[int]) -> np.ndarray:
    """(address, length, device) for every (rank, layer, block), in the index order above
    (N x 3). A block's start is kv_layout's offset of its first element."""
    tables = []
    for rank, (bases, device) in enumerate(zip(base_addrs, device_ids, strict=True)):
        heads = _rank_heads(layout, rank)
        starts = kv_layout.offset(np.arange(num_blocks, dtype=np.uint64), kv_layout.K, 0, 0,
                                  kv_heads=heads, block_size=layout.block_size,
                                  head_dim=layout.head_dim) * np.uint64(layout.element_size)
        addrs = np.asarray(bases, dtype=np.uint64)[:, None] + starts[None, :]
        size = kv_layout.block_elements(heads, layout.block_size, layout.head_dim)
        tables.append(_table(addrs, size * layout.element_size, device))
    return np.concatenate(tables)


def _run_table(base_addrs: list[list[int]], num_blocks: int, layout: KVLayout,
               device_ids: list[int], runs: list[tuple[int, int, int]]) -> np.ndarray:
    """(address, length, device) of every (run, layer, block, K|V) range, in the index
    order above; a run here is (this side's rank, its first head there, count)."""
    blocks = np.arange(num_blocks, dtype=np.uint64)[:, None]
    kv = np.array([kv_layout.K, kv_layout.V], dtype=np.uint64)[None, :]
    head_bytes = layout.block_size * layout.head_dim * layout.element_size
    tables = []
    for rank, head, count in runs:
        # [block, K|V] element offsets of the run's first head, in rank `rank`'s tensors
        starts = kv_layout.offset(blocks, kv, np.uint64(head), 0,
                                  kv_heads=_rank_heads(layout, rank),
                                  block_size=layout.block_size, head_dim=layout.head_dim)
        starts = starts.ravel() * np.uint64(layout.element_size)
        addrs = np.asarray(base_addrs[rank], dtype=np.uint64)[:, None] + starts[None, :]
        tables.append(_table(addrs, count * head_bytes, device_ids[rank]))
    return np.concatenate(tables)


def _block_indices(block_ids: list[int], num_blocks: int, groups: int,
                   per_block: int = 1) -> np.ndarray:
    """Descriptor indices of the given blocks in every group (a rank's layer, or a run's),
    group-major, then block order, then each block's `per_block` ranges (K, V)."""
    starts = np.arange(groups, dtype=np.int64)[:, None] * num_blocks
    blocks = (starts + np.asarray(block_ids, dtype=np.int64)[None, :]).ravel()
    ranges = np.arange(per_block, dtype=np.int64)[None, :]
    return (blocks[:, None] * per_block + ranges).ravel().astype(np.int32)


def _bad_ids(ids: list[int], num_blocks: int) -> list[int]:
    return [b for b in ids if not isinstance(b, (int, np.integer)) or not 0 <= b < num_blocks]


PROGRESS_DELAY_US = 100
_agent_lock = threading.Lock()


def _make_agent(name: str):
    """A UCX agent whose progress thread sleeps PROGRESS_DELAY_US between polls.

    The peer's progress thread must answer our READs, so it cannot be turned off; but
    nixl_agent hard-codes a delay of 0, and a thread that never sleeps costs a whole core
    per worker (seen: 100% of a core each, idle). The Python wrapper exposes no setting,
    so the config object is adjusted on its way to the binding's constructor.
    """
    from nixl_cu12 import _api

    real = _api.nixlBind

    class _Binding:
        def __getattr__(self, attr):
            return getattr(real, attr)

        @staticmethod
        def nixlAgent(agent_name, config):
            config.pthrDelay = PROGRESS_DELAY_US
            return real.nixlAgent(agent_name, config)

    with _agent_lock:
        _api.nixlBind = _Binding()
        try:
            return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        finally:
            _api.nixlBind = real


@dataclass
class _Peer:
    name: str  # its NIXL agent
    metadata: bytes
    remote: nixl_prepped_dlist_handle  # its ranges
    local: nixl_prepped_dlist_handle | None  # ours, paired with its (None: self._local)
    num_blocks: int
    groups: int  # (rank, layer) pairs, or (run, layer) pairs between TP sizes
    per_block: int  # ranges per block in a group: 1, or 2 (K, V) between TP sizes


class NixlConnector(KVSender, KVReceiver):
    """One NIXL agent (named engine_id, UCX backend) that both exposes and pulls blocks,
    over every tensor-parallel rank's caches (`[rank][layer]`)."""

    def __init__(self, engine_id: str, layout: KVLayout,
                 rank_caches: list[list[torch.Tensor]]):
        self.engine_id = engine_id
        self.layout = layout
        self.num_blocks = check_caches(layout, rank_caches)
        kinds = {t.device.type for caches in rank_caches for t in caches}
        if len(kinds) != 1 or any(len({t.device for t in c}) != 1 for c in rank_caches):
            raise ValueError("a rank's layer tensors must be on one device, every rank's "
                             "of one kind")
        self.mem_type = "VRAM" if kinds == {"cuda"} else "DRAM"
        self.device_ids = [c[0].device.index or 0 for c in rank_caches]  # None on CPU
        self._caches = rank_caches  # keep the memory alive while registered
        self._base_addrs = [[t.data_ptr() for t in caches] for caches in rank_caches]
        # Bytes pulled per local rank, over every load that succeeded.
        self.pulled_bytes = [0] * layout.tp_size

        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        # transfer id -> (xfer, peer, bytes per local rank)
        self._active: dict[str, tuple[nixl_xfer_handle, str, list[int]]] = {}
        self._finished: dict[str, tuple[TransferState, str | None]] = {}  # never posted
        self._closed = False

        self.agent = _make_agent(engine_id)
        regions = [(addr, t.numel() * t.element_size(), device, "")
                   for caches, bases, device in zip(rank_caches, self._base_addrs,
                                                    self.device_ids, strict=True)
                   for t, addr in zip(caches, bases, strict=True)]
        self._reg = self.agent.register_memory(regions, self.mem_type)
        table = _block_table(self._base_addrs, self.num_blocks, layout, self.device_ids)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, self.mem_type)

    # -- sender --------------------------------------------------------------------------

    def metadata(self) -> bytes:
        return encode(self.engine_id, self.layout, PeerMemory(
            self.agent.get_agent_metadata(), self._base_addrs, self.num_blocks,
            self.mem_type, self.device_ids))

    # -- receiver ------------------------------------------------------------------------

    def add_peer(self, engine_id: str, layout: KVLayout, metadata: bytes) -> None:
        runs = head_runs(self.layout, layout)  # IncompatibleLayout unless the heads map
        same = layout.tp_size == self.layout.tp_size  # whole blocks, else K and V per run
        per_block = (self.layout.tp_size if same else 2 * len(runs)) * layout.num_layers
        md = read(engine_id, layout, metadata, per_block)  # every count bounded
        with self._lock:
            if self._closed:
                raise RuntimeError("connector is closed")
            old = self._peers.get(engine_id)
            if old is not None and old.metadata == metadata:
                return  # same peer, same memory: nothing to do
            if old is not None:  # the peer restarted: drop what pointed at its old memory
                self._drop_peer(engine_id, "peer re-registered with new metadata")
            try:  # UCX connects here: a dead peer is refused at once
                name = self.agent.add_remote_agent(md.agent)
            except Exception as e:
                raise ConnectionError(f"peer {engine_id}: NIXL could not add it: {e!r}") from e
            if isinstance(name, bytes):
                name = name.decode()
            try:
                self._peers[engine_id] = self._prepare(name, metadata, md, layout, runs)
            except Exception as e:
                self.agent.remove_remote_agent(name)
                raise ConnectionError(f"peer {engine_id}: NIXL rejected its memory: {e!r}") from e

    def _prepare(self, name: str, metadata: bytes, md: PeerMemory, layout: KVLayout,
                 runs: list[HeadRun]) -> _Peer:
        """The peer's descriptors, and ours to pair with them where TP sizes differ."""
        n = md.num_blocks
        if layout.tp_size == self.layout.tp_size:  # rank r from rank r, whole blocks
            table = _block_table(md.base_addrs, n, layout, md.device_ids)
            remote = self.agent.prep_xfer_dlist(name, table, md.mem_type)
            return _Peer(name, metadata, remote, None, n,
                         self.layout.tp_size * self.layout.num_layers, 1)
        table = _run_table(md.base_addrs, n, layout, md.device_ids,
                           [(r.remote_rank, r.remote_head, r.count) for r in runs])
        remote = self.agent.prep_xfer_dlist(name, table, md.mem_type)
        try:
            table = _run_table(self._base_addrs, self.num_blocks, self.layout,
                               self.device_ids,
                               [(r.local_rank, r.local_head, r.count) for r in runs])
            local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, self.mem_type)
        except Exception:
            self._release(remote)
            raise
        return _Peer(name, metadata, remote, local, n, len(runs) * self.layout.num_layers, 2)

    def start_load(self, transfer_id: str, handle: KVHandle, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        engine_id = handle.engine_id
        with self._lock:
            if transfer_id in self._active or transfer_id in self._finished:
                raise ValueError(f"transfer {transfer_id} is already in flight")
            error = self._check_load(engine_id, remote_block_ids, local_block_ids)
            if error is not None:
                self._finished[transfer_id] = (TransferState.FAILED, error)
                return
            if not local_block_ids:
                self._finished[transfer_id] = (TransferState.SUCCESS, None)
                return
            peer = self._peers[engine_id]
            xfer = None
            try:
                local_idx = _block_indices(local_block_ids, self.num_blocks, peer.groups,
                                           peer.per_block)
                remote_idx = _block_indices(remote_block_ids, peer.num_blocks, peer.groups,
                                            peer.per_block)
                local = self._local if peer.local is None else peer.local
                xfer = self.agent.make_prepped_xfer("READ", local, local_idx,
                                                    peer.remote, remote_idx)
                state = self.agent.transfer(xfer)
            except Exception as e:  # a dead peer or bad descriptors surface here
                self._release(xfer)
                self._finished[transfer_id] = (TransferState.FAILED,
                                               f"NIXL could not post the read: {e}")
                return
            if state == "ERR":
                self._release(xfer)
                self._finished[transfer_id] = (TransferState.FAILED,
                                               f"NIXL failed to post the read from {engine_id}")
            else:  # DONE or PROC: poll reports it
                size = [len(local_block_ids) * rank_block_bytes(self.layout, r)
                        for r in range(self.layout.tp_size)]
                self._active[transfer_id] = (xfer, engine_id, size)

    def poll(self, transfer_id: str) -> tuple[TransferState, str | None]:
        with self._lock:
            if transfer_id in self._finished:
                return self._finished.pop(transfer_id)
            if transfer_id not in self._active:
                return TransferState.FAILED, f"unknown transfer {transfer_id}"
            handle, peer, size = self._active[transfer_id]
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception as e:
                state, reason = "ERR", f"NIXL error reading from {peer}: {e}"
            else:
                reason = f"NIXL transfer from {peer} failed"
            if state == "PROC":
                return TransferState.TRANSFERRING, None
            del self._active[transfer_id]
            self._release(handle)
            if state == "DONE":
                self.pulled_bytes = [a + b for a, b in zip(self.pulled_bytes, size,
                                                           strict=True)]
                return TransferState.SUCCESS, None
            return TransferState.FAILED, reason

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for engine_id in list(self._peers):
                self._drop_peer(engine_id, "connector closed")
            self._finished.clear()
            self._release(self._local)
            try:
                self.agent.deregister_memory(self._reg)
            except Exception:
                pass

    # -- helpers (called with the lock held) -------------------------------------------------

    def _check_load(self, engine_id: str, remote_ids: list[int],
                    local_ids: list[int]) -> str | None:
        if self._closed:
            return "connector is closed"
        if engine_id not in self._peers:
            return f"unknown peer {engine_id}"
        if len(remote_ids) != len(local_ids):
            return f"{len(remote_ids)} remote blocks but {len(local_ids)} local blocks"
        remote_n = self._peers[engine_id].num_blocks
        if bad := _bad_ids(remote_ids, remote_n):
            return f"remote block ids {bad} out of range [0, {remote_n})"
        if bad := _bad_ids(local_ids, self.num_blocks):
            return f"local block ids {bad} out of range [0, {self.num_blocks})"
        if len(set(local_ids)) != len(local_ids):
            return f"duplicate local block ids in {local_ids}"
        return None

    def _drop_peer(self, engine_id: str, reason: str) -> None:
        """Fail the peer's transfers, release its descriptors, forget its agent."""
        peer_entry = self._peers.pop(engine_id)
        for tid, (handle, peer, _) in list(self._active.items()):
            if peer == engine_id:
                del self._active[tid]
                self._release(handle)
                self._finished[tid] = (TransferState.FAILED, reason)
        self._release(peer_entry.remote)
        self._release(peer_entry.local)
        try:
            self.agent.remove_remote_agent(peer_entry.name)
        except Exception:
            pass

    @staticmethod
    def _release(handle) -> None:
        """Release an xfer or dlist handle; NIXL raises if it cannot cancel a live read,
        and then keeps it in its leak list to retry when the agent goes away."""
        if handle is None:
            return
        try:
            handle.release()
        except Exception:
            pass
