"""KV connector over NIXL: the receiver READs a peer's blocks straight out of its KV tensors.

Each layer tensor is block-major (kernels/kv_layout.py): block b of a layer is one
contiguous range of `layout.layer_block_bytes` (K of every KV head, then V), at offset
`b * layer_block_bytes`. Both sides describe every (layer, block) range in one prepped
descriptor list, layer-major:

    index(l, b) = l * num_blocks + b

so block b is the indices `l * num_blocks + b` for every layer l: one descriptor per
layer. A pull pairs remote block r[i] with local block d[i] layer by layer; each side uses
its own num_blocks, which is all two compatible peers may differ in.
"""

from __future__ import annotations

import base64
import json
import threading

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
    IncompatibleLayout,
    KVHandle,
    KVLayout,
    KVReceiver,
    KVSender,
    TransferState,
    check_caches,
)

_METADATA_VERSION = 1


def _block_table(base_addrs: list[int], num_blocks: int, layout: KVLayout,
                 device_id: int) -> np.ndarray:
    """(address, length, device) for every (layer, block), in the index order above
    (N x 3). A block's start is kv_layout's offset of its first element."""
    size = layout.layer_block_bytes
    starts = kv_layout.offset(np.arange(num_blocks, dtype=np.uint64), kv_layout.K, 0, 0,
                              kv_heads=layout.num_kv_heads, block_size=layout.block_size,
                              head_dim=layout.head_dim) * np.uint64(layout.element_size)
    addrs = np.asarray(base_addrs, dtype=np.uint64)[:, None] + starts[None, :]
    table = np.empty((addrs.size, 3), dtype=np.uint64)
    table[:, 0] = addrs.ravel()
    table[:, 1] = size
    table[:, 2] = device_id
    return table


def _block_indices(block_ids: list[int], num_blocks: int, num_layers: int) -> np.ndarray:
    """Descriptor indices of the given blocks in every layer: layer-major, then block order."""
    layers = np.arange(num_layers, dtype=np.int64)[:, None] * num_blocks
    return (layers + np.asarray(block_ids, dtype=np.int64)[None, :]).ravel().astype(np.int32)


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


class NixlConnector(KVSender, KVReceiver):
    """One NIXL agent (named engine_id, UCX backend) that both exposes and pulls blocks."""

    def __init__(self, engine_id: str, layout: KVLayout, kv_caches: list[torch.Tensor]):
        self.engine_id = engine_id
        self.layout = layout
        self.num_blocks = check_caches(layout, kv_caches)
        device = kv_caches[0].device
        if any(t.device != device for t in kv_caches):
            raise ValueError("every layer tensor must be on the same device")
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        self.device_id = device.index or 0  # None on CPU
        self._caches = kv_caches  # keep the memory alive while registered
        self._base_addrs = [t.data_ptr() for t in kv_caches]
        layer_bytes = kv_caches[0].numel() * kv_caches[0].element_size()

        self._lock = threading.Lock()
        # engine id -> name, metadata, prepared dlist, its number of blocks
        self._peers: dict[str, tuple[str, bytes, nixl_prepped_dlist_handle, int]] = {}
        self._active: dict[str, tuple[nixl_xfer_handle, str]] = {}  # transfer id -> (xfer, peer)
        self._finished: dict[str, tuple[TransferState, str | None]] = {}  # never posted
        self._closed = False

        self.agent = _make_agent(engine_id)
        regions = [(addr, layer_bytes, self.device_id, "") for addr in self._base_addrs]
        self._reg = self.agent.register_memory(regions, self.mem_type)
        table = _block_table(self._base_addrs, self.num_blocks, layout, self.device_id)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, self.mem_type)

    # -- sender --------------------------------------------------------------------------

    def metadata(self) -> bytes:
        return json.dumps({
            "version": _METADATA_VERSION,
            "engine_id": self.engine_id,
            "fingerprint": self.layout.fingerprint,
            "agent": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "base_addrs": self._base_addrs,
            "num_blocks": self.num_blocks,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
        }).encode()

    # -- receiver ------------------------------------------------------------------------

    def add_peer(self, engine_id: str, layout: KVLayout, metadata: bytes) -> None:
        self.layout.check_compatible(layout)
        md = json.loads(metadata)
        if md.get("version") != _METADATA_VERSION:
            raise ValueError(f"peer {engine_id}: unknown metadata version {md.get('version')}")
        if md["engine_id"] != engine_id:
            raise ValueError(f"metadata of {md['engine_id']!r} given for peer {engine_id!r}")
        if md["fingerprint"] != layout.fingerprint:
            raise IncompatibleLayout(f"peer {engine_id}: metadata is for another KV layout")
        if len(md["base_addrs"]) != layout.num_layers:
            raise ValueError(f"peer {engine_id}: {len(md['base_addrs'])} layers in metadata")
        with self._lock:
            if self._closed:
                raise RuntimeError("connector is closed")
            old = self._peers.get(engine_id)
            if old is not None and old[1] == metadata:
                return  # same peer, same memory: nothing to do
            if old is not None:  # the peer restarted: drop what pointed at its old memory
                self._drop_peer(engine_id, "peer re-registered with new metadata")
            try:  # UCX connects here: a dead peer is refused at once
                name = self.agent.add_remote_agent(base64.b64decode(md["agent"]))
            except Exception as e:
                raise ConnectionError(f"peer {engine_id}: NIXL could not add it: {e!r}") from e
            if isinstance(name, bytes):
                name = name.decode()
            try:
                table = _block_table(md["base_addrs"], md["num_blocks"], layout,
                                     md["device_id"])
                dlist = self.agent.prep_xfer_dlist(name, table, md["mem_type"])
            except Exception as e:
                self.agent.remove_remote_agent(name)
                raise ConnectionError(f"peer {engine_id}: NIXL rejected its memory: {e!r}") from e
            self._peers[engine_id] = (name, metadata, dlist, md["num_blocks"])

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
            name, _, remote, remote_n = self._peers[engine_id]
            xfer = None
            try:
                layers = self.layout.num_layers
                local_idx = _block_indices(local_block_ids, self.num_blocks, layers)
                remote_idx = _block_indices(remote_block_ids, remote_n, layers)
                xfer = self.agent.make_prepped_xfer("READ", self._local, local_idx,
                                                    remote, remote_idx)
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
                self._active[transfer_id] = (xfer, engine_id)

    def poll(self, transfer_id: str) -> tuple[TransferState, str | None]:
        with self._lock:
            if transfer_id in self._finished:
                return self._finished.pop(transfer_id)
            if transfer_id not in self._active:
                return TransferState.FAILED, f"unknown transfer {transfer_id}"
            handle, peer = self._active[transfer_id]
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
        remote_n = self._peers[engine_id][3]
        if bad := _bad_ids(remote_ids, remote_n):
            return f"remote block ids {bad} out of range [0, {remote_n})"
        if bad := _bad_ids(local_ids, self.num_blocks):
            return f"local block ids {bad} out of range [0, {self.num_blocks})"
        if len(set(local_ids)) != len(local_ids):
            return f"duplicate local block ids in {local_ids}"
        return None

    def _drop_peer(self, engine_id: str, reason: str) -> None:
        """Fail the peer's transfers, release its descriptors, forget its agent."""
        name, _, dlist, _ = self._peers.pop(engine_id)
        for tid, (handle, peer) in list(self._active.items()):
            if peer == engine_id:
                del self._active[tid]
                self._release(handle)
                self._finished[tid] = (TransferState.FAILED, reason)
        self._release(dlist)
        try:
            self.agent.remove_remote_agent(name)
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
