"""The KV offload tiers on the tiny serving model: the same tokens with and without them
under eviction and preemption, every tier's files accounted for, a restart that finds its
prefixes on disk, two engines sharing the host tier (and tenants kept apart), and a disk
block corrupted on purpose that is recomputed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from baton.services.engine import SamplingParams
from baton.services.engine.kv_connector.offload import OffloadConnector
from tests.integration.engine_helpers import kv_gib

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
POOL_BLOCKS = 48  # the prompts below need about 4x that


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(100, 40000) for _ in range(n)]


def _prompts(seed: int = 1, tenants: int = 6, each: int = 3) -> list[list[int]]:
    """Tenants' 128-token prefixes (8 blocks), each followed by a few unique tokens, in
    an order that comes back to every tenant after the others have evicted it."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, 128) for _ in range(tenants)]
    return [prefixes[t] + _ids(rng, 5) for _ in range(each) for t in range(tenants)]


def _engine(make_llm, tiny_model, **tiers):
    return make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=256,
                    max_num_seqs=4, kv_cache_gib=kv_gib(tiny_model, POOL_BLOCKS), **tiers)


def _offload(llm) -> OffloadConnector:
    conn = next(c for c in llm.engine.connectors if c.name == "offload")
    assert isinstance(conn, OffloadConnector)
    return conn


def _settle(llm) -> dict[str, int]:
    """Wait for the saves behind the last steps; every tier within budget, every file
    whole; every pool block free. The connector's counters."""
    conn = _offload(llm)
    assert conn.drain()
    for tier in conn.tiers:
        tier.check()
        assert tier.used_bytes() <= tier.budget_bytes
    llm.engine.pool.check_all_free()
    return conn.stats()


@pytest.fixture(scope="module")
def plain(make_llm, tiny_model):
    return _engine(make_llm, tiny_model)


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return [o.token_ids for o in plain.generate(_prompts(), GREEDY)]


def test_same_tokens_with_the_tiers_under_eviction_and_preemption(make_llm, tiny_model,
                                                                  reference, tmp_path):
    # The disk tier holds about half the prefixes: it evicts too.
    llm = _engine(make_llm, tiny_model, kv_offload_gib=0.05,
                  kv_offload_host_path=str(tmp_path / "host"),
                  kv_offload_disk_path=str(tmp_path / "disk"),
                  kv_offload_disk_gib=kv_gib(tiny_model, 30))
    prompts = _prompts()
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == reference
    stats = _settle(llm)
    assert stats["host_hits"] > 0  # evicted prefixes came back from the host tier
    assert llm.engine.scheduler.num_preemptions > 0 or llm.engine.pool.num_evictions > 0
    host, disk = _offload(llm).tiers
    assert disk.stats.evictions > 0 and disk.used_bytes() <= disk.budget_bytes
    # Each eviction was told to the routers: what the events say the disk holds is
    # what it holds.
    told = set(llm.engine.kv_events.read(0).tiers["disk"].stored)
    assert told == {bytes.fromhex(k.split("/")[1]) for k in disk.keys()}
    # Only the tiers: the pool forgets, and again the same tokens.
    llm.engine.reset_prefix_cache()
    again = llm.generate(prompts[:6], GREEDY)
    assert [o.token_ids for o in again] == reference[:6]
    assert _settle(llm)["host_hits"] > stats["host_hits"]


def _first_on_disk(make_llm, tiny_model, tmp_path):
    """An engine with a disk tier that has run the first prompt, its saves written; and
    the settings of that tier."""
    disk = dict(kv_offload_disk_path=str(tmp_path / "disk"),
                kv_offload_disk_gib=kv_gib(tiny_model, 400))
    first = _engine(make_llm, tiny_model, **disk)
    first.generate(_prompts()[:1], GREEDY)
    _settle(first)
    return disk, first


def test_a_restarted_engine_finds_its_prefixes_on_disk(make_llm, tiny_model, reference,
                                                       tmp_path):
    disk, first = _first_on_disk(make_llm, tiny_model, tmp_path)
    first.engine.close()
    second = _engine(make_llm, tiny_model, **disk)
    # The routers learn at once what its disk holds (KV events, medium "disk").
    told = second.engine.kv_events.read(0).tiers["disk"].stored
    assert set(_hashes(_prompts()[0])[:8]) <= set(told)
    out = second.generate(_prompts()[:1], GREEDY)
    assert [o.token_ids for o in out] == reference[:1]
    assert _settle(second)["disk_hits"] == 8  # the whole 128-token prefix
    assert dict(second.engine.stats().kv_offload)["disk_hits"] == 8  # GetStats, metrics


def test_two_engines_share_the_host_tier_and_tenants_stay_apart(make_llm, tiny_model,
                                                                tmp_path):
    host = dict(kv_offload_gib=0.05, kv_offload_host_path=str(tmp_path / "shm"))
    a = _engine(make_llm, tiny_model, **host)
    b = _engine(make_llm, tiny_model, **host)
    prompt = _prompts()[:1]
    tenant = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a.generate(prompt, tenant, cache_salt="tenant-a")
    _settle(a)
    b.generate(prompt, tenant, cache_salt="tenant-b")
    assert _settle(b).get("host_hits", 0) == 0  # another tenant's prefix is no hit
    b.generate(prompt, tenant, cache_salt="tenant-a")
    assert _settle(b)["host_hits"] == 8  # the same tenant's is, computed on the other


def test_a_corrupted_disk_block_is_recomputed(make_llm, tiny_model, reference, tmp_path):
    disk, first = _first_on_disk(make_llm, tiny_model, tmp_path)
    store = _offload(first).tiers[0]
    # The prefix's fourth block: flip one byte in the middle of its payload.
    conn = _offload(first)
    first.engine.close()
    req_hashes = _hashes(_prompts()[0])
    victim = Path(store.path(conn._keys(req_hashes[3])[0]))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    second = _engine(make_llm, tiny_model, **disk)
    out = second.generate(_prompts()[:1], GREEDY)
    assert [o.token_ids for o in out] == reference[:1]
    stats = _settle(second)
    assert stats["disk_hits"] == 3  # the blocks before the corrupt one
    # A flipped payload byte fails the MAC: counted as forged (damage looks the same).
    assert _offload(second).tiers[0].stats.forged == stats["disk_forged"] == 1
    assert second.engine.scheduler.loads.num_blocks_recomputed == 5


def _hashes(token_ids: list[int]) -> list[bytes]:
    from baton.services.common.block_hash import extend_hashes

    out: list[bytes] = []
    extend_hashes(out, token_ids, 16)
    return out


def test_a_decode_worker_stacks_the_pull_and_the_tiers(make_llm, tiny_model, reference,
                                                       tmp_path):
    """pd, then offload: the blocks a decode engine pulled from its prefill engine go to
    the host tier, where an engine that never saw the prompt finds them."""
    from baton.kv_transfer.base import KVHandle
    from baton.kv_transfer.fake import FakeConnector

    host = dict(kv_offload_gib=0.05, kv_offload_host_path=str(tmp_path / "shm"))
    p = _engine(make_llm, tiny_model).engine
    made = {}

    def receiver(layout, kv_caches):
        made["fake"] = FakeConnector("decode-0", layout, kv_caches)
        return made["fake"]

    d = _engine(make_llm, tiny_model, kv_receiver=receiver, **host)
    assert [c.name for c in d.engine.connectors] == ["pd", "offload"]
    sender = FakeConnector("prefill-0", p.kv_layout, p.rank_kv_caches)
    made["fake"].add_peer("prefill-0", p.kv_layout, sender.metadata())
    prompt = _prompts()[0]
    p.add_request(prompt, GREEDY, request_id="r", kv_hold=True)
    outs = []
    while p.has_unfinished_requests():
        outs += [o for o in p.step() if o.request_id == "r"]
    o = outs[-1]  # its first token, its blocks held under a lease
    d.engine.add_remote_request(prompt, o.new_token_ids[0], KVHandle(
        "prefill-0", "r", o.kv_lease_id, tuple(o.kv_block_ids), len(prompt),
        verified=True), GREEDY, request_id="r")
    while d.engine.has_unfinished_requests():
        d.engine.step()
    p.release_lease("r")
    assert d.engine.stats().num_blocks_pulled == -(-len(prompt) // 16)
    assert _settle(d)["host_saves"] == 8  # its 8 full blocks, pulled or computed
    third = _engine(make_llm, tiny_model, **host)
    assert [o.token_ids for o in third.generate([prompt], GREEDY)] == reference[:1]
    assert _settle(third)["host_hits"] == 8
    sender.close()
    made["fake"].close()
