"""Prefill role: the blocks of requests handed off to a decode worker, held under leases.
The one path by which a lease ends on the prefill side, whoever asks:

    grant ──> held ──> revoke (ends it, once) ──> collect (frees its blocks)
                         ^ the first of:
                         | ReleaseKv naming it: the decode worker's lease check or its
                         |   release, or the router's (a handle nobody will pull)
                         | the Prefill caller left before the answer reached it (the
                         |   worker's own release: nobody will come for the blocks)
                         | the engine's abort of the request (`lease_id` None), fail_all
                         | expiry (--kv-lease-timeout): a decode worker that never came

Contract:
- `grant(request)` is called once, when the request ends with its first token (PREFILLED);
  its blocks stay allocated until the lease is released or expires. It returns the id.
- A lease id is never granted twice (a counter per engine; a restarted engine has a new
  engine id). So "lease `lease_id` of `request_id` was still held when released" proves
  the blocks were held, untouched, from the grant until then: the decode worker's check
  that the KV it pulled is that request's (kv_transfer/lease_check.py). It also makes a
  second release harmless: it finds nothing held (False).
- `revoke` is the one call any thread may make (a worker answers a lease check at once,
  without waiting for the engine's step to end). It ends the lease under a lock; the
  blocks stay allocated until the engine thread's next `collect`, so nothing can reuse
  them before the lease is seen to have ended. Every other call runs on the engine
  thread; `release` is `revoke` and `collect` in one.
- `lease_id` None releases whatever lease the request holds: the engine's own abort of
  the request. No caller over the wire may (ReleaseKv needs the handle's lease id).
- `expire(now)` revokes every lease past its expiry, then collects.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass

from .kv_cache_manager import KVCacheManager
from .request import Request

log = logging.getLogger(__name__)


@dataclass
class Lease:
    request: Request
    lease_id: int
    expiry: float  # monotonic seconds


class LeaseTable:
    def __init__(self, kv: KVCacheManager, timeout_s: float):
        self.kv = kv
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._revoked: list[Request] = []  # ended, blocks not yet freed (engine thread)
        self._ids = itertools.count(1)  # 0 means "no lease" on the wire
        self.num_expired = 0

    def grant(self, request: Request, now: float) -> int:
        lease = Lease(request, next(self._ids), now + self.timeout_s)
        with self._lock:
            self._leases[request.request_id] = lease
        return lease.lease_id

    def blocks(self, request_id: str, lease_id: int) -> list[int] | None:
        """The blocks held under that exact lease, or None if it is not held. Any thread:
        a held lease's blocks do not change."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.lease_id != lease_id:
                return None
            return self.kv.block_ids(request_id)

    def revoke(self, request_id: str, lease_id: int | None = None) -> bool:
        """End the lease (any thread); False, nothing done, if that lease is not held."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or (lease_id is not None and lease.lease_id != lease_id):
                return False
            del self._leases[request_id]
            self._revoked.append(lease.request)
        return True

    def collect(self) -> None:
        """Free the blocks of leases revoked since the last call (engine thread)."""
        with self._lock:
            revoked, self._revoked = self._revoked, []
        for request in revoked:
            self.kv.free(request)

    def release(self, request_id: str, lease_id: int | None = None) -> bool:
        """End the lease and free its blocks now (engine thread)."""
        released = self.revoke(request_id, lease_id)
        self.collect()
        return released

    def expire(self, now: float) -> list[str]:
        with self._lock:
            expired = [rid for rid, lease in self._leases.items() if lease.expiry <= now]
        for rid in expired:
            if self.revoke(rid):
                log.warning("KV lease of %s expired after %.0fs: no decode worker pulled "
                            "it", rid, self.timeout_s)
                self.num_expired += 1
        self.collect()
        return expired

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def __iter__(self):
        with self._lock:
            return iter(list(self._leases))
