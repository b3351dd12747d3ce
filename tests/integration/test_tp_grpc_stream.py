"""The gRPC stream between workers of different tensor-parallel sizes over real gRPC on
loopback: the decode worker's fetch (decode_worker/peers.py) asks the prefill worker's
ReadKvBlocks for each decode rank's heads, and every rank lands exactly its slice."""

from __future__ import annotations

import asyncio

import pytest

from baton.decode_worker.peers import Peers
from baton.kv_transfer.base import KVHandle, TransferState
from baton.kv_transfer.grpc_stream import GrpcStreamReceiver
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle, make_server, service_name
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc
from tests.tp_caches import assert_pulled, layout, slice_bytes, split, whole
from tests.unit.test_tp_transfer import (
    DEST_BLOCKS,
    LEASE,
    LOCAL,
    REMOTE,
    SOURCE_BLOCKS,
    _servicer,
    _wait,
)


@pytest.mark.parametrize("heads, prefill_tp, decode_tp", [(4, 2, 1), (2, 1, 4)])
def test_each_decode_rank_pulls_its_heads_over_grpc(heads, prefill_tp, decode_tp):
    src, dst = layout(heads, prefill_tp), layout(heads, decode_tp)
    source = whole(src, SOURCE_BLOCKS, seed=8)
    dest = split(dst, whole(dst, DEST_BLOCKS, seed=9))
    before = [[t.clone() for t in layers] for layers in dest]

    async def main():
        state = Lifecycle()

        def register(server):
            wk_grpc.add_WorkerServiceServicer_to_server(_servicer(src, split(src, source)),
                                                        server)
            return [service_name(wk, "WorkerService")]

        server = make_server(register, state)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        await state.set_serving(True)
        peers = Peers(Security(ServiceConfig()))
        peers.add("prefill-0", address)
        receiver = GrpcStreamReceiver(dst, dest, peers.fetch)
        try:
            receiver.add_peer("prefill-0", src, b"")
            handle = KVHandle("prefill-0", LEASE[0], LEASE[1], tuple(REMOTE), 0)
            receiver.start_load("t", handle, REMOTE, LOCAL)
            return await asyncio.to_thread(_wait, receiver, "t"), receiver.pulled_bytes
        finally:
            receiver.close()
            peers.close()
            await server.stop(0)

    result, pulled = asyncio.run(main())
    assert result == (TransferState.SUCCESS, None)
    assert_pulled(dst, dest, before, source, REMOTE, LOCAL)
    assert pulled == [slice_bytes(dst, r, len(REMOTE)) for r in range(decode_tp)]
