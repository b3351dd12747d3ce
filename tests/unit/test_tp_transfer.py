"""KV transfer between workers of different tensor-parallel sizes, over the fake connector
and over the gRPC stream through the prefill worker's real ReadKvBlocks servicer (called
in process, its request through the wire format): every decode rank gets exactly its
heads of the blocks asked for, from whichever prefill ranks hold them, nothing else
changes, and each rank counts exactly its slice of the bytes."""

from __future__ import annotations

import asyncio
import itertools
import time
from types import SimpleNamespace

import pytest

from baton.kv_transfer.base import KVHandle, TransferState
from baton.kv_transfer.blocks import read_blocks
from baton.kv_transfer.fake import FakeConnector
from baton.kv_transfer.grpc_stream import GrpcStreamReceiver
from baton.services.engine.outputs import ModelInfo
from baton.services.rpc.errors import InvalidArgument
from baton.services.rpc.server import Lifecycle
from baton.services.worker import worker_service
from baton.services.worker.worker_service import WorkerServicer
from baton.worker.v1 import worker_pb2 as wk
from tests.tp_caches import PAIRS, assert_pulled, layout, slice_bytes, split, whole

SOURCE_BLOCKS, DEST_BLOCKS = 11, 13
REMOTE, LOCAL = [7, 2, 5, 9, 1, 10, 3, 8, 4, 6], [12, 1, 4, 3, 9, 2, 11, 5, 6, 8]
LEASE = ("r", 1)
_ids = itertools.count()


def _servicer(lay, rank_caches) -> WorkerServicer:
    """The prefill worker's WorkerService over these caches, REMOTE held under LEASE."""
    engine = SimpleNamespace(rank_kv_caches=rank_caches, kv_layout=lay,
                             model_info=ModelInfo("m", "LlamaForCausalLM", 64, 100, (2,), 4,
                                                  "float32"))
    held = {LEASE: list(REMOTE)}
    aengine = SimpleNamespace(engine=engine, lease_blocks=lambda rid, lid: held.get((rid, lid)))
    return WorkerServicer(aengine, "prefill-0", "prefill", Lifecycle())


def _read(servicer: WorkerServicer, **fields) -> list[bytes]:
    req = wk.ReadKvBlocksRequest(request_id=LEASE[0], lease_id=LEASE[1], **fields)
    req = wk.ReadKvBlocksRequest.FromString(req.SerializeToString())  # as it arrives

    async def go():
        return [m.data async for m in servicer.ReadKvBlocks(req, None)]
    return asyncio.run(go())


def _grpc_fetch(servicer: WorkerServicer):
    def fetch(handle: KVHandle, block_ids: list[int], heads: range):
        yield from _read(servicer, block_ids=block_ids, head_start=heads.start,
                         head_count=len(heads))
    return fetch


def _wait(receiver, tid: str) -> tuple[TransferState, str | None]:
    deadline = time.monotonic() + 60
    while not (result := receiver.poll(tid))[0].done:
        assert time.monotonic() < deadline, "the pull never ended"
        time.sleep(0.001)
    return result


def _pair(transport: str, heads: int, prefill_tp: int, decode_tp: int, dtype: str):
    src_layout, dst_layout = layout(heads, prefill_tp, dtype), layout(heads, decode_tp, dtype)
    source = whole(src_layout, SOURCE_BLOCKS, seed=1)
    dest = split(dst_layout, whole(dst_layout, DEST_BLOCKS, seed=2))
    before = [[t.clone() for t in layers] for layers in dest]
    prefill_id = f"prefill-{next(_ids)}"
    if transport == "fake":
        sender = FakeConnector(prefill_id, src_layout, split(src_layout, source))
        receiver = FakeConnector(f"decode-{next(_ids)}", dst_layout, dest)
    else:
        sender = None
        receiver = GrpcStreamReceiver(dst_layout, dest,
                                      _grpc_fetch(_servicer(src_layout,
                                                            split(src_layout, source))))
    receiver.add_peer(prefill_id, src_layout, b"")
    return SimpleNamespace(sender=sender, receiver=receiver, source=source, dest=dest,
                           before=before, layout=dst_layout, prefill_id=prefill_id)


def _pulled(p):
    """`p` after one pull of REMOTE into LOCAL, which must succeed; its connectors closed."""
    try:
        handle = KVHandle(p.prefill_id, LEASE[0], LEASE[1], tuple(REMOTE), 0)
        p.receiver.start_load("t", handle, REMOTE, LOCAL)
        assert _wait(p.receiver, "t") == (TransferState.SUCCESS, None)
    finally:
        for c in (p.sender, p.receiver):
            if c is not None:
                c.close()
    return p


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
@pytest.mark.parametrize("heads, prefill_tp, decode_tp", PAIRS)
@pytest.mark.parametrize("transport", ["fake", "grpc"])
def test_each_decode_rank_gets_exactly_its_heads(transport, heads, prefill_tp, decode_tp,
                                                 dtype, monkeypatch):
    monkeypatch.setattr(worker_service, "READ_CHUNK_BLOCKS", 3)  # several messages
    p = _pulled(_pair(transport, heads, prefill_tp, decode_tp, dtype))
    assert_pulled(p.layout, p.dest, p.before, p.source, REMOTE, LOCAL)
    assert p.receiver.pulled_bytes == [slice_bytes(p.layout, r, len(REMOTE))
                                       for r in range(decode_tp)]


def test_read_kv_blocks_gathers_a_head_range_across_ranks_and_every_head_by_default():
    lay = layout(4, 2)
    source = whole(lay, SOURCE_BLOCKS, seed=3)
    servicer = _servicer(lay, split(lay, source))
    ids = REMOTE[:4]
    # A caller from before the fields: every head, the bytes of a one-rank worker.
    assert b"".join(_read(servicer, block_ids=ids)) == read_blocks(source, ids)
    # Heads 1..2 sit on both ranks: the bytes of a cache holding those heads alone.
    middle = [t[:, :, 1:3].contiguous() for t in source]
    assert b"".join(_read(servicer, block_ids=ids, head_start=1, head_count=2)) == \
        read_blocks(middle, ids)
    for start, count in ((3, 2), (-1, 1), (0, -1)):
        with pytest.raises(InvalidArgument, match="head_start, head_count"):
            _read(servicer, block_ids=ids, head_start=start, head_count=count)


@pytest.mark.parametrize("transport", ["fake", "grpc"])
def test_equal_sizes_of_one_rank_move_whole_blocks_as_before(transport):
    p = _pulled(_pair(transport, 4, 1, 1, "float32"))
    assert read_blocks(p.dest[0], LOCAL) == read_blocks(p.source, REMOTE)
    assert p.receiver.pulled_bytes == [len(REMOTE) * p.layout.block_bytes]
