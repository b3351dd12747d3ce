"""The handshake refuses a peer whose KV cache is laid out otherwise (kernels/kv_layout.py's
NAME, a field of KVLayout), naming the field, over real gRPC on loopback and without a
model: in both directions, and for a peer from before the field, which sends none."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from baton.decode_worker.peers import Peers
from baton.decode_worker.server import DecodeServicer
from baton.kernels import kv_layout
from baton.kv_transfer.base import KVLayout, KVReceiver, TransferState
from baton.prefill_worker.server import PrefillServicer
from baton.services.rpc.cluster import ClusterToken
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.errors import FailedPrecondition
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle, make_server, service_name
from baton.services.worker.messages import layout_message
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc

OURS = KVLayout("toy", "float32", 16, 2, 2, 8)
OTHER = replace(OURS, cache_layout="head-major/v0")


class Transport(KVReceiver):
    """Records the peers it was given; never loads."""

    def __init__(self):
        self.peers: list[str] = []

    def add_peer(self, engine_id, layout, metadata):
        self.peers.append(engine_id)

    def start_load(self, transfer_id, handle, remote_block_ids, local_block_ids):
        pass

    def poll(self, transfer_id):
        return TransferState.SUCCESS, None


class Answers(wk_grpc.PrefillServiceServicer):
    """A prefill worker that checks nothing and answers with `layout` (a message)."""

    def __init__(self, layout: wk.KvLayout):
        self.layout = layout

    async def Handshake(self, request, context):
        return wk.HandshakeResponse(engine_id="prefill-1", layout=self.layout,
                                    transport="fake")


def _aengine(layout: KVLayout):
    config = SimpleNamespace(kv_lease_timeout_s=30.0)
    return SimpleNamespace(engine=SimpleNamespace(kv_layout=layout, config=config,
                                                  sampling_defaults=None),
                           release_lease=lambda rid, lease: pytest.fail("released"))


def _connect(ours: KVLayout, prefill) -> list[str]:
    """A decode worker of layout `ours` shakes hands with `prefill`: its transport's peers
    after, or the error."""
    def register(server):
        wk_grpc.add_PrefillServiceServicer_to_server(prefill, server)
        return [service_name(wk, "PrefillService")]

    async def go():
        state = Lifecycle()
        server = make_server(register, state)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        await state.set_serving(True)
        transport = Transport()
        decode = DecodeServicer(_aengine(ours), "decode-1", "fake",
                                Peers(Security(ServiceConfig())), transport)
        try:
            await decode._connect(address)
            return transport.peers
        finally:
            decode.peers.close()
            await server.stop(0)

    return asyncio.run(go())


def _prefill(layout: KVLayout) -> PrefillServicer:
    return PrefillServicer(_aengine(layout), "prefill-1", "fake", b"", None, ClusterToken(None))


def test_workers_of_the_same_layout_pair():
    assert OURS.cache_layout == kv_layout.NAME
    assert _connect(OURS, _prefill(OURS)) == ["prefill-1"]


def test_a_prefill_worker_of_another_cache_layout_refuses_us_naming_the_field():
    with pytest.raises(FailedPrecondition, match="cache_layout: ours 'head-major/v0', "
                                                 "peer 'block-major/v1'"):
        _connect(OURS, _prefill(OTHER))


def test_we_refuse_a_peer_that_answers_with_another_cache_layout_naming_the_field():
    with pytest.raises(FailedPrecondition, match="incompatible.*cache_layout: ours "
                                                 "'block-major/v1', peer 'head-major/v0'"):
        _connect(OURS, Answers(layout_message(OTHER)))


def test_we_refuse_a_peer_from_before_the_field():
    old = layout_message(OURS)
    old.ClearField("cache_layout")  # what a build without the field sends
    with pytest.raises(FailedPrecondition, match="cache_layout: ours 'block-major/v1', "
                                                 "peer ''"):
        _connect(OURS, Answers(old))


def test_we_refuse_a_peer_that_advertises_a_huge_tp_size_before_using_it():
    """Its tp_size would size a list of its ranks (kv_transfer/head_map.py): past
    MAX_TP_SIZE it is refused at the layout check, named, and no transport sees it."""
    with pytest.raises(FailedPrecondition, match="tp_size: peer 1073741824, not in 1..1024"):
        _connect(OURS, Answers(layout_message(replace(OURS, tp_size=2**30))))


def test_a_prefill_worker_refuses_a_decode_worker_of_a_huge_tp_size():
    async def go():
        request = wk.HandshakeRequest(engine_id="decode-1", nonce=b"n" * 16,
                                      layout=layout_message(replace(OURS, tp_size=2**30)))
        await _prefill(OURS).Handshake(request, None)

    with pytest.raises(ValueError, match="tp_size: peer 1073741824, not in 1..1024"):
        asyncio.run(go())
