"""The router's LoRA registry (router/lora/registry.py) against fake workers: a load is all the
workers' or none's, an unload reaches every worker, and a request naming an adapter not
served is NOT_FOUND before any worker is called; the block hashes the router routes on
fold in the adapter exactly as the engine's do."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from baton.router.clients import WorkerError
from baton.router.kv_index import PromptBlocks
from baton.router.lora.registry import RouterLoras
from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.block_pool import BlockPool
from baton.services.engine.kv_cache_manager import KVCacheManager
from baton.services.engine.request import Request
from baton.services.rpc.errors import FailedPrecondition, InvalidArgument, Missing


class FakeClient:
    def __init__(self, refuse: str | None = None):
        """`refuse`: a load of a path holding this text is refused."""
        self.refuse, self.held, self.paths = refuse, set(), {}

    async def load_lora(self, name, path, version, timeout):
        if self.refuse and self.refuse in path:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, f"{path}: bad rank")
        self.held.add(name)
        self.paths[name] = (path, version)

    async def unload_lora(self, name, timeout):
        had = name in self.held
        self.held.discard(name)
        return had


def _registry(*clients, down=()):
    return SimpleNamespace(workers=[
        SimpleNamespace(address=f"w{i}", state="down" if i in down else "up", client=c)
        for i, c in enumerate(clients)])


def test_a_load_refused_by_one_worker_is_undone_on_the_others():
    ok, bad = FakeClient(), FakeClient(refuse="/bad")
    loras = RouterLoras(enabled=True, runtime_updates=True, root="/")
    with pytest.raises(InvalidArgument, match="bad rank"):
        asyncio.run(loras.load(_registry(ok, bad), "x", "/bad"))
    assert ok.held == set() and loras.names() == []
    with pytest.raises(Missing):
        loras.adapter("x")


def test_a_refused_reload_puts_the_old_directory_back_at_a_newer_version():
    ok, picky = FakeClient(), FakeClient(refuse="/new")
    loras = RouterLoras(enabled=True, modules=("x=/old",), runtime_updates=True, root="/")
    registry = _registry(ok, picky)
    first = loras.adapter("x").version
    with pytest.raises(InvalidArgument):
        asyncio.run(loras.load(registry, "x", "/new"))
    path, version = ok.paths["x"]
    assert path == "/old" and version > first  # newer than the refused /new's
    assert (loras.adapter("x").path, loras.adapter("x").version) == ("/old", version)


def test_load_reaches_every_worker_that_is_up_and_unload_every_one():
    a, b, down = FakeClient(), FakeClient(), FakeClient()
    loras = RouterLoras(enabled=True, modules=("m=/m",), runtime_updates=True, root="/")
    registry = _registry(a, b, down, down={2})
    asyncio.run(loras.load(registry, "x", "/a"))
    v1 = loras.adapter("x").version
    asyncio.run(loras.load(registry, "x", "/a"))  # again: a newer version, sent along
    v2 = loras.adapter("x").version
    assert v2 > v1 and a.paths["x"] == b.paths["x"] == ("/a", v2)
    assert a.held == b.held == {"x"} and down.held == set()
    assert loras.names() == ["m", "x"]
    assert (loras.adapter("x").name, loras.adapter("x").path) == ("x", "/a")
    assert loras.adapter("m").version < v1  # --lora-modules' came first
    assert loras.adapter("") is None  # the base model
    asyncio.run(loras.unload(registry, "x"))
    assert a.held == b.held == set() and loras.names() == ["m"]
    with pytest.raises(Missing):
        asyncio.run(loras.unload(registry, "x"))


def test_off_and_bad_names_are_refused_before_any_worker_is_called():
    a = FakeClient()
    with pytest.raises(FailedPrecondition, match="--enable-lora"):
        asyncio.run(RouterLoras().load(_registry(a), "x", "/a"))
    with pytest.raises(FailedPrecondition, match="--allow-runtime-lora-updating"):
        asyncio.run(RouterLoras(enabled=True).load(_registry(a), "x", "/a"))
    with pytest.raises(FailedPrecondition, match="--allow-runtime-lora-updating"):
        asyncio.run(RouterLoras(enabled=True, modules=("x=/x",)).unload(_registry(a), "x"))
    on = RouterLoras(enabled=True, runtime_updates=True, root="/")
    with pytest.raises(ValueError, match="name"):
        asyncio.run(on.load(_registry(a), "no spaces", "/a"))
    with pytest.raises(ValueError, match="base model"):
        asyncio.run(on.load(_registry(a), "tiny", "/a", reserved=("tiny",)))
    with pytest.raises(ValueError, match="lora_path"):
        asyncio.run(on.load(_registry(a), "x", "/" * 5000))
    with pytest.raises(Missing, match="--enable-lora"):
        RouterLoras().adapter("x")
    assert a.held == set()
    with pytest.raises(ValueError, match="name=path"):
        RouterLoras(enabled=True, modules=("just-a-name",))


def test_the_router_hashes_an_adapters_blocks_as_the_engine_does():
    ids = list(range(1000, 1000 + 16 * 3 + 2))
    hashes = {}
    for salt, lora in (("", ""), ("", "x"), ("t", "x"), ("", "y")):
        kv = KVCacheManager(BlockPool(8), 16)
        req = Request("r", ids, SamplingParams(max_tokens=1), (2,), cache_salt=salt,
                      lora_name=lora)
        assert kv.allocate_slots(req, len(ids))
        assert req.block_hashes == PromptBlocks(ids, salt, lora).hashes(16)
        hashes[salt, lora] = set(req.block_hashes)
        kv.free(req)
    groups = list(hashes.values())
    assert all(not (g & h) for i, g in enumerate(groups) for h in groups[i + 1:])


def test_a_worker_that_serves_the_adapter_costs_less_than_one_that_must_read_it():
    from baton.router.policy import Policy
    from baton.router.registry import Worker
    from baton.worker.v1 import worker_pb2 as wk

    has, lacks = (Worker(a, "decode", None, state="up",
                         stats=wk.GetStatsResponse(lora_adapters=held))
                  for a, held in (("has", ["x"]), ("lacks", ["y"])))
    policy = Policy(kv_weight=0.0)  # load alone: the adapter is all that differs
    for_x, base = PromptBlocks([1, 2, 3], "", "x"), PromptBlocks([1, 2, 3])
    assert policy.cost(has, for_x) < policy.cost(lacks, for_x)
    assert policy.cost(has, base) == policy.cost(lacks, base)
    lacks.stats.num_running = 2
    assert policy.cost(lacks, for_x) > policy.cost(has, for_x)
    has.stats.num_running = 4  # busier by more than a read costs: the other one wins
    assert policy.cost(has, for_x) > policy.cost(lacks, for_x)
