"""A decode worker's prefill peers hold channels and locks only while they are of use: a
failed handshake leaves none behind, a peer forgotten takes its own, a restart at the
same address keeps the channel, and known peers are bounded (the oldest go first). Each
lease handed to a decode call is released once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

import baton.decode_worker.peers as peers_module
from baton.decode_worker.peers import Peers
from baton.kv_transfer.base import KVHandle
from baton.services.rpc.config import ServiceConfig
from baton.services.rpc.security import Security


def _peers() -> Peers:
    peers = Peers(Security(ServiceConfig("127.0.0.1:0")))
    peers.bind(asyncio.get_running_loop())
    return peers


async def _shake(peers: Peers, address: str, engine_id: str | None) -> None:
    """What the decode worker's handshake does with Peers: None, the handshake failed."""
    async with peers.handshaking(address):
        peers.stub(address)
        if engine_id is None:
            raise ConnectionError(f"{address} is not there")
        peers.forget(address)
        peers.add(engine_id, address)


def test_a_failed_handshake_leaves_no_channel_or_lock():
    async def main():
        peers = _peers()
        for i in range(200):  # as a caller naming address after address would
            with pytest.raises(ConnectionError):
                await _shake(peers, f"10.0.{i // 250}.{i % 250}:9", None)
        assert not peers._aio and not peers._handshakes

    asyncio.run(main())


def test_handshakes_with_one_address_take_turns_and_then_let_go():
    async def main():
        peers = _peers()
        inside, most = 0, 0

        async def shake() -> None:
            nonlocal inside, most
            async with peers.handshaking("10.0.0.1:9"):
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.01)
                peers.stub("10.0.0.1:9")
                inside -= 1

        await asyncio.gather(*(shake() for _ in range(5)))
        assert most == 1 and not peers._handshakes and not peers._aio

    asyncio.run(main())


def test_known_peers_are_bounded_and_take_their_channels_along(monkeypatch):
    monkeypatch.setattr(peers_module, "MAX_PEERS", 8)

    async def main():
        peers = _peers()
        addresses = [f"10.0.0.{i}:9" for i in range(12)]
        for i, a in enumerate(addresses):
            await _shake(peers, a, f"e{i}")
        assert list(peers.by_address) == addresses[4:]  # the oldest went first
        assert set(peers._aio) == set(addresses[4:]) and len(peers._sync) == 8
        assert set(peers.address) == {f"e{i}" for i in range(4, 12)}
        last = addresses[-1]
        stub = peers.stub(last)
        await _shake(peers, last, "e11-restarted")  # same address, new engine
        assert peers.stub(last) is stub and peers.by_address[last] == "e11-restarted"
        channel = peers._aio[last][0]
        peers.forget(last)
        assert last not in peers._aio and "e11-restarted" not in peers.address
        await asyncio.wait(list(peers._tasks))  # the channels' closes
        assert channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN

    asyncio.run(main())


class _Prefill:
    """A prefill worker's ReleaseKv: True the first time a lease is named, as the lease
    table answers."""

    def __init__(self, busy: int = 0):
        self.calls: list[tuple[str, int]] = []
        self.busy = busy  # this many calls fail first, as a worker too loaded to answer

    async def ReleaseKv(self, request, timeout):  # noqa: N802 - the stub's name
        if self.busy:
            self.busy -= 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                       grpc.aio.Metadata())
        self.calls.append((request.request_id, request.lease_id))
        return SimpleNamespace(released=self.calls.count(self.calls[-1]) == 1)


async def _settled(peers: Peers) -> None:
    """Until every task the peers started (releases, closes) has ended."""
    while peers._tasks:
        await asyncio.wait(list(peers._tasks))


async def _known(prefill: _Prefill) -> Peers:
    peers = _peers()
    peers.add("p", "10.0.0.1:9")
    peers.stub = lambda address: prefill
    return peers


def test_a_release_that_fails_on_the_way_is_tried_again():
    """A background release the prefill worker did not answer in time is sent again,
    rather than the lease left held until it expires there."""
    async def main():
        prefill = _Prefill(busy=2)
        peers = await _known(prefill)
        with peers.holding(KVHandle("p", "r", 7, (1,), 4)) as over:
            over()  # no pull: released in the background
        await _settled(peers)
        assert prefill.calls == [("r", 7)] and prefill.busy == 0

    asyncio.run(main())


@pytest.mark.parametrize("pulled", [True, False])
def test_a_decode_call_releases_its_lease_once_whichever_path_ends_it(pulled):
    """The lease check's release (a pull landed) or the load's end (no pull): one
    ReleaseKv either way, however often the load is said to be over."""
    async def main():
        prefill = _Prefill()
        peers = await _known(prefill)
        handle = KVHandle("p", "r", 7, (1,), 4)
        with peers.holding(handle) as over:
            if pulled:
                assert await asyncio.wrap_future(peers.confirm(handle))
            over()  # the first output
        await _settled(peers)  # a background release, if any, has run
        assert prefill.calls == [("r", 7)] and not peers._held
        peers.close()

    asyncio.run(main())


def test_a_pull_confirmed_after_its_call_ended_is_not_trusted():
    """The call ended (and released) before its abandoned pull landed: the check asks
    again and hears that the lease is no longer held."""
    async def main():
        prefill = _Prefill()
        peers = await _known(prefill)
        handle = KVHandle("p", "r", 7, (1,), 4)
        with peers.holding(handle):
            pass
        await _settled(peers)  # the release of its end has run
        assert not await asyncio.wrap_future(peers.confirm(handle))
        assert prefill.calls == [("r", 7), ("r", 7)]
        peers.close()

    asyncio.run(main())
