"""The engine's LoRA adapters by name: loaded at start or at run time, found for each
request, unloaded once no request runs them.

    load(name, path)     read and check the operator's directory now (ValueError says
                         why not); an offline request may also name a path, read on its
                         first use here
    read(name, path)     read a directory a caller sent (the router's load, or the path
                         it sends with a request): only beneath --lora-root where the
                         engine has one, and refused with paths.py's one message
                         wherever it cannot be read (the reason goes to the log); the
                         engine's own --lora-modules paths are the operator's
    resolve(request)     the name a request runs under; ValueError for an adapter this
                         engine neither holds nor may read
    unload(name)         new requests cannot name it; the ones running finish with it

A request runs a *binding* of a name: the weights the name had when it arrived, under a
key (`Request.lora_name`) that names its device slot and goes into its block hashes. The
first weights a name is bound to are keyed by the name itself (the key the router hashes
with); other weights bound to it later, by the name and their fingerprint. So a name
loaded again with new weights never meets the KV, or the slot, of the old ones, and the
requests running the old ones finish with them.

Versions (the router's count of its loads of a name) order the bindings: a read for an
older version than the one bound is dropped when it lands (a slow read of a request must
not undo a reload), and a request carrying a newer one rebinds (a worker that missed a
reload catches up). Offline loads carry none (0): the last one wins.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ..common.errors import NotFound
from ..engine.model_config import ModelConfig
from .adapter import LoRAAdapter, LoRARequest, load_adapter
from .names import check_name, parse_lora_module, shown
from .paths import Unreadable, beneath
from .slots import LoraSlots

log = logging.getLogger(__name__)


class EngineLoras:
    def __init__(self, slots: LoraSlots | None, model_config: ModelConfig,
                 live: Callable[[], set[str | None]], modules: tuple[str, ...] = (),
                 root: str | None = None):
        """`live`: the binding keys of the requests this engine holds now; `modules`:
        "name=path" entries, loaded now; `root`: where a caller's paths must lie."""
        if root is not None and not os.path.isdir(root):
            raise ValueError(f"lora_root {root!r} is not a directory")
        self.slots = slots
        self.root = root
        self.model_config = model_config
        self.live = live
        self.paths: dict[str, str] = {}  # name -> path, of every adapter it may serve
        self.keys: dict[str, str] = {}  # name -> the key of its current binding
        self.first: dict[str, str] = {}  # name -> the fingerprint it was first bound to
        self.versions: dict[str, int] = {}  # name -> the version of its current binding
        self.unloading: set[str] = set()  # keys held until the requests running them end
        self.sent: set[str] = set()  # names bound to a path a caller sent
        specs = [parse_lora_module(spec) for spec in modules]
        # The operator's paths: the router sends its --lora-modules with requests too.
        self.own = {path for _, path in specs}
        for name, path in specs:
            self.load(name, path)

    @property
    def enabled(self) -> bool:
        return self.slots is not None

    def names(self) -> list[str]:
        return sorted(self.paths)

    def _need(self) -> LoraSlots:
        if self.slots is None:
            raise ValueError("LoRA adapters are off on this engine (start it with "
                             "--enable-lora)")
        return self.slots

    def load(self, name: str, path: str, version: int = 0) -> None:
        """Read, check and hold the operator's adapter now; the same name again rebinds
        it."""
        self.keep(self.read(name, path, sent=False), version)

    def read(self, name: str, path: str, sent: bool = True) -> LoRAAdapter:
        """Read and check an adapter (any thread: it touches nothing of the engine's).
        `sent`: the path came from a caller (see the module doc); else the operator's."""
        slots = self._need()
        check_name(name)
        sent = sent and not (isinstance(path, str) and path in self.own)
        try:
            if not isinstance(path, str) or not path:
                raise Unreadable("no path")
            if sent and self.root is not None:
                path = beneath(self.root, path)
            adapter = load_adapter(name, path, self.model_config, slots.max_rank,
                                   slots.a["qkv"][0].dtype, self.root if sent else None)
        except Unreadable as e:
            if not sent:
                raise ValueError(f"LoRA adapter {name!r}: {e.reason}") from None
            log.warning("LoRA adapter %s refused: %s", shown(name), e.reason)
            raise Unreadable(e.reason) from None
        adapter.sent = sent
        return adapter

    def keep(self, adapter: LoRAAdapter, version: int = 0) -> bool:
        """Hold an adapter `read` returned, and serve it under its name (engine thread);
        False (nothing changed) if a newer version of the name is bound meanwhile."""
        name = adapter.name
        if name in self.paths and version < self.versions.get(name, 0):
            return False
        first = self.first.setdefault(name, adapter.fingerprint)
        adapter.key = name if adapter.fingerprint == first else \
            f"{name}\0{adapter.fingerprint[:16]}"
        old = self.keys.get(name)
        slots = self._need()
        held = slots.adapters.get(adapter.key)
        if held is None or held.fingerprint != adapter.fingerprint:  # else: held already
            slots.hold(adapter, self.live())
        self.paths[name], self.keys[name] = adapter.path, adapter.key
        (self.sent.add if adapter.sent else self.sent.discard)(name)
        self.versions[name] = version
        self.unloading.discard(adapter.key)
        if old is not None and old != adapter.key:  # the old weights end with their requests
            self.unloading.add(old)
            self.sweep()
        return True

    def holds(self, name: str, version: int = 0) -> bool:
        """Served (at `version` or a newer one) and in host memory: a request naming it
        needs no read. (Read from the event loop too: a snapshot, never a KeyError.)"""
        key = self.keys.get(name)
        return (key is not None and self.slots is not None and key in self.slots.adapters
                and self.versions.get(name, 0) >= version)

    def unload(self, name: str) -> bool:
        """False if it is not served here. It is dropped at once if nothing runs it, else
        after its last request (sweep)."""
        if self.paths.pop(name, None) is None:
            return False
        self.sent.discard(name)
        self.unloading.add(self.keys.pop(name))
        self.versions.pop(name, None)
        self.sweep()
        return True

    def sweep(self) -> None:
        """Drop unloaded bindings that no request runs any more (engine thread, after a
        request ends)."""
        if not self.unloading:
            return
        live = self.live()
        for key in [k for k in self.unloading if k not in live]:
            self.unloading.discard(key)
            if key not in self.keys.values():
                self._need().drop(key)

    def resolve(self, lora: LoRARequest | None) -> str | None:
        """The binding key a new request runs (None: the base model), its adapter read now
        if the engine does not hold it, so the step never touches the disk."""
        if lora is None or not lora.lora_name:
            return None
        self._need()
        name = check_name(lora.lora_name)
        if not self.holds(name):
            if lora.lora_path:  # the request's own (a worker's request: a caller's)
                path, sent = lora.lora_path, lora.sent
            elif name in self.paths:  # dropped for room: read again, as it was first read
                path, sent = self.paths[name], name in self.sent
            else:
                raise NotFound(f"LoRA adapter {name!r} is not loaded here")
            self.keep(self.read(name, path, sent), self.versions.get(name, 0))
        return self.keys[name]
