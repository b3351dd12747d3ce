"""The workers the router knows: their state from stats polls, their load, and which
prefill engines each decode worker has shaken hands with.

A worker's state, from its polls:

    up        answers, not draining: takes new requests
    draining  answers with `draining`: no new requests, but what it holds goes on (a
              prefill worker's handles are still pulled: its pairs are kept)
    down      a poll refused, or unanswered for `worker_timeout_s` (dead, frozen,
              unreachable), or answered with `engine_stalled_since` (its engine thread
              stuck): calls in flight to it are failed, so their requests move on (the
              failure rules apply)

Pairs are keyed by the prefill *engine id* (from its stats): a handle names the engine
that holds its KV, and a restarted worker comes back under a new id, to be paired anew.
The handshakes start as soon as a poll finds the worker up; until one ends, a request
that finds no other prefill worker waits for them (`pairing`, at most PAIRING_WAIT_S after
a handshake began) rather than having its prompt computed on a decode worker. Once the
router has been ready, pairing never makes it not ready again: its decode workers serve
meanwhile.

A worker's load (worker.py: its last stats plus what was routed to it since) counts in
both prefill and decode picks. Each poll also brings the worker's KV events into its
prefix index; picks weigh cached prefix against load (policy.py).

Workers come from fixed addresses or from DNS names (discovery.py), resolved again every
`discovery_interval` seconds: new addresses join (polled, then paired), vanished ones are
retired: no new request goes there, calls in flight go on (or fail over, as from any
worker), and their channel closes once none is left. A name that answers nothing at all
(NXDOMAIN, no records) after it had workers keeps them `discovery_grace` seconds first:
a DNS blip must not retire the whole cluster at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from collections.abc import Set as AbstractSet

from .clients import WorkerClient, WorkerError
from .config import RouterConfig
from .discovery import Target, resolve
from .kv_index import PromptBlocks
from .policy import Policy
from .worker import Worker

log = logging.getLogger(__name__)

# How long after a handshake began a request still waits for it: a NIXL handshake ends
# with a first transfer that sets the connection up (about half a second, more on a
# loaded host); one that runs longer has the requests after it fall back meanwhile.
PAIRING_WAIT_S = 3.0


class Registry:
    def __init__(self, prefill: list[Worker], decode: list[Worker], poll_s: float = 0.5,
                 worker_timeout_s: float = 3.0,
                 on_ready: Callable[[bool, str], Awaitable[None]] | None = None,
                 policy: Policy | None = None, targets: dict[str, list[Target]] | None = None,
                 make_client: Callable[[str], WorkerClient] | None = None,
                 discovery_interval: float = 2.0,
                 discovery_grace: float = RouterConfig.discovery_grace):
        self.prefill = prefill
        self.decode = decode
        self.poll_s = poll_s
        self.worker_timeout_s = worker_timeout_s
        self.on_ready = on_ready  # told (ready, why) whenever readiness changes
        self.policy = policy or Policy()
        self.targets = targets or {}  # role -> where its workers are found
        self.make_client = make_client  # address -> a client for it
        self.discovery_interval = discovery_interval
        self.discovery_grace = discovery_grace
        self.retired: list[Worker] = []  # gone from discovery, calls still in flight
        self._resolved: dict[str, list[str]] = {}  # target -> its addresses, last lookup
        self._empty_since: dict[str, float] = {}  # target -> when it began to answer none
        self.on_refresh: Callable[[], None] | None = None  # after every round of polls
        self._ready: tuple[bool, str] | None = None
        self._task: asyncio.Task | None = None
        self._discovery: asyncio.Task | None = None
        # Handshakes under way, (decode address, prefill engine id) -> (task, when it
        # began); and the last failure of each that failed (and may be tried again).
        self.connecting: dict[tuple[str, str], tuple[asyncio.Task, float]] = {}
        self.handshake_errors: dict[tuple[str, str], str] = {}
        self._was_ready = False

    @property
    def workers(self) -> list[Worker]:
        return self.prefill + self.decode

    def model_info(self):
        for w in self.workers:
            if w.stats is not None and w.state != "down":
                return w.stats.model_info
        return None

    async def start(self) -> None:
        """The first lookups, poll, and handshakes (so the first requests are
        disaggregated); then polls every poll_s and lookups every discovery_interval."""
        await self.discover()
        await self.refresh()
        await self.handshakes(timeout=30)
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop())
        if any(t.dns for ts in self.targets.values() for t in ts):
            self._discovery = loop.create_task(self._discover_loop())

    async def _discover_loop(self) -> None:
        while True:
            await asyncio.sleep(self.discovery_interval)
            try:
                await self.discover()
            except Exception:
                log.exception("worker discovery failed")

    async def discover(self) -> None:
        """Resolve every target again: add the workers that appeared, retire those that
        vanished. A target whose lookup failed keeps its workers until the next round; one
        that answers none keeps them for `discovery_grace` seconds."""
        for role, targets in self.targets.items():
            workers = self.prefill if role == "prefill" else self.decode
            found: dict[str, str] = {}  # address -> target
            for t in targets:
                try:
                    self._found(role, t.text, await resolve(t))
                except OSError as e:  # keep what it gave last time
                    log.warning("%s workers: %s; keeping the %d it found before", role, e,
                                len(self._resolved.get(t.text, ())))
                for a in self._resolved.get(t.text, ()):
                    found.setdefault(a, t.text)
            known = {w.address for w in workers}
            for w in [w for w in workers if w.target and w.address not in found]:
                log.info("%s worker %s left %s: retired", role, w.address, w.target)
                workers.remove(w)
                w.state = "retired"  # a pick made before this skips it
                self.retired.append(w)
            for a, text in found.items():
                if a not in known:
                    log.info("%s worker %s found by %s", role, a, text)
                    assert self.make_client is not None  # given with targets (build)
                    workers.append(Worker(a, role, self.make_client(a), target=text))
        for w in [w for w in self.retired if not w.client.busy()]:
            self.retired.remove(w)
            await w.client.close()

    def _found(self, role: str, target: str, addresses: list[str]) -> None:
        """A lookup's answer for `target`; none at all, after some, only past the grace."""
        if addresses or not self._resolved.get(target):
            self._resolved[target] = addresses
            self._empty_since.pop(target, None)
            return
        now = time.monotonic()
        since = self._empty_since.setdefault(target, now)
        if now - since >= self.discovery_grace:
            log.warning("%s workers: %s has answered none for %.0f s: retiring them", role,
                        target, now - since)
            self._resolved[target] = []
            del self._empty_since[target]
        elif since == now:
            log.warning("%s workers: %s answers none; keeping the %d it found before for "
                        "%.0f s", role, target, len(self._resolved[target]),
                        self.discovery_grace)

    async def handshakes(self, timeout: float) -> None:
        """Wait for the handshakes under way (at most `timeout` seconds)."""
        if self.connecting:
            await asyncio.wait([t for t, _ in self.connecting.values()], timeout=timeout)

    async def close(self) -> None:
        for task in (self._task, self._discovery, *(t for t, _ in self.connecting.values())):
            if task is not None:
                task.cancel()
        for w in self.workers + self.retired:
            await w.client.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except Exception:  # keep polling whatever one round hit
                log.exception("worker refresh failed")

    async def refresh(self) -> None:
        """Poll every worker, start the handshakes of new pairs, and say if readiness
        changed. Handshakes run in the background: a slow one never delays the polls
        that notice a dead or frozen worker."""
        await asyncio.gather(*(self._poll(w) for w in self.workers),
                             *(self._poll_retired(w) for w in self.retired))
        self._pair()
        if self.on_refresh is not None:
            self.on_refresh()
        await self._tell_readiness()

    def _pair(self) -> None:
        """Start the handshakes of every up decode worker with every up prefill engine it
        has not paired with (nor been refused by), unless under way."""
        by_id = {p.engine_id: p for p in self.prefill
                 if p.state == "up" and p.engine_id is not None}
        for d in self.decode:
            if d.state != "up":
                continue
            for eid, p in by_id.items():
                key = (d.address, eid)
                if eid not in d.pairs and key not in self.connecting:
                    task = asyncio.get_running_loop().create_task(self._connect(d, p, eid))
                    self.connecting[key] = (task, time.monotonic())
                    task.add_done_callback(lambda _, k=key: self.connecting.pop(k, None))

    async def pairing(self, timeout: float) -> None:
        """While no prefill worker is usable but handshakes with an up one are under way
        (it just started, or restarted under a new engine id), wait for them: at most
        `timeout`, and never past PAIRING_WAIT_S after the latest began."""
        deadline = time.monotonic() + timeout
        while not self.prefills():
            now, up = time.monotonic(), {p.engine_id for p in self.prefill if p.state == "up"}
            waits = {task: began for (_, eid), (task, began) in self.connecting.items()
                     if eid in up}
            until = min(deadline, max(waits.values(), default=now) + PAIRING_WAIT_S)
            if not waits or until <= now:
                return
            await asyncio.wait(list(waits), timeout=until - now,
                               return_when=asyncio.FIRST_COMPLETED)

    async def _tell_readiness(self) -> None:
        ready = self.readiness()
        self._was_ready |= ready[0]
        if ready != self._ready:
            self._ready = ready
            log.log(logging.INFO if ready[0] else logging.WARNING, "router %s: %s",
                    "ready" if ready[0] else "not ready", ready[1])
            if self.on_ready is not None:
                await self.on_ready(*ready)

    async def _poll(self, w: Worker) -> None:
        try:
            stats = await w.client.stats(timeout=self.worker_timeout_s)
        except WorkerError as e:
            # Refused at once (dead), or no answer within worker_timeout_s (frozen).
            self._down(w, e.code.name)
            return
        if stats.engine_stalled_since:  # it answers, but its engine no longer steps
            self._down(w, f"its engine stalled at {time.ctime(stats.engine_stalled_since)}")
            return
        if w.engine_id is not None and stats.engine_id != w.engine_id:
            log.info("%s worker %s restarted as %s", w.role, w.address, stats.engine_id)
            w.pairs.clear()  # a decode worker's handshakes died with its old engine
            w.index.reset()  # and its cache with it
            w.kv_events = True  # the new one may answer them
        state = "draining" if stats.draining else "up"
        came = state != w.state or stats.engine_id != w.engine_id  # up anew, or restarted
        if state != w.state:
            log.info("%s worker %s is %s (%s)", w.role, w.address, state, stats.engine_id)
        w.stats, w.state, w.last_seen = stats, state, time.monotonic()
        w.routed = w.routed_tokens = 0
        if came and state == "up":
            self._pair()  # now: a request may come before this round of polls ends
        if w.kv_events and self.policy.uses_kv:
            await self._kv_events(w)
        if w.role == "prefill":  # forget pairs with engines no prefill worker runs now
            live = {p.engine_id for p in self.prefill}
            for d in self.decode:
                for eid in [e for e in d.pairs if e not in live]:
                    del d.pairs[eid]

    def _down(self, w: Worker, why: str) -> None:
        if w.state != "down":
            if w.state != "unknown":
                log.warning("%s worker %s is down: %s", w.role, w.address, why)
            w.state = "down"
            w.client.fail_inflight()  # those requests move on, as from a dead worker

    async def _poll_retired(self, w: Worker) -> None:
        """A retired worker is polled only so that, frozen, it still fails its calls."""
        try:
            stats = await w.client.stats(timeout=self.worker_timeout_s)
        except WorkerError:
            w.client.fail_inflight()
            return
        if stats.engine_stalled_since:
            w.client.fail_inflight()

    async def _kv_events(self, w: Worker) -> None:
        try:
            reply = await w.client.kv_events(w.index.engine_id, w.index.seq,
                                             timeout=self.worker_timeout_s)
        except WorkerError as e:
            if e.code.name == "UNIMPLEMENTED":
                w.kv_events = False  # an older worker: routed on load alone
            return  # else the next poll tries again (and notices a dead worker)
        w.index.apply(reply)

    async def _connect(self, d: Worker, p: Worker, engine_id: str) -> None:
        """Ask the decode worker to shake hands with the prefill worker. FAILED_PRECONDITION
        (layouts differ) marks the pair unusable for good; other errors retry next poll."""
        key = (d.address, engine_id)
        try:
            reply = await d.client.connect(p.address)
        except WorkerError as e:
            if e.code.name == "FAILED_PRECONDITION":
                d.pairs[engine_id] = e.details
                log.error("decode %s cannot take KV from prefill %s: %s", d.address,
                          p.address, e.details)
            elif self.handshake_errors.get(key) != str(e):  # each new error once
                log.warning("decode %s could not pair with prefill %s (%s): %s; again at "
                            "the next poll", d.address, p.address, engine_id, e)
            self.handshake_errors[key] = str(e)
            return
        self.handshake_errors.pop(key, None)
        d.pairs[reply.prefill_engine_id] = None
        await self._tell_readiness()

    def readiness(self) -> tuple[bool, str]:
        """Whether a request can be served now, and why not. A decode worker alone can
        serve (it prefills itself). While prefill workers are up and their handshakes are
        still pending, not yet: the first requests would not be disaggregated."""
        decodes = [d for d in self.decode if d.state == "up"]
        if not decodes:
            return False, "no decode worker is up: " + states(self.decode)
        prefills = [p for p in self.prefill if p.state == "up"]
        pending = [p for p in prefills if any(p.engine_id not in d.pairs for d in decodes)]
        usable = self.prefills()
        if pending and not usable and not self._was_ready:
            return False, "pairing the decode workers with the prefill workers"
        errors = sorted({e for d in decodes for e in d.pairs.values() if e})
        return True, (f"{len(usable)} prefill and {len(decodes)} decode workers usable"
                      + (f"; pairing with {len(pending)} prefill workers" if pending else "")
                      + (f"; unusable pairs: {'; '.join(errors)}" if errors else ""))

    def prefills(self, prompt: PromptBlocks | None = None) -> list[Worker]:
        """Prefill workers that take new requests and that some decode worker can pull
        from (else their work would be thrown away), cheapest for `prompt` first."""
        paired = {eid for d in self.decode if d.state == "up"
                  for eid, error in d.pairs.items() if error is None}
        return sorted((w for w in self.prefill if w.state == "up" and w.engine_id in paired),
                      key=lambda w: self.policy.cost(w, prompt))

    def local_prefill(self, prompt: PromptBlocks) -> tuple[Worker | None, str | None]:
        """The decode worker that should compute `prompt` itself (conditional
        disaggregation), if the cheapest one for it holds enough of it, and why."""
        decodes = [d for d in self.decode if d.state == "up"]
        prefills = self.prefills()
        if not decodes or not (prefills or self.policy.disaggregation == "never"):
            return None, None  # without a prefill worker, the decode pick decides anyway
        best = min(decodes, key=lambda w: self.policy.cost(w, prompt))
        why = self.policy.local_prefill(best, prompt, prefills)
        return (best if why else None), why

    def pick_decode(self, engine_id: str | None, exclude: AbstractSet[str] = frozenset(),
                    prompt: PromptBlocks | None = None, prefer: Worker | None = None
                    ) -> tuple[Worker, bool]:
        """The cheapest decode worker for `prompt` that takes new requests, not in
        `exclude` (`prefer`, if it still takes them), and whether it has paired with
        prefill engine `engine_id` (so it can pull a handle from there). Paired workers
        first; with none paired, any (it will recompute the prompt). LookupError says why
        there is none."""
        decodes = [d for d in self.decode if d.state == "up" and d.address not in exclude]
        if not decodes:
            tried = f" (excluded: {', '.join(sorted(exclude))})" if exclude else ""
            raise LookupError("no decode worker can take the request: "
                              + states(self.decode) + tried)
        paired = [d for d in decodes if engine_id and d.pairs.get(engine_id, "") is None]
        if prefer in decodes and (prefer in paired or not paired):
            d = prefer
        else:
            d = min(paired or decodes, key=lambda w: self.policy.cost(w, prompt, tiers=False))
        d.routed += 1
        return d, bool(paired)


def states(workers: list[Worker]) -> str:
    return ", ".join(f"{w.address} {w.state}" for w in workers) or "none configured"
