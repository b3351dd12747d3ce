"""The check every decode worker puts around its receiver: bytes that landed count only if
the source still held the handle's lease once they had landed.

Why: a one-sided READ (NIXL) cannot be refused by the source. If the lease ended before or
during the read (the decode worker stalled, the lease expired, the blocks went to other
requests), the bytes are another request's KV, and nothing in them says so. Asking the
source afterwards closes that hole:

    pull lands ──> confirm(handle) at the source ──> held: SUCCESS (and the lease is
                   released: the blocks are ours now)   not held: FAILED
                                                        no answer in time: FAILED

A lease id is never granted twice, so "held now" means "held for the whole read": the
blocks were pinned from the handle's making until after the bytes landed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from .base import KVHandle, KVLayout, KVReceiver, TransferState

# confirm(handle) starts asking the source whether it still held the handle's lease (and
# then released it), and returns a future of the answer: True if held. It should not
# block (many pulls land at once: their checks run side by side); a plain bool is taken
# too. A future that fails (the source is unreachable or silent) counts as not confirmed.
Confirm = Callable[[KVHandle], "Future[bool] | bool"]


def _future(confirm: Confirm, handle: KVHandle) -> Future:
    try:
        answer = confirm(handle)
    except Exception as e:  # noqa: BLE001 - could not even ask
        answer = Future()
        answer.set_exception(e)
    if not isinstance(answer, Future):
        done: Future = Future()
        done.set_result(bool(answer))
        return done
    return answer


class LeaseCheckedReceiver(KVReceiver):
    def __init__(self, inner: KVReceiver, confirm: Confirm):
        self.inner = inner
        self._confirm = confirm
        self._lock = threading.Lock()
        self._handles: dict[str, KVHandle] = {}  # transfer id -> handle, until polled done
        self._checks: dict[str, Future] = {}  # transfer id -> confirmation in flight

    def add_peer(self, engine_id: str, layout: KVLayout, metadata: bytes) -> None:
        self.inner.add_peer(engine_id, layout, metadata)

    def start_load(self, transfer_id: str, handle: KVHandle, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        with self._lock:
            self._handles[transfer_id] = handle
        self.inner.start_load(transfer_id, handle, remote_block_ids, local_block_ids)

    def poll(self, transfer_id: str) -> tuple[TransferState, str | None]:
        with self._lock:
            check = self._checks.get(transfer_id)
            handle = self._handles.get(transfer_id)
        if handle is None:
            return TransferState.FAILED, f"unknown transfer {transfer_id!r}"
        if check is None:
            state, error = self.inner.poll(transfer_id)
            if state is not TransferState.SUCCESS:
                if state.done:
                    self._forget(transfer_id)
                return state, error
            check = _future(self._confirm, handle)
            with self._lock:
                self._checks[transfer_id] = check
        if not check.done():
            return TransferState.TRANSFERRING, None
        self._forget(transfer_id)
        try:
            held = check.result()
        except Exception as e:  # noqa: BLE001 - any failure to confirm fails the pull
            return TransferState.FAILED, (f"could not confirm the lease of "
                                          f"{handle.request_id} on {handle.engine_id}: {e}")
        if not held:
            return TransferState.FAILED, (f"the lease of {handle.request_id} on "
                                          f"{handle.engine_id} ended before the pull was "
                                          "confirmed: the blocks may hold other KV")
        return TransferState.SUCCESS, None

    def _forget(self, transfer_id: str) -> None:
        with self._lock:
            self._handles.pop(transfer_id, None)
            self._checks.pop(transfer_id, None)

    def close(self) -> None:
        self.inner.close()
