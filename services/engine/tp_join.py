"""How the ranks of a tensor-parallel group meet, and prove they belong, before a step
travels between them.

    one host (nnodes 1)   a FileStore in a folder rank 0 makes private (0700), its path
                          and a fresh group secret handed to the ranks rank 0 spawns (over
                          their spawn pipes): nothing listens for the rendezvous, and gloo
                          binds 127.0.0.1.
    several hosts         a TCPStore at --distributed-init-address, listening on that
                          address only (not on every interface); gloo binds the address
                          this host reaches it from. The secret derives from the cluster
                          token (with --insecure-no-cluster-auth, none: places are still
                          claimed once, but any process can make the proofs).

Admission, in the store, before gloo connects anyone (MAC: HMAC-SHA256 under the secret):

    rank 0                                      rank r > 0
    "nonce" = nonce0                            waits for "nonce"
                                                add("claim/r", 1) must be 1: else its place
                                                  is taken, and it stops
                                                "proof/r" = nonce_r | MAC(claim, nonce0, r,
                                                  nonce_r)
    checks each proof and that each claim is
    1, until every rank is in or the deadline
    "admit/r" = MAC(admit, nonce0, r, nonce_r)  waits for "admit/r", checks it (rank 0
                                                  holds the secret too)

Any failure sets "abort" to why, which every rank polls, so all stop at once: a place
claimed twice, a proof that fails, a rank missing at the deadline, a rank process that
exits first (`alive` raises). Then gloo (or NCCL) connects the ranks, its keys under this
group's nonce, and a roll call over the new group itself checks every rank's MAC(gloo,
nonce0, r): the process at the other end of each connection holds the secret, not only
whoever wrote in the store.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_c10d: Any = dist  # torch's stubs lack the backends and TCPStore's keywords
KEY = "baton/tp/"
LABEL = b"baton-tp-join-v1"
POLL_S = 0.05


class JoinError(RuntimeError):
    """The group cannot form: the message names the rank and why."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet ("file:<folder>" or "tcp:<host>:<port>"), how many, the
    secret each proves it holds, and how long rank 0 waits for the others."""

    where: str
    size: int
    secret: bytes = field(default=b"", repr=False)
    timeout_s: float = 300.0

    @staticmethod
    def local(size: int, timeout_s: float = 120.0) -> Rendezvous:
        """One host: a private folder (mkdtemp: 0700) and a fresh secret."""
        folder = tempfile.mkdtemp(prefix="baton-tp-")
        return Rendezvous(f"file:{folder}", size, secrets.token_bytes(32), timeout_s)

    @staticmethod
    def over_hosts(address: str, size: int, token: str | None,
                   timeout_s: float = 300.0) -> Rendezvous:
        secret = hmac.new(token.encode(), LABEL, hashlib.sha256).digest() if token else b""
        return Rendezvous(f"tcp:{address}", size, secret, timeout_s)

    @property
    def local_only(self) -> bool:
        return self.where.startswith("file:")

    def remove(self) -> None:
        """Rank 0, once every rank is past the store: its folder (one host) goes."""
        if self.local_only:
            shutil.rmtree(self.where[len("file:"):], ignore_errors=True)


def join(rdv: Rendezvous, rank: int, device: torch.device,
         alive: Callable[[], None] = lambda: None):
    """(store, process group) for `rank`, admitted and proven as above; JoinError naming
    the rank that failed (after telling every other rank to stop). `alive` raises where a
    rank this process started is gone."""
    deadline = time.monotonic() + rdv.timeout_s
    store = _store(rdv, rank, deadline)
    try:
        nonce0 = _admit(store, rdv, rank, deadline, alive)
        pg = _watching(lambda: _group(store, rdv, rank, device, nonce0, deadline), store,
                       deadline, alive)
        _roll_call(pg, rdv, rank, device, nonce0)
    except BaseException as e:
        _abort(store, f"rank {rank}: {e}")
        raise
    pg._set_default_timeout(datetime.timedelta(days=30))  # idle ranks wait for steps
    return store, pg


def _mac(rdv: Rendezvous, *parts: bytes | int) -> bytes:
    mac = hmac.new(rdv.secret, LABEL, hashlib.sha256)
    for p in parts:
        b = p.to_bytes(8, "big") if isinstance(p, int) else p
        mac.update(len(b).to_bytes(8, "big") + b)
    return mac.digest()


def _store(rdv: Rendezvous, rank: int, deadline: float):
    timeout = datetime.timedelta(seconds=rdv.timeout_s)
    if rdv.local_only:
        store = _c10d.FileStore(os.path.join(rdv.where[len("file:"):], "store"), rdv.size)
        store.set_timeout(timeout)
        return store
    host, port = rdv.where[len("tcp:"):].rsplit(":", 1)
    if rank != 0:  # retries until rank 0 listens, or its timeout
        return _c10d.TCPStore(host, int(port), rdv.size, False, timeout=timeout)
    sock = _listen(host, int(port))
    return _c10d.TCPStore(host, int(port), rdv.size, True, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=sock.detach())


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on `host` only: torch's own binds every interface."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise JoinError(f"the tensor-parallel rendezvous cannot listen on {host}:{port}: "
                        f"{e}") from None
    return sock


def _admit(store, rdv: Rendezvous, rank: int, deadline: float,
           alive: Callable[[], None]) -> bytes:
    if rank != 0:
        nonce0 = bytes.fromhex(_wait(store, "nonce", deadline, alive, "rank 0"))
        if store.add(f"{KEY}claim/{rank}", 1) != 1:
            raise JoinError(f"rank {rank}'s place in the tensor-parallel group was claimed "
                            "already, by another process: this one stops")
        mine = secrets.token_bytes(16)
        store.set(f"{KEY}proof/{rank}", (mine + _mac(rdv, b"claim", nonce0, rank, mine)).hex())
        admit = bytes.fromhex(_wait(store, f"admit/{rank}", deadline, alive, "rank 0"))
        if not hmac.compare_digest(admit, _mac(rdv, b"admit", nonce0, rank, mine)):
            raise JoinError(f"rank {rank}: the rendezvous at {rdv.where} did not prove it "
                            "holds the cluster token: not joining it")
        return nonce0
    nonce0 = secrets.token_bytes(16)
    store.set(f"{KEY}nonce", nonce0.hex())
    pending, nonces = set(range(1, rdv.size)), {}
    while True:
        alive()
        _check_abort(store)
        for r in sorted(pending):
            if store.check([f"{KEY}proof/{r}"]):
                raw = bytes.fromhex(store.get(f"{KEY}proof/{r}").decode())
                nonce, proof = raw[:16], raw[16:]
                if not hmac.compare_digest(proof, _mac(rdv, b"claim", nonce0, r, nonce)):
                    raise JoinError(f"rank {r}: the process that claimed its place failed "
                                    "the proof of membership (it does not hold the cluster "
                                    "token)")
                nonces[r] = nonce
                pending.discard(r)
        for r in range(1, rdv.size):
            if store.add(f"{KEY}claim/{r}", 0) > 1:
                raise JoinError(f"rank {r}'s place was claimed by two processes: the group "
                                "stops (another process joined the rendezvous)")
        if not pending:
            break
        if time.monotonic() > deadline:
            raise JoinError(f"tensor-parallel rank(s) {sorted(pending)} did not join "
                            f"within {rdv.timeout_s:.0f} s (rendezvous {rdv.where})")
        time.sleep(POLL_S)
    for r, nonce in nonces.items():
        store.set(f"{KEY}admit/{r}", _mac(rdv, b"admit", nonce0, r, nonce).hex())
    return nonce0


def _wait(store, key: str, deadline: float, alive: Callable[[], None], whom: str) -> str:
    while not store.check([KEY + key]):
        alive()
        _check_abort(store)
        if time.monotonic() > deadline:
            raise JoinError(f"{whom} did not answer at the tensor-parallel rendezvous in "
                            "time")
        time.sleep(POLL_S)
    return store.get(KEY + key).decode()


def _check_abort(store) -> None:
    if store.check([f"{KEY}abort"]):
        raise JoinError(f"the tensor-parallel group stopped: {store.get(KEY + 'abort').decode()}")


def _abort(store, why: str) -> None:
    try:
        if not store.check([f"{KEY}abort"]):
            store.set(f"{KEY}abort", why)
    except Exception:  # the store itself is gone: the others time out on it
        pass


def _watching(make, store, deadline: float, alive: Callable[[], None]):
    """make() on a thread (gloo's connect blocks), while this one watches `alive` and the
    abort key; a rank that fails meanwhile ends the wait at once."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["pg"] = make()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True, name="tp-connect")
    t.start()
    while t.is_alive():
        t.join(POLL_S)
        if t.is_alive():
            alive()
            _check_abort(store)
            if time.monotonic() > deadline + 5:
                raise JoinError("the tensor-parallel ranks did not connect in time")
    if "error" in out:
        raise JoinError(f"the tensor-parallel ranks could not connect: {out['error']}")
    return out["pg"]


def _group(store, rdv: Rendezvous, rank: int, device: torch.device, nonce0: bytes,
           deadline: float):
    prefixed = _c10d.PrefixStore(f"{KEY}{nonce0.hex()}/", store)
    if device.type == "cuda":
        if rdv.local_only:  # NCCL's bootstrap sockets: loopback on one host
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        return _c10d.ProcessGroupNCCL(prefixed, rank, rdv.size,
                                      _c10d.ProcessGroupNCCL.Options())
    opts = _c10d.ProcessGroupGloo._Options()
    opts._devices = [_gloo_device(rdv)]
    opts._timeout = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
    return _c10d.ProcessGroupGloo(prefixed, rank, rdv.size, opts)


def _gloo_device(rdv: Rendezvous):
    make = _c10d.ProcessGroupGloo.create_device
    if rdv.local_only:
        return make(hostname="127.0.0.1")
    if os.environ.get("GLOO_SOCKET_IFNAME"):  # torch's own variable, as it reads it
        return make(interface=os.environ["GLOO_SOCKET_IFNAME"].split(",")[0])
    host, port = rdv.where[len("tcp:"):].rsplit(":", 1)
    # The address this host reaches the rendezvous from (a UDP connect sends nothing).
    family, kind, proto, _, addr = socket.getaddrinfo(host, int(port),
                                                      type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(addr)
        return make(hostname=s.getsockname()[0])


def _roll_call(pg, rdv: Rendezvous, rank: int, device: torch.device, nonce0: bytes) -> None:
    macs = [torch.zeros(32, dtype=torch.uint8, device=device) for _ in range(rdv.size)]
    mine = torch.frombuffer(bytearray(_mac(rdv, b"gloo", nonce0, rank)), dtype=torch.uint8)
    pg.allgather([macs], [mine.to(device)]).wait()
    bad = [r for r, m in enumerate(macs)
           if not hmac.compare_digest(bytes(m.cpu().tolist()), _mac(rdv, b"gloo", nonce0, r))]
    if bad:
        raise JoinError(f"tensor-parallel rank(s) {bad}: the process connected in that place "
                        "failed the proof of membership")
