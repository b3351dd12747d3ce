"""The LoRA adapters the router serves, by name: from --lora-modules at start, and loaded
or unloaded at run time (the Generation RPCs and /v1/load_lora_adapter, with
--allow-runtime-lora-updating).

The router keeps each adapter's path and version (its count of loads: it grows with
each) and sends both with every request that names it, so a worker that lacks the
adapter (a new one, one that dropped it for room, or one that missed a reload) reads it
before the request runs, whichever worker the request lands on. A load asks every worker
that is up to read the directory now, so a bad adapter is refused with its reason before
any request names it, and a refused reload puts the old directory back where the new one
was taken; an unload stops new requests at once, and the workers finish the ones
running.

A run-time load's path must lie beneath --lora-root (absolute, or relative to it), checked
here with the router's view of the file system and again by each worker that has the
root; whatever cannot be read for the caller gets services/lora/paths.py's one refusal,
from the router or from a worker alike. Answers name adapters, never their paths.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from baton.services.lora.names import check_name, parse_lora_module, shown
from baton.services.lora.paths import UNREADABLE, Unreadable, beneath
from baton.services.rpc.errors import FailedPrecondition, Missing
from baton.worker.v1 import worker_pb2 as wk

from ..clients import WorkerError
from ..registry import Registry

log = logging.getLogger(__name__)
CALL_TIMEOUT_S = 120.0  # a worker's read of one adapter directory
MAX_PATH_CHARS = 4096


class RouterLoras:
    def __init__(self, enabled: bool = False, modules: tuple[str, ...] = (),
                 runtime_updates: bool = False, root: str | None = None):
        self.enabled = enabled
        self.runtime_updates = runtime_updates  # load and unload at run time
        self.root = root  # where a run-time load's path must lie
        # Versions grow with every load, across restarts too (they start at the clock).
        self._versions = itertools.count(time.time_ns())
        self.paths: dict[str, str] = {}
        self.versions: dict[str, int] = {}
        for spec in modules:
            name, path = parse_lora_module(spec)
            self.paths[name], self.versions[name] = path, next(self._versions)
        self._lock = asyncio.Lock()  # one load or unload at a time

    def names(self) -> list[str]:
        return sorted(self.paths)

    def adapter(self, name: str) -> wk.LoraAdapter | None:
        """What the workers are sent for a request naming `name` (""; None: the base
        model); Missing (NOT_FOUND) before anything is queued if it is not served."""
        if not name:
            return None
        path = self.paths.get(name)
        if path is None:
            raise Missing(f"LoRA adapter {shown(name)} is not served here"
                          + ("" if self.enabled else " (the router runs without "
                             "--enable-lora)"))
        return wk.LoraAdapter(name=name, path=path, version=self.versions[name])

    def _check_updates(self) -> None:
        if not self.enabled:
            raise FailedPrecondition("LoRA adapters are off (start with --enable-lora)")
        if not self.runtime_updates:
            raise FailedPrecondition("loading and unloading LoRA adapters at run time is "
                                     "off (start with --allow-runtime-lora-updating)")

    async def load(self, registry: Registry, name: str, path: str,
                   reserved: tuple[str, ...] = ()) -> None:
        """Every worker that is up reads and checks the adapter; the first refusal (its
        reason: INVALID_ARGUMENT) undoes the others and serves nothing new. `reserved`:
        names it may not take (the base model's)."""
        self._check_updates()
        check_name(name)
        if name in reserved:
            raise ValueError(f"lora_name: {shown(name)} names the base model")
        if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS:
            raise ValueError(f"lora_path: 1 to {MAX_PATH_CHARS} characters")
        if self.root is None:  # RouterConfig refuses that at start
            raise FailedPrecondition("loading LoRA adapters at run time needs --lora-root")
        try:  # the file system, off the event loop
            path = await asyncio.to_thread(beneath, self.root, path)
        except Unreadable as e:
            log.warning("LoRA adapter %s refused: %s", shown(name), e.reason)
            raise
        async with self._lock:
            workers = [w for w in registry.workers if w.state == "up"]
            version = next(self._versions)
            results = await self._load_on(workers, name, path, version)
            failed = [(w, r) for w, r in zip(workers, results, strict=True) if r is not None]
            if not failed:
                self.paths[name], self.versions[name] = path, version
                return
            done = [w for w, r in zip(workers, results, strict=True) if r is None]
            if name in self.paths:  # a refused reload: the old directory back, newer
                self.versions[name] = next(self._versions)
                await self._load_on(done, name, self.paths[name], self.versions[name])
            else:  # nothing of a refused adapter stays loaded
                await self._unload_on(done, name)
            w, err = failed[0]
            log.warning("LoRA adapter %s refused by %s: %s", shown(name), w.address, err)
            if isinstance(err, WorkerError) and err.details == UNREADABLE:
                raise Unreadable(f"refused by {w.address}") from None  # as the router's
            if isinstance(err, WorkerError):
                raise err.as_service_error(f"LoRA adapter {shown(name)}")
            raise err

    async def unload(self, registry: Registry, name: str) -> None:
        """NOT_FOUND if not served; else new requests cannot name it from now on."""
        self._check_updates()
        async with self._lock:
            if self.paths.pop(name, None) is None:
                raise Missing(f"LoRA adapter {shown(name)} is not served here")
            self.versions.pop(name, None)
            await self._unload_on([w for w in registry.workers if w.state == "up"], name)

    async def _load_on(self, workers, name: str, path: str, version: int) -> list:
        """Each worker's refusal (an exception), or None where it loaded."""
        results = await asyncio.gather(
            *(w.client.load_lora(name, path, version, CALL_TIMEOUT_S) for w in workers),
            return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]

    async def _unload_on(self, workers, name: str) -> None:
        results = await asyncio.gather(
            *(w.client.unload_lora(name, CALL_TIMEOUT_S) for w in workers),
            return_exceptions=True)
        for w, r in zip(workers, results, strict=True):
            if isinstance(r, BaseException):  # it drops the adapter when it restarts
                log.warning("unloading LoRA adapter %s on %s failed: %s", shown(name),
                            w.address, r)
