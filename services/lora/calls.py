"""A worker's LoRA calls: the adapter a request names, read off the engine thread when the
engine does not hold it (or holds an older version of it: a reload this worker missed),
so a step never waits on the disk; and the router's load and unload (WorkerService
LoadLora / UnloadLora). Requests that arrive together for an adapter share one read."""

from __future__ import annotations

import asyncio
import weakref

from baton.worker.v1 import worker_pb2 as wk

from ..rpc.errors import FailedPrecondition, InvalidArgument
from ..worker.async_engine import AsyncEngine
from .adapter import LoRARequest

MAX_PATH_CHARS = 4096
# Per engine: (name, path, version) -> the read in flight (event-loop state).
_READS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def lora_of(aengine: AsyncEngine, msg: wk.LoraAdapter | None) -> LoRARequest | None:
    """The engine's LoRARequest for a request's adapter (None: the base model), its
    directory read and held first if the engine lacks it at the request's version. The
    engine itself refuses the rest: LoRA off (INVALID_ARGUMENT), not held and no path
    (NOT_FOUND)."""
    if msg is None or not msg.name:
        return None
    loras = aengine.engine.loras
    if msg.path and loras.enabled and not loras.holds(msg.name, msg.version):
        await load(aengine, msg.name, msg.path, msg.version)
    # The path stays, as a caller's: should an unload land before the request is queued,
    # the engine reads it again, as it read it here, so the request runs as sent.
    return LoRARequest(msg.name, lora_path=msg.path, sent=True)


async def load(aengine: AsyncEngine, name: str, path: str, version: int = 0) -> None:
    loras = aengine.engine.loras
    if not loras.enabled:
        raise FailedPrecondition("LoRA adapters are off on this worker (start it with "
                                 "--enable-lora)")
    if not name or not path:
        raise InvalidArgument("adapter: name and path are required")
    if len(path) > MAX_PATH_CHARS:
        raise InvalidArgument(f"adapter.path: over {MAX_PATH_CHARS} characters")
    reads = _READS.setdefault(aengine, {})
    job = (name, path, version)
    read = reads.get(job)
    if read is None:
        async def read_and_keep():
            adapter = await asyncio.to_thread(loras.read, name, path)
            # Kept unless a newer version was bound meanwhile (registry.py).
            await aengine.call(lambda engine: engine.loras.keep(adapter, version))

        read = reads[job] = asyncio.ensure_future(read_and_keep())
        read.add_done_callback(lambda _: reads.pop(job, None))
    await asyncio.shield(read)


async def unload(aengine: AsyncEngine, name: str) -> bool:
    if not name:
        raise InvalidArgument("name: required")
    return await aengine.call(lambda engine: engine.unload_lora(name))
