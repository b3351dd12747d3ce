"""NixlConnector between two real processes: NIXL over UCX, DRAM to DRAM on one host.

The tensors live on BATON_TEST_KV_DEVICE (default cpu; "cuda" registers VRAM, as the GPU
check runs it). A spawned sender process owns random KV tensors and hands its metadata
and the raw bytes of its tensors back over a pipe; the receiver (this process) has a
different block count, pulls scattered blocks into other block ids, and must get exactly
the sender's bytes there and nothing anywhere else.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import threading
import time
import tracemalloc
import uuid
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("nixl_cu12")

from baton.kernels import kv_layout  # noqa: E402
from baton.kv_transfer.base import (  # noqa: E402
    IncompatibleLayout,
    KVHandle,
    KVLayout,
    TransferState,
)
from baton.kv_transfer.nixl_connector import NixlConnector  # noqa: E402

SENDER_BLOCKS = 9
RECEIVER_BLOCKS = 13
REMOTE_IDS = [7, 2, 5]  # unordered, not contiguous
LOCAL_IDS = [1, 12, 4]
TIMEOUT_S = 10.0
DEVICE = os.environ.get("BATON_TEST_KV_DEVICE", "cpu")



def _handle(engine_id: str) -> KVHandle:
    return KVHandle(engine_id, "r", 1, (), 0)

def _layout(dtype: str = "bfloat16", block_size: int = 16) -> KVLayout:
    return KVLayout(model="test-model", dtype=dtype, block_size=block_size, num_layers=3,
                    num_kv_heads=2, head_dim=8)


def _caches(layout: KVLayout, num_blocks: int, random: bool) -> list[torch.Tensor]:
    shape = kv_layout.shape(num_blocks, layout.num_kv_heads, layout.block_size, layout.head_dim)
    dtype = getattr(torch, layout.dtype)
    if random:
        return [torch.randn(shape).to(dtype).to(DEVICE) for _ in range(layout.num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(layout.num_layers)]


def _raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes, shaped [num_blocks, -1]: block b is [b] (kernels/kv_layout.py)."""
    return t.cpu().view(torch.uint8).reshape(kv_layout.num_blocks(t), -1).numpy()


def _sender_main(conn, engine_id: str, layout: KVLayout, num_blocks: int, seed: int) -> None:
    torch.manual_seed(seed)
    caches = _caches(layout, num_blocks, random=True)
    connector = NixlConnector(engine_id, layout, [caches])
    conn.send((connector.metadata(), [_raw(t).copy() for t in caches]))
    with contextlib.suppress(EOFError):
        conn.recv()  # "exit", or EOF when the test process goes away
    connector.close()


@dataclass
class Peer:
    engine_id: str
    layout: KVLayout
    metadata: bytes
    layers: list[np.ndarray]  # the sender's tensors as raw bytes
    proc: multiprocessing.process.BaseProcess


@contextlib.contextmanager
def piped(target, *args):
    """A spawned process running `target(conn, *args)`: yields (our end of its pipe, the
    process); at the end it is told "exit" (its pipe's EOF if it cannot be), then killed
    if it lingers."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, daemon=True, args=(child, *args))
    proc.start()
    child.close()
    try:
        yield parent, proc
    finally:
        with contextlib.suppress(OSError):
            parent.send("exit")
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()


@contextlib.contextmanager
def spawned(target, *args):
    """`piped`, yielding (the process's first message, the process)."""
    with piped(target, *args) as (parent, proc):
        assert parent.poll(60), "the sender process did not come up"
        yield parent.recv(), proc


@contextlib.contextmanager
def _sender(layout: KVLayout):
    engine_id = f"sender-{uuid.uuid4().hex[:8]}"
    with spawned(_sender_main, engine_id, layout, SENDER_BLOCKS, 1234) as (first, proc):
        metadata, layers = first
        yield Peer(engine_id, layout, metadata, layers, proc)


@pytest.fixture(scope="module", params=["bfloat16", "float32", "float8_e4m3fn"])
def peer(request):
    with _sender(_layout(request.param)) as p:
        yield p


@contextlib.contextmanager
def _receiver(layout: KVLayout):
    caches = _caches(layout, RECEIVER_BLOCKS, random=False)
    connector = NixlConnector(f"receiver-{uuid.uuid4().hex[:8]}", layout, [caches])
    try:
        yield connector, caches
    finally:
        _within(TIMEOUT_S, connector.close)


def _wait(connector: NixlConnector, transfer_id: str) -> tuple[TransferState, str | None]:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        state, reason = connector.poll(transfer_id)
        if state is not TransferState.TRANSFERRING:
            return state, reason
        time.sleep(0.001)
    pytest.fail(f"transfer {transfer_id} still TRANSFERRING after {TIMEOUT_S} s")


def _assert_pulled(caches: list[torch.Tensor], peer: Peer, remote: list[int],
                   local: list[int]) -> None:
    """Local block local[i] holds exactly the peer's block remote[i]; every other is zero."""
    for layer, (t, sent) in enumerate(zip(caches, peer.layers, strict=True)):
        got = _raw(t)
        for r, d in zip(remote, local, strict=True):
            assert np.array_equal(got[d], sent[r]), f"layer {layer} block {d}"
        others = [b for b in range(RECEIVER_BLOCKS) if b not in local]
        assert not got[others].any(), f"layer {layer}: a block outside {local} changed"


def test_pull_scattered_blocks(peer):
    with _receiver(peer.layout) as (receiver, caches):
        receiver.add_peer(peer.engine_id, peer.layout, peer.metadata)
        receiver.start_load("t1", _handle(peer.engine_id), REMOTE_IDS, LOCAL_IDS)
        assert _wait(receiver, "t1") == (TransferState.SUCCESS, None)
        _assert_pulled(caches, peer, REMOTE_IDS, LOCAL_IDS)
        # a finished transfer is forgotten
        state, reason = receiver.poll("t1")
        assert state is TransferState.FAILED and "unknown transfer" in reason

        # re-adding the same peer is harmless; the id can be reused once forgotten
        receiver.add_peer(peer.engine_id, peer.layout, peer.metadata)
        receiver.start_load("t1", _handle(peer.engine_id), [0, 8], [0, 11])
        assert _wait(receiver, "t1") == (TransferState.SUCCESS, None)
        _assert_pulled(caches, peer, REMOTE_IDS + [0, 8], LOCAL_IDS + [0, 11])


def test_incompatible_layout_is_refused(peer):
    other = _layout(peer.layout.dtype, block_size=32)
    with _receiver(other) as (receiver, _):
        with pytest.raises(IncompatibleLayout, match="block_size"):
            receiver.add_peer(peer.engine_id, peer.layout, peer.metadata)
        receiver.start_load("t", _handle(peer.engine_id), [0], [0])
        state, reason = receiver.poll("t")
        assert state is TransferState.FAILED and "unknown peer" in reason


def test_a_peer_stating_a_huge_pool_is_refused_before_anything_is_built():
    """Its num_blocks would size our descriptor tables (2**40 blocks: terabytes): refused,
    named, before NIXL or numpy sees it; the peer is not added."""
    layout = _layout()
    with _receiver(layout) as (receiver, _):
        md = dict(json.loads(receiver.metadata()), engine_id="peer-x", num_blocks=2**40)
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match="num_blocks 1099511627776 not in"):
                receiver.add_peer("peer-x", layout, json.dumps(md).encode())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, peak
        receiver.start_load("t", _handle("peer-x"), [0], [0])
        assert receiver.poll("t") == (TransferState.FAILED, "unknown peer peer-x")


@pytest.mark.parametrize("remote, local, why", [
    ([SENDER_BLOCKS], [0], "remote block ids [9] out of range"),
    ([0, -1], [0, 1], "remote block ids [-1] out of range"),
    ([0], [RECEIVER_BLOCKS], "local block ids [13] out of range"),
    ([0, 1], [0], "2 remote blocks but 1 local"),
    ([0, 1], [3, 3], "duplicate local block ids"),
])
def test_bad_block_ids_fail_with_a_reason(peer, remote, local, why):
    with _receiver(peer.layout) as (receiver, caches):
        receiver.add_peer(peer.engine_id, peer.layout, peer.metadata)
        receiver.start_load("bad", _handle(peer.engine_id), remote, local)
        state, reason = _wait(receiver, "bad")
        assert state is TransferState.FAILED and why in reason
        assert not any(t.any() for t in caches), "a failed transfer wrote something"
        receiver.start_load("unknown-peer", _handle("nobody"), [0], [0])
        assert receiver.poll("unknown-peer") == (TransferState.FAILED, "unknown peer nobody")


def _within(seconds: float, fn):
    """Run fn in a thread; fail the test if it has not returned after `seconds`."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"hung for more than {seconds} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_dead_peer_fails_fast():
    with _sender(_layout()) as peer, _receiver(peer.layout) as (receiver, caches):
        receiver.add_peer(peer.engine_id, peer.layout, peer.metadata)
        receiver.start_load("warm", _handle(peer.engine_id), [1], [0])
        assert _wait(receiver, "warm") == (TransferState.SUCCESS, None)

        peer.proc.kill()
        peer.proc.join()

        def pull_from_dead_peer():
            receiver.start_load("dead", _handle(peer.engine_id), REMOTE_IDS, LOCAL_IDS)
            return _wait(receiver, "dead")

        # NIXL sees the UCX endpoint fail and refuses to post: FAILED at once
        state, reason = _within(TIMEOUT_S, pull_from_dead_peer)
        assert state is TransferState.FAILED and "DISCONNECT" in reason
        assert not any(t[LOCAL_IDS].any() for t in caches)

        # a connector that never met the peer cannot add it: UCX is refused at once
        with _receiver(peer.layout) as (late, _):
            with pytest.raises(ConnectionError, match=peer.engine_id):
                _within(TIMEOUT_S, lambda: late.add_peer(peer.engine_id, peer.layout,
                                                         peer.metadata))


def _threads() -> dict[str, float]:
    """This process's threads: id -> CPU seconds used so far."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # ended meanwhile
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def test_idle_connector_does_not_burn_a_core():
    """NIXL's progress thread must sleep between polls: a worker that waits costs nothing.
    Only the threads the connector started are counted (not those other tests of this
    process left behind); a busy machine can only make a spinning thread look idler."""
    layout = KVLayout(model="m", dtype="float32", block_size=16, num_layers=2, num_kv_heads=2,
                      head_dim=8)
    caches = [torch.zeros(kv_layout.shape(4, 2, 16, 8)) for _ in range(2)]
    before = set(_threads())
    connector = NixlConnector(f"idle-{uuid.uuid4().hex[:8]}", layout, [caches])
    try:
        t0, c0 = time.monotonic(), _threads()
        time.sleep(1.0)  # its threads' chance to spin
        c1 = _threads()
        used = sum(c1[t] - c0.get(t, 0.0) for t in c1 if t not in before)
        busy = used / (time.monotonic() - t0)
    finally:
        connector.close()
    assert busy < 0.3, f"an idle connector used {busy:.0%} of a core"
