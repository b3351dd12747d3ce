"""Prefill role: the blocks of requests handed off to a decode worker, held under leases.

Contract:
- `grant(request)` is called once, when the request ends with its first token (PREFILLED);
  its blocks stay allocated until `release` or expiry. It returns the lease id.
- A lease id is never granted twice (a counter per engine; a restarted engine has a new
  engine id). So `release(request_id, lease_id)` returning True proves the blocks were
  held, untouched, from the grant until that call: the decode worker's check that the KV
  it pulled is that request's (kv_transfer/lease_check.py).
- `release` with `lease_id` None releases whatever lease the request holds (the router,
  which never saw the handle, cleaning up after a client that left).
- `expire(now)` frees every lease past its expiry: a decode worker that never came.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from services.engine.kv_cache_manager import KVCacheManager
from services.engine.request import Request

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
        self._leases: dict[str, Lease] = {}
        self._ids = itertools.count(1)  # 0 means "no lease" on the wire
        self.num_expired = 0

    def grant(self, request: Request, now: float) -> int:
        lease = Lease(request, next(self._ids), now + self.timeout_s)
        self._leases[request.request_id] = lease
        return lease.lease_id

    def lease_id(self, request_id: str) -> int | None:
        lease = self._leases.get(request_id)
        return None if lease is None else lease.lease_id

    def blocks(self, request_id: str, lease_id: int) -> list[int] | None:
        """The blocks held under that exact lease, or None if it is not held."""
        lease = self._leases.get(request_id)
        if lease is None or lease.lease_id != lease_id:
            return None
        return self.kv.block_ids(request_id)

    def release(self, request_id: str, lease_id: int | None = None) -> bool:
        """Free the request's held blocks; False (nothing done) if that lease is not held."""
        lease = self._leases.get(request_id)
        if lease is None or (lease_id is not None and lease.lease_id != lease_id):
            return False
        del self._leases[request_id]
        self.kv.free(lease.request)
        return True

    def expire(self, now: float) -> list[str]:
        expired = [rid for rid, lease in self._leases.items() if lease.expiry <= now]
        for rid in expired:
            log.warning("KV lease of %s expired after %.0fs: no decode worker pulled it",
                        rid, self.timeout_s)
            self.release(rid)
        self.num_expired += len(expired)
        return expired

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self):
        return iter(list(self._leases))
