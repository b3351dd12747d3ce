"""Only the cluster gets in (services/rpc/cluster.py), over real gRPC on loopback and
without a model: a worker refuses any call but health without the cluster token; the
router and the decode worker send it on every call to a worker; a decode worker pairs
only with a prefill worker that proves it holds the token (or whose certificate our CA
signed), and marks what it pulls from any other peer unverified; a lease is released
only by its id."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.decode_worker.peers import Peers
from baton.decode_worker.server import DecodeServicer
from baton.kv_transfer.base import KVLayout, KVReceiver, TransferState
from baton.prefill_worker.server import PrefillServicer
from baton.router.clients import GrpcWorkerClient
from baton.services.rpc.cluster import METADATA_KEY, ClusterToken
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.errors import FailedPrecondition, Unavailable
from baton.services.rpc.security import Security
from baton.services.rpc.server import Lifecycle, make_server, service_name
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc
from tests.e2e.certs import CA

TOKEN, OTHER = "a" * 16 + "-cluster-secret", "b" * 16 + "-another-secret"
LAYOUT = KVLayout("toy", "float32", 16, 2, 2, 8)
WORKER_SERVICES = ("PrefillService", "DecodeService", "WorkerService")


def _security(token: str | None = None, **tls) -> Security:
    return Security(ServiceConfig(cluster_token=token, **tls))


async def _serve(servicers: dict, check=None, credentials=None, port: int = 0):
    """A server with `servicers` ({service name: servicer}); `check` as its authorize."""
    state = Lifecycle()
    state.authorize = check

    def register(server):
        for name, servicer in servicers.items():
            getattr(wk_grpc, f"add_{name}Servicer_to_server")(servicer, server)
        return [service_name(wk, name) for name in servicers]

    server = make_server(register, state)
    port = (server.add_secure_port(f"127.0.0.1:{port}", credentials)
            if credentials is not None else server.add_insecure_port(f"127.0.0.1:{port}"))
    await server.start()
    await state.set_serving(True)
    return server, f"127.0.0.1:{port}"


class Everything(wk_grpc.PrefillServiceServicer, wk_grpc.DecodeServiceServicer,
                 wk_grpc.WorkerServiceServicer):
    """Every worker RPC, answering at once; records the token each call carried."""

    def __init__(self):
        self.tokens: dict[str, str | None] = {}

    def _saw(self, method: str, context) -> None:
        self.tokens[method] = dict(context.invocation_metadata()).get(METADATA_KEY)

    async def Prefill(self, request, context):
        self._saw("Prefill", context)
        return wk.PrefillResponse()

    async def ReleaseKv(self, request, context):
        self._saw("ReleaseKv", context)
        return wk.ReleaseKvResponse()

    async def AbortPrefill(self, request, context):
        self._saw("AbortPrefill", context)
        return wk.AbortPrefillResponse()

    async def Handshake(self, request, context):
        self._saw("Handshake", context)
        return wk.HandshakeResponse()

    async def Decode(self, request, context):
        self._saw("Decode", context)
        yield wk.DecodeResponse()

    async def Connect(self, request, context):
        self._saw("Connect", context)
        return wk.ConnectResponse()

    async def GetStats(self, request, context):
        self._saw("GetStats", context)
        return wk.GetStatsResponse()

    async def ReadKvBlocks(self, request, context):
        self._saw("ReadKvBlocks", context)
        yield wk.ReadKvBlocksResponse()

    async def LoadLora(self, request, context):
        self._saw("LoadLora", context)
        return wk.LoadLoraResponse()

    async def UnloadLora(self, request, context):
        self._saw("UnloadLora", context)
        return wk.UnloadLoraResponse()

    async def GetKvEvents(self, request, context):
        self._saw("GetKvEvents", context)
        return wk.GetKvEventsResponse()


def _all(servicer) -> dict:
    return {name: servicer for name in WORKER_SERVICES}


def test_a_worker_takes_no_call_without_the_token_but_health_stays_open():
    async def main():
        server, address = await _serve(_all(Everything()), ClusterToken(TOKEN).check())
        try:
            callers = {"no token": grpc.aio.insecure_channel(address),
                       "a wrong token": _security(OTHER).aio_channel(address),
                       "the token": _security(TOKEN).aio_channel(address)}
            for why, channel in callers.items():
                async with channel:
                    health = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest())
                    assert health.status == health_pb2.HealthCheckResponse.SERVING, why
                    calls = [wk_grpc.WorkerServiceStub(channel).GetStats(wk.GetStatsRequest()),
                             wk_grpc.PrefillServiceStub(channel).Handshake(
                                 wk.HandshakeRequest()),
                             wk_grpc.PrefillServiceStub(channel).AbortPrefill(
                                 wk.AbortPrefillRequest(request_id="r"))]
                    for call in calls:
                        if why == "the token":
                            await call
                            continue
                        with pytest.raises(grpc.aio.AioRpcError) as e:
                            await call
                        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, why
                        assert METADATA_KEY in e.value.details()
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_the_router_and_the_decode_worker_send_the_token_on_every_call():
    async def main():
        servicer = Everything()
        server, address = await _serve(_all(servicer), ClusterToken(TOKEN).check())
        security = _security(TOKEN)
        router = GrpcWorkerClient(address, security)
        peers = Peers(security)
        try:
            await router.prefill(wk.PrefillRequest(), timeout=5)
            await router.release("r", 1)
            await router.abort_prefill("r", timeout=5)
            assert [m async for m in router.decode(wk.DecodeRequest(), timeout=5)]
            await router.connect("elsewhere:1")
            await router.stats(timeout=5)
            await router.kv_events("e", 0, timeout=5)
            await router.load_lora("x", "/x", 1, timeout=5)
            await router.unload_lora("x", timeout=5)
            await peers.stub(address).Handshake(wk.HandshakeRequest(), timeout=5)
            peers.add("p", address)
            handle = SimpleNamespace(engine_id="p", request_id="r", lease_id=1)
            assert list(await asyncio.to_thread(lambda: list(peers.fetch(handle, [1]))))
        finally:
            await router.close()
            peers.close()
            await server.stop(0)
        every = {m.name for s in WORKER_SERVICES
                 for m in wk.DESCRIPTOR.services_by_name[s].methods}
        assert servicer.tokens == dict.fromkeys(every, TOKEN)

    asyncio.run(main())


# ---- the handshake: a decode worker pulls only from a peer that proves it belongs ------

class Transport(KVReceiver):
    """A receiver that records its peers; every load lands at once."""

    def __init__(self):
        self.peers: dict[str, bytes] = {}

    def add_peer(self, engine_id, layout, metadata):
        self.peers[engine_id] = metadata

    def start_load(self, transfer_id, handle, remote_block_ids, local_block_ids):
        pass

    def poll(self, transfer_id):
        return TransferState.SUCCESS, None


def _aengine():
    config = SimpleNamespace(kv_lease_timeout_s=30.0)
    return SimpleNamespace(engine=SimpleNamespace(kv_layout=LAYOUT, config=config,
                                                  sampling_defaults=None),
                           release_lease=lambda rid, lease: pytest.fail("released"))


def _prefill(cluster: ClusterToken) -> PrefillServicer:
    return PrefillServicer(_aengine(), "prefill-1", "fake", b"agent-metadata", None, cluster)


async def _connect(decode: Security, prefill: PrefillServicer, check=None, credentials=None):
    """The decode worker's handshake with `prefill` (served behind `check`): the peers
    it knows after, or the error."""
    server, address = await _serve({"PrefillService": prefill}, check, credentials)
    transport = Transport()
    servicer = DecodeServicer(_aengine(), "decode-1", "fake", Peers(decode), transport)
    try:
        eid = await servicer._connect(address)
        return eid, servicer.peers, transport
    finally:
        servicer.peers.close()
        await server.stop(0)


def test_a_prefill_worker_that_proves_the_token_is_paired_and_verified():
    eid, peers, transport = asyncio.run(_connect(
        _security(TOKEN), _prefill(ClusterToken(TOKEN)), ClusterToken(TOKEN).check()))
    assert eid == "prefill-1" and eid in peers.verified
    assert transport.peers == {"prefill-1": b"agent-metadata"}


@pytest.mark.parametrize("impostor", [ClusterToken(None), ClusterToken(OTHER)],
                         ids=["no token", "another token"])
def test_a_prefill_worker_that_cannot_prove_the_token_is_refused(impostor):
    """It takes our call (it checks nothing), but its answer carries no proof, or one
    under another token: the decode worker neither pairs with it nor sees its agent."""
    with pytest.raises(FailedPrecondition, match="cannot prove"):
        asyncio.run(_connect(_security(TOKEN), _prefill(impostor)))


def test_a_known_peer_that_fails_the_proof_on_reconnect_is_forgotten():
    """An address we had paired (and verified) answers a new handshake without the proof
    (another process took the port, or the token leaked and changed): we drop what we knew
    of it, so nothing more is pulled from it under the old pairing."""
    async def go():
        server, address = await _serve({"PrefillService": _prefill(ClusterToken(None))})
        peers = Peers(_security(TOKEN))
        peers.add("prefill-1", address, verified=True)
        servicer = DecodeServicer(_aengine(), "decode-1", "fake", peers, Transport())
        try:
            with pytest.raises(FailedPrecondition, match="cannot prove"):
                await servicer._connect(address, again=True)
            return dict(peers.by_address), set(peers.verified)
        finally:
            peers.close()
            await server.stop(0)

    assert asyncio.run(go()) == ({}, set())


def test_the_routers_connect_waits_for_a_prefill_worker_back_on_its_address():
    """Our channel to a prefill worker that died waits between tries to reach it again. The
    router asks us to pair with its restart as soon as it answers the router: that
    handshake waits for our channel's next try instead of failing at once (and leaving
    the pair, and every prompt meanwhile, to the router's next poll)."""
    async def go():
        server, address = await _serve({"PrefillService": _prefill(ClusterToken(None))})
        peers = Peers(_security(None))
        servicer = DecodeServicer(_aengine(), "decode-1", "fake", peers, Transport())
        try:
            assert await servicer._connect(address) == "prefill-1"
            await server.stop(0)  # killed: our channel now waits between tries
            with pytest.raises(Unavailable):
                await servicer._connect(address, again=True)
            restarted = PrefillServicer(_aengine(), "prefill-2", "fake", b"agent-2", None,
                                        ClusterToken(None))
            port = int(address.rsplit(":", 1)[1])
            server, _ = await _serve({"PrefillService": restarted}, port=port)
            reply = await servicer.Connect(wk.ConnectRequest(prefill_address=address), None)
            return reply.prefill_engine_id, dict(peers.by_address)
        finally:
            peers.close()
            await server.stop(0)

    assert asyncio.run(go())[0] == "prefill-2"


def test_a_prefill_worker_with_another_token_refuses_us_and_we_say_so():
    with pytest.raises(FailedPrecondition, match="UNAUTHENTICATED|cluster only"):
        asyncio.run(_connect(_security(TOKEN), _prefill(ClusterToken(OTHER)),
                             ClusterToken(OTHER).check()))


def test_a_proof_holds_for_one_nonce_only():
    cluster = ClusterToken(TOKEN)
    proof = cluster.prove(b"n" * 16, "prefill-1", "nixl", b"agent", LAYOUT)
    assert cluster.proven(proof, b"n" * 16, "prefill-1", "nixl", b"agent", LAYOUT)
    assert not cluster.proven(proof, b"m" * 16, "prefill-1", "nixl", b"agent", LAYOUT)
    assert not cluster.proven(proof, b"n" * 16, "prefill-1", "nixl", b"another agent",
                              LAYOUT)
    assert not ClusterToken(TOKEN).proven(b"", b"", "prefill-1", "nixl", b"agent", LAYOUT)


@pytest.mark.parametrize("change", [{"tp_size": 2}, {"tp_size": 2**30}, {"model": "toy2"},
                                    {"kv_scales": "1"}])
def test_a_proof_covers_every_field_of_the_layout_it_states(change):
    cluster = ClusterToken(TOKEN)
    proof = cluster.prove(b"n" * 16, "prefill-1", "nixl", b"agent", LAYOUT)
    assert not cluster.proven(proof, b"n" * 16, "prefill-1", "nixl", b"agent",
                              replace(LAYOUT, **change))


def test_a_proof_of_the_first_version_fails():
    """A peer of v1 (which covered no layout) is refused: both sides change together."""
    mac = hmac.new(TOKEN.encode(), b"baton-handshake-v1", hashlib.sha256)
    for part in (b"n" * 16, b"prefill-1", b"nixl", b"agent"):
        mac.update(len(part).to_bytes(8, "big") + part)
    assert not ClusterToken(TOKEN).proven(mac.digest(), b"n" * 16, "prefill-1", "nixl",
                                          b"agent", LAYOUT)


class Rewritten(PrefillServicer):
    """A member's handshake answer with its layout changed on the way (tp_size)."""

    async def Handshake(self, request, context):
        reply = await super().Handshake(request, context)
        reply.layout.tp_size = 2
        return reply


def test_a_layout_changed_after_the_proof_is_refused():
    member = Rewritten(_aengine(), "prefill-1", "fake", b"agent-metadata", None,
                       ClusterToken(TOKEN))
    with pytest.raises(FailedPrecondition, match="cannot prove"):
        asyncio.run(_connect(_security(TOKEN), member, ClusterToken(TOKEN).check()))


def test_without_any_credential_a_peer_is_paired_but_not_verified():
    eid, peers, _ = asyncio.run(_connect(_security(None), _prefill(ClusterToken(None))))
    assert eid == "prefill-1" and eid not in peers.verified


def test_with_mutual_tls_the_certificate_verifies_the_peer(tmp_path):
    ca = CA(tmp_path, "baton-ca")

    def tls(name: str) -> dict:
        cert, key = ca.issue(name)
        return {"tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(ca.path)}

    server = _security(**tls("prefill")).server_credentials(public=False)
    eid, peers, _ = asyncio.run(_connect(_security(**tls("decode")),
                                         _prefill(ClusterToken(None)), credentials=server))
    assert eid in peers.verified


# ---- leases: released only by the id a handle names -------------------------------------

def test_a_release_or_a_handle_without_a_lease_id_is_refused():
    async def main():
        decode = DecodeServicer(_aengine(), "decode-1", "fake", Peers(_security()),
                                Transport())
        server, address = await _serve({"PrefillService": _prefill(ClusterToken(None)),
                                        "DecodeService": decode})
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await wk_grpc.PrefillServiceStub(ch).ReleaseKv(
                        wk.ReleaseKvRequest(request_id="r", lease_id=0))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "lease_id" in e.value.details()
                handle = wk.KvHandle(engine_id="prefill-1", request_id="r", lease_id=0,
                                     block_ids=[1], num_tokens=4)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in wk_grpc.DecodeServiceStub(ch).Decode(wk.DecodeRequest(
                            request_id="r", prompt_token_ids=[1, 2, 3, 4], handle=handle,
                            prefill_address=address)):
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "handle.lease_id" in e.value.details()
        finally:
            decode.peers.close()
            await server.stop(0)

    asyncio.run(main())


@pytest.mark.parametrize("given, says", [
    ({"cluster_token": "short"}, "at least 16"),
    ({"cluster_token": "x" * 16 + " y"}, "printable ASCII"),
    ({"cluster_token": "x" * 20, "cluster_token_file": "/nonexistent"}, "not both"),
    ({"cluster_token_file": "/nonexistent"}, "no such file"),
])
def test_an_unusable_token_is_refused_without_being_shown(given, says):
    with pytest.raises(ValueError, match=says) as e:
        ServiceConfig(**given)
    assert given.get("cluster_token", "<none>") not in str(e.value)
    assert "x" * 16 not in repr(ServiceConfig(cluster_token="x" * 16))
