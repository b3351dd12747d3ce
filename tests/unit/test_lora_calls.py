"""A worker's adapter reads (services/lora/calls.py) against a fake engine:
requests that arrive together for an adapter it lacks share one read, and a request at
a newer version than the one held reads it again."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from baton.services.lora import calls as lora_calls
from baton.worker.v1 import worker_pb2 as wk


class FakeLoras:
    enabled = True

    def __init__(self):
        self.reads, self.held = [], {}  # name -> version
        self.lock = threading.Lock()

    def holds(self, name, version=0):
        return name in self.held and self.held[name] >= version

    def read(self, name, path):
        with self.lock:
            self.reads.append((name, path))
        time.sleep(0.05)  # a directory read takes a while: the others arrive meanwhile
        return SimpleNamespace(name=name)

    def keep(self, adapter, version):
        self.held[adapter.name] = version


class FakeAsyncEngine:
    def __init__(self):
        self.engine = SimpleNamespace(loras=FakeLoras())

    async def call(self, fn):
        return fn(self.engine)


def test_requests_together_share_one_read_and_a_newer_version_reads_again():
    aengine = FakeAsyncEngine()
    loras = aengine.engine.loras

    async def main():
        msg = wk.LoraAdapter(name="x", path="/x", version=3)
        got = await asyncio.gather(*(lora_calls.lora_of(aengine, msg) for _ in range(5)))
        assert [g.lora_name for g in got] == ["x"] * 5
        assert loras.reads == [("x", "/x")] and loras.held == {"x": 3}
        await lora_calls.lora_of(aengine, msg)  # held at its version: no read
        await lora_calls.lora_of(aengine, wk.LoraAdapter(name="x", path="/x", version=2))
        assert len(loras.reads) == 1
        await lora_calls.lora_of(aengine, wk.LoraAdapter(name="x", path="/y", version=4))
        assert loras.reads[-1] == ("x", "/y") and loras.held == {"x": 4}

    asyncio.run(main())
