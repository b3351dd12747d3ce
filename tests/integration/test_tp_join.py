"""The tensor-parallel group as an outsider meets it (services/engine/tp_join.py): a
process given the rendezvous address cannot join, cannot take a place, cannot pose as
rank 0 and cannot make a rank run anything; a rank that fails a proof or a second claim
stops every rank at once, none hangs alive; on one host nothing of the group listens
beyond loopback. Ranks run on threads here (gloo in one process), outsiders speak to the
store with torch's own client, as the review's did."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from baton.services.engine import tp_join
from baton.services.engine.parallel import TPGroup
from baton.services.engine.tp_join import JoinError, Rendezvous
from baton.services.engine.tp_wire import WireError
from tests.e2e.topology import free_port
from tests.tp_listeners import listeners

TOKEN = "a-cluster-token-of-32-characters"
CPU = torch.device("cpu")
RAN: list[str] = []


class Payload:
    def __reduce__(self):
        return (RAN.append, ("code ran",))


class Rank(threading.Thread):
    """TPGroup(rdv, rank) on a thread: `group` once joined, else `error`."""

    def __init__(self, rdv: Rendezvous, rank: int):
        super().__init__(daemon=True, name=f"rank-{rank}")
        self.rdv, self.rank = rdv, rank
        self.group: TPGroup | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.group = TPGroup(self.rdv, self.rank, CPU)
        except BaseException as e:
            self.error = e

    def ended(self, within_s: float = 15.0) -> Rank:
        self.join(within_s)
        assert not self.is_alive(), f"rank {self.rank} still waits: it hangs alive"
        return self


def over_loopback(token: str | None = TOKEN, timeout_s: float = 60.0) -> Rendezvous:
    return Rendezvous.over_hosts(f"127.0.0.1:{free_port()}", 2, token, timeout_s)


def outsider(rdv: Rendezvous):
    """torch's own store client at the rendezvous, as anyone given the address."""
    host, port = rdv.where.removeprefix("tcp:").rsplit(":", 1)
    return dist.TCPStore(host, int(port), 2, False, timeout=datetime.timedelta(seconds=20))


def wait_key(store, key: str) -> bytes:
    store.wait([tp_join.KEY + key])
    return store.get(tp_join.KEY + key)


def test_an_outsider_that_claims_a_place_fails_its_proof_and_gets_nothing():
    rdv = over_loopback()
    rank0 = Rank(rdv, 0)
    spy = outsider(rdv)
    nonce0 = bytes.fromhex(wait_key(spy, "nonce").decode())
    assert spy.add(tp_join.KEY + "claim/1", 1) == 1  # first at the place
    forged = os.urandom(16) + tp_join._mac(Rendezvous("x", 2, b"guess"), b"claim", nonce0, 1,
                                           b"\0" * 16)
    spy.set(tp_join.KEY + "proof/1", forged.hex())
    started = time.monotonic()
    assert isinstance(rank0.ended().error, JoinError)
    assert "rank 1" in str(rank0.error) and "failed the proof" in str(rank0.error)
    real = Rank(rdv, 1).ended()  # the real rank 1, late: refused, and it stops
    assert isinstance(real.error, JoinError) and real.group is None
    assert time.monotonic() - started < 20, "the failure took the rendezvous' timeout"
    assert not spy.check([tp_join.KEY + "admit/1"]), "rank 0 admitted the outsider"


def test_a_second_claim_on_a_place_stops_the_group_naming_it():
    rdv = over_loopback()
    rank0 = Rank(rdv, 0)
    spy = outsider(rdv)
    wait_key(spy, "nonce")
    spy.add(tp_join.KEY + "claim/1", 1)  # a claim, no proof: rank 1's place is held
    real = Rank(rdv, 1).ended()
    assert "rank 1's place" in str(real.error) and "claimed already" in str(real.error)
    assert "rank 1" in str(rank0.ended().error)
    assert rank0.group is None and real.group is None


def test_an_outsider_posing_as_rank_0_makes_a_rank_stop_not_follow():
    rdv = over_loopback()
    host, port = rdv.where.removeprefix("tcp:").rsplit(":", 1)
    fake = dist.TCPStore(host, int(port), 2, True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=20))
    fake.set(tp_join.KEY + "nonce", os.urandom(16).hex())
    real = Rank(rdv, 1)
    wait_key(fake, "proof/1")
    fake.set(tp_join.KEY + "admit/1", os.urandom(32).hex())  # it cannot make the MAC
    assert "did not prove it holds the cluster token" in str(real.ended().error)
    assert real.group is None


def test_a_peer_that_got_past_the_store_fails_the_roll_call(monkeypatch):
    # As if an outsider had written itself into gloo's keys: the connection's other end
    # is then a process without the secret. Admission skipped, the roll call catches it.
    nonce0 = os.urandom(16)
    monkeypatch.setattr(tp_join, "_admit", lambda *a: nonce0)
    address = f"127.0.0.1:{free_port()}"
    good, bad = (Rendezvous(f"tcp:{address}", 2, secret, 30.0) for secret in (b"k" * 32,
                                                                             b"x" * 32))
    rank0, intruder = Rank(good, 0), Rank(bad, 1)
    assert "rank(s) [1]" in str(rank0.ended().error)
    assert "rank(s) [0]" in str(intruder.ended().error)


def pair(rdv: Rendezvous) -> tuple[TPGroup, TPGroup]:
    ranks = [Rank(rdv, r) for r in (0, 1)]
    for r in ranks:
        assert r.ended(60).group is not None, r.error
    return ranks[0].group, ranks[1].group  # type: ignore[return-value]


def test_a_pickle_sent_as_a_step_is_refused_and_runs_nothing():
    rdv = Rendezvous.local(2)
    try:
        zero, one = pair(rdv)
    finally:
        rdv.remove()
    got: list = []

    def follow():
        try:
            got.append(one.recv())
        except WireError as e:
            got.append(e)

    def received(send) -> object:
        t = threading.Thread(target=follow, daemon=True)
        t.start()
        send()
        t.join(10)
        assert not t.is_alive(), "rank 1 never got the message"
        return got.pop()

    data = torch.frombuffer(bytearray(pickle.dumps(("forward", Payload()))), dtype=torch.uint8)

    def as_rank_0_may() -> None:
        zero._broadcast(torch.tensor([data.numel()], dtype=torch.long))
        zero._broadcast(data)

    error = received(as_rank_0_may)
    assert "not a Baton tensor-parallel message" in str(error), error
    assert RAN == []
    # And the group still carries real messages.
    assert received(lambda: zero.send("allocate", 3, None)) == ("allocate", [3, None])


def test_a_group_on_one_host_listens_on_loopback_only_and_leaves_no_folder():
    before = listeners(os.getpid())
    rdv = Rendezvous.local(2)
    folder = rdv.where.removeprefix("file:")
    assert os.stat(folder).st_mode & 0o777 == 0o700
    try:
        groups = pair(rdv)
    finally:
        rdv.remove()
    new = listeners(os.getpid()) - before
    del groups
    assert new, "gloo was meant to listen for its pairs"
    assert {host for host, _ in new} == {"127.0.0.1"}, new
    assert not os.path.exists(folder)


def test_the_rendezvous_across_hosts_listens_on_its_address_only():
    before = listeners(os.getpid())
    rdv = over_loopback()
    port = int(rdv.where.rsplit(":", 1)[1])
    rank0 = Rank(rdv, 0)
    deadline = time.monotonic() + 10
    while ("127.0.0.1", port) not in listeners(os.getpid()):
        assert time.monotonic() < deadline, "rank 0's store never listened"
        time.sleep(0.05)
    Rank(rdv, 1).ended(60)
    rank0.ended(60)
    new = listeners(os.getpid()) - before
    assert ("127.0.0.1", port) in new and {host for host, _ in new} == {"127.0.0.1"}, new
    # Not on every interface: another address of this host is refused.
    other = outward_address()
    if other is None or other.startswith("127."):
        pytest.skip(f"this host has no address beyond loopback ({other}): nothing to probe")
    with pytest.raises(OSError):
        socket.create_connection((other, port), timeout=2).close()


def outward_address() -> str | None:
    """This host's address on its default route (a UDP connect sends nothing), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: any routable address will do
        except OSError:
            return None
        return s.getsockname()[0]
