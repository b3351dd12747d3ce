"""Why a prompt is computed on its decode worker instead of a prefill worker, and the one
place that says so: a log line with the reason, and `baton:local_prefills_total{reason}`.
A fall-back no one can see is a slow decode batch no one can explain.

    reason             when                                                    logged
    prefix_cached      conditional disaggregation: the decode worker holds at   debug
                       least --local-prefill-hit of the prompt's blocks
    short_prompt       ... or lacks at most --local-prefill-tokens of it        debug
    prefill_queue      ... or the prefill workers' queue is --local-prefill-     debug
                       queue times its own
    disaggregation_never  --disaggregation never: every prompt                 debug
    no_prefill_worker  no prefill worker is configured (or found)               debug
    prefill_down       prefill workers are known, none is up (down, draining,   warning
                       not polled yet)
    prefill_unpaired   one is up, but no decode worker has paired with it: a    warning
                       handshake that failed, or ran longer than the wait
    prefill_failed     every prefill worker tried failed the prompt             warning
    decode_unpaired    prefilled, but no decode worker that can take it has     warning
                       paired with that prefill engine: the prompt is computed
                       again
    kv_pull_failed     the decode worker's pull of the KV failed, and it        warning
                       computed the prompt itself (its log says why)

The deliberate ones are debug lines (a choice, not a fault); a warning comes at most once
per reason every LOG_EVERY_S, saying how many it stood for, so an outage of every prefill
worker is a line every few seconds rather than one per request.
"""

from __future__ import annotations

import logging
import time

from .metrics import RouterMetrics
from .registry import Registry, states

log = logging.getLogger(__name__)

DELIBERATE = frozenset({"prefix_cached", "short_prompt", "prefill_queue",
                        "disaggregation_never", "no_prefill_worker"})
REASONS = DELIBERATE | {"prefill_down", "prefill_unpaired", "prefill_failed",
                        "decode_unpaired", "kv_pull_failed"}
LOG_EVERY_S = 10.0


class LocalPrefills:
    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics
        self._logged: dict[str, float] = {}  # reason -> when its last warning went out
        self._since: dict[str, int] = {}  # reason -> fall-backs not logged since then

    def record(self, reason: str, request_id: str, detail: str) -> None:
        """Request `request_id`'s prompt is (or was) computed on its decode worker."""
        if reason not in REASONS:
            raise ValueError(f"unknown local prefill reason {reason!r}")
        m = self.metrics
        m.labels(m.local_prefills, reason=reason).inc()
        if reason in DELIBERATE:
            log.debug("local prefill of %s (%s): %s", request_id, reason, detail)
            return
        now = time.monotonic()
        if now - self._logged.get(reason, -LOG_EVERY_S) < LOG_EVERY_S:
            self._since[reason] = self._since.get(reason, 0) + 1
            return
        self._logged[reason] = now
        more = self._since.pop(reason, 0)
        log.warning("local prefill of %s (%s): %s%s", request_id, reason, detail,
                    f" [and {more} more for this reason since the last such line]"
                    if more else "")


def why_no_prefill(registry: Registry) -> tuple[str, str]:
    """Why no prefill worker is usable (`registry.prefills()` is empty): the reason, and
    what the registry saw."""
    if not registry.prefill:
        return "no_prefill_worker", "none configured or found"
    up = [p for p in registry.prefill if p.state == "up"]
    if not up:
        return "prefill_down", "prefill workers: " + states(registry.prefill)
    now, seen = time.monotonic(), []
    for p in up:
        eid = p.engine_id
        if eid is None:  # up: it has answered a poll, which names its engine
            continue
        for d in (d for d in registry.decode if d.state == "up"):
            key = (d.address, eid)
            if d.pairs.get(eid):
                why = f"refused: {d.pairs[eid]}"
            elif key in registry.connecting:
                why = f"handshake under way for {now - registry.connecting[key][1]:.1f} s"
            else:
                why = registry.handshake_errors.get(key, "not paired yet")
            seen.append(f"{p.address} ({p.engine_id}) with {d.address}: {why}")
    return "prefill_unpaired", "; ".join(seen) or "no decode worker is up"
