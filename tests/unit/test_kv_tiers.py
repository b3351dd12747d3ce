"""KV events per medium (a worker's block pool and its offload tiers) and what the router
makes of them: a prompt finds its pool run, then the tier blocks that continue it, and
the policy weighs a pool hit above a host hit above a disk hit above a miss; a tier's
rejected blocks reach the worker's metrics."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from baton.router.config import RouterConfig
from baton.router.kv_index import TIER_BITS, Hit, PrefixIndex, PromptBlocks
from baton.router.policy import Policy
from baton.services.common.kv_events import DISK, HOST, POOL, TIERS, KvEventLog
from baton.services.engine.outputs import ModelInfo
from baton.services.rpc.server import Lifecycle
from baton.services.worker.messages import kv_events_message
from baton.services.worker.worker_service import WorkerServicer
from baton.worker.v1 import worker_pb2 as wk
from tests.tp_caches import layout, split, whole

BS = 16


def _h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _reply(log: KvEventLog, after: int, engine_id: str = "e1") -> wk.GetKvEventsResponse:
    return kv_events_message(log.read(after), engine_id, BS, True)


def test_each_medium_has_its_own_entry_and_a_read_collapses_per_hash_and_medium():
    log = KvEventLog()
    log.stored(_h(1))
    cursor = log.read(0).seq
    log.stored(_h(1), HOST)  # the same block, offloaded: a second entry
    log.stored(_h(2), DISK)
    log.removed(_h(1))  # evicted from the pool: the host copy stays
    log.stored(_h(3), HOST)
    log.removed(_h(3), HOST)
    log.removed(_h(2), HOST)  # never in host: no event
    log.stored(_h(2), DISK)  # already there: no event
    ev = log.read(cursor)
    assert not ev.snapshot and ev.seq == cursor + 5
    assert ev.stored == [] and ev.removed == [_h(1)]
    assert ev.tiers[HOST].stored == [_h(1)] and ev.tiers[HOST].removed == [_h(3)]
    assert ev.tiers[DISK].stored == [_h(2)] and ev.tiers[DISK].removed == []
    assert (len(log), log.held(HOST), log.held(DISK)) == (0, 1, 1)
    quiet = log.read(ev.seq)
    assert (quiet.stored, quiet.removed, quiet.tiers) == ([], [], {})
    with pytest.raises(ValueError, match="medium"):
        log.stored(_h(4), "remote")


def test_a_snapshot_carries_every_medium_and_a_clear_empties_the_pool_alone():
    log = KvEventLog(capacity=4)
    log.stored(_h(0))
    cursor = log.seq
    for i in range(1, 6):  # tier events alone push the cursor out of the ring
        log.stored(_h(i), HOST if i % 2 else DISK)
    ev = log.read(cursor)
    assert ev.snapshot and ev.stored == [_h(0)] and ev.removed == []
    assert sorted(ev.tiers[HOST].stored) == [_h(1), _h(3), _h(5)]
    assert sorted(ev.tiers[DISK].stored) == [_h(2), _h(4)]
    assert not ev.tiers[HOST].removed and not ev.tiers[DISK].removed
    cursor = ev.seq
    log.cleared()  # a prefix-cache reset: the tiers keep their blocks
    ev = log.read(cursor)
    assert ev.snapshot and ev.stored == [] and len(log) == 0
    assert sorted(ev.tiers[HOST].stored) == [_h(1), _h(3), _h(5)]
    assert sorted(ev.tiers[DISK].stored) == [_h(2), _h(4)]


def test_replayed_events_mirror_every_medium_through_random_use():
    """Whatever the pool and the tiers do, a router applying every poll's events holds
    exactly what each medium holds (its index: pool hashes, and each tier hash's media)."""
    rng = random.Random(11)
    log = KvEventLog(capacity=32)
    held: dict[str, set[bytes]] = {m: set() for m in (POOL, *TIERS)}
    index = PrefixIndex()
    for step in range(4000):
        medium, h = rng.choice((POOL, *TIERS)), _h(rng.randrange(40))
        op = rng.random()
        if op < 0.55:
            log.stored(h, medium)
            held[medium].add(h)
        elif op < 0.995:
            log.removed(h, medium)
            held[medium].discard(h)
        else:
            log.cleared()
            held[POOL].clear()
        if step % rng.choice((1, 5, 40, 300)) == 0:
            index.apply(_reply(log, index.seq))
            assert set(index._held) == held[POOL]
            assert index._tiers == {x: sum(TIER_BITS[m] for m in TIERS if x in held[m])
                                    for x in held[HOST] | held[DISK]}


def _indexed(pool=(), host=(), disk=(), n_blocks: int = 8) -> tuple[PrefixIndex, PromptBlocks]:
    """An index told that the prompt's blocks numbered in each medium are held there."""
    prompt = PromptBlocks(list(range(500, 500 + BS * n_blocks + 3)))
    hashes = prompt.hashes(BS)
    log = KvEventLog()
    for medium, blocks in ((POOL, pool), (HOST, host), (DISK, disk)):
        for b in blocks:
            log.stored(hashes[b], medium)
    index = PrefixIndex()
    index.apply(_reply(log, 0))
    return index, prompt


def test_a_prompt_finds_its_pool_run_then_the_tier_run_that_continues_it():
    index, prompt = _indexed(pool=[0, 1, 5], host=[2, 4, 6], disk=[3, 4, 7])
    # 2 host, 3 disk, 4 both (host first), then 5 is in the pool alone: the run stops.
    assert index.hit(prompt) == Hit(pool=2, host=2, disk=1)
    assert index.match(prompt) == 2
    # A block in the pool counts as the pool's; the tier run starts where the pool's ends.
    index, prompt = _indexed(pool=[0, 1], host=[0, 1, 2], disk=[1, 3])
    assert index.hit(prompt) == Hit(2, 1, 1)
    # No pool run: the tiers from the first block; nothing past the first gap.
    index, prompt = _indexed(host=[0, 2, 3], disk=[1])
    assert index.hit(prompt) == Hit(0, 3, 1)
    index, prompt = _indexed(host=[1, 2, 3])
    assert index.hit(prompt) == Hit()


def test_the_tier_run_never_counts_the_block_with_the_last_token():
    prompt = PromptBlocks(list(range(900, 900 + BS * 3)))  # 3 full blocks, 2 reusable
    log = KvEventLog()
    for h in prompt.hashes(BS):
        log.stored(h, DISK)
    index = PrefixIndex()
    index.apply(_reply(log, 0))
    assert index.hit(prompt) == Hit(0, 0, 2)


def test_tier_events_move_a_block_between_media_and_a_snapshot_replaces_them():
    index, prompt = _indexed(pool=[0], host=[1, 2], disk=[1, 2])
    hashes = prompt.hashes(BS)
    assert index.hit(prompt) == Hit(1, 2, 0)
    index.apply(wk.GetKvEventsResponse(engine_id="e1", seq=index.seq + 1, block_size=BS,
                                       enabled=True, tiers=[
        wk.KvTierEvents(medium=HOST, removed=[hashes[2]]),
        wk.KvTierEvents(medium="remote", stored=hashes[3:6]),  # a newer worker's medium
    ]))
    assert index.hit(prompt) == Hit(1, 1, 1)  # block 2 is on disk still
    # A worker from before tiers (no `tiers`): its snapshot is its pool, nothing else.
    index.apply(wk.GetKvEventsResponse(engine_id="e1", seq=1, snapshot=True, block_size=BS,
                                       enabled=True, stored=hashes[:3]))
    assert index.hit(prompt) == Hit(3, 0, 0) and len(index) == 3
    index.reset()
    assert index.hit(prompt) == Hit() and len(index) == 0


def test_memory_bound_counts_tier_hashes_and_takes_them_first():
    index = PrefixIndex(max_blocks=10)
    log = KvEventLog()
    log.stored(_h(99))
    index.apply(_reply(log, 0))
    for i in range(6):
        log.stored(_h(i), DISK)
        log.stored(_h(i), HOST)  # one entry, two media
    for i in range(6, 12):
        log.stored(_h(i))
    index.apply(_reply(log, index.seq))
    assert len(index) == 10
    assert set(index._held) == {_h(99)} | {_h(i) for i in range(6, 12)}
    assert set(index._tiers) == {_h(3), _h(4), _h(5)}  # the oldest tier hashes went
    for i in range(12, 22):
        log.stored(_h(i))
    index.apply(_reply(log, index.seq))
    assert not index._tiers and set(index._held) == {_h(i) for i in range(12, 22)}


def _worker(index: PrefixIndex) -> SimpleNamespace:
    return SimpleNamespace(index=index, score=0, stats=None)


def test_the_policy_weighs_pool_over_host_over_disk_over_a_miss():
    blocks = range(6)
    workers = {"pool": _indexed(pool=blocks), "host": _indexed(host=blocks),
               "disk": _indexed(disk=blocks), "miss": _indexed()}
    prompt = workers["pool"][1]  # the same tokens every time: the same hashes
    policy = RouterConfig().policy()
    cost = {k: policy.cost(_worker(index), prompt) for k, (index, _) in workers.items()}
    assert cost["pool"] < cost["host"] < cost["disk"] < cost["miss"], cost
    assert cost["miss"] - cost["host"] == pytest.approx(6 * BS * policy.host_weight)
    assert cost["miss"] - cost["disk"] == pytest.approx(6 * BS * policy.disk_weight)
    # The weights are the router's to set: a disk tier worth a pool, a host tier nothing.
    flat = RouterConfig(kv_host_weight=0.0, kv_disk_weight=1.0).policy()
    cost = {k: flat.cost(_worker(index), prompt) for k, (index, _) in workers.items()}
    assert cost["pool"] == cost["disk"] < cost["host"] == cost["miss"], cost
    # Load-only routing sees no tier either.
    load = RouterConfig(routing="load").policy()
    assert len({load.cost(_worker(index), prompt) for index, _ in workers.values()}) == 1
    # A worker with fewer pool blocks but a long tier run beats one with the pool alone.
    mixed, _ = _indexed(pool=[0], host=[1, 2, 3, 4, 5])
    short, _ = _indexed(pool=[0, 1])
    assert Policy().cost(_worker(mixed), prompt) < Policy().cost(_worker(short), prompt)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="kv_host_weight"):
            RouterConfig(kv_host_weight=bad)
        with pytest.raises(ValueError, match="kv_disk_weight"):
            RouterConfig(kv_disk_weight=bad)


def test_the_workers_own_kv_events_carry_the_tiers_over_the_wire():
    """The worker's GetKvEvents (its real servicer, in process), through the wire
    format, into the router's index: the pool as before, each tier as its medium."""
    lay = layout(2, 1)
    log = KvEventLog()
    engine = SimpleNamespace(
        rank_kv_caches=split(lay, whole(lay, 2, seed=0)), kv_layout=lay, kv_events=log,
        config=SimpleNamespace(enable_prefix_caching=True),
        model_info=ModelInfo("m", "LlamaForCausalLM", 64, 100, (2,), 4, "float32"))
    servicer = WorkerServicer(SimpleNamespace(engine=engine), "w-1", "decode", Lifecycle())
    prompt = PromptBlocks(list(range(300, 300 + lay.block_size * 6 + 1)))
    hashes = prompt.hashes(lay.block_size)
    index = PrefixIndex()

    def poll() -> wk.GetKvEventsResponse:
        req = wk.GetKvEventsRequest(engine_id=index.engine_id, after=index.seq)
        reply = asyncio.run(servicer.GetKvEvents(req, None))
        reply = wk.GetKvEventsResponse.FromString(reply.SerializeToString())
        index.apply(reply)
        return reply

    for h in hashes[:2]:
        log.stored(h)
    for h in hashes[2:4]:
        log.stored(h, HOST)
    log.stored(hashes[4], DISK)
    assert poll().snapshot and index.hit(prompt) == Hit(2, 2, 1)
    log.removed(hashes[3], HOST)
    log.stored(hashes[3], DISK)
    log.stored(hashes[5], DISK)
    reply = poll()
    assert not reply.snapshot and list(reply.stored) == []
    assert {t.medium: (list(t.stored), list(t.removed)) for t in reply.tiers} == {
        HOST: ([], [hashes[3]]), DISK: ([hashes[3], hashes[5]], [])}
    assert index.hit(prompt) == Hit(2, 1, 3)


def test_a_decode_pick_counts_the_pool_alone():
    """A decode worker pulls a prefilled prompt, never loads it from its tiers: only its
    pool shortens the pull, so its tier blocks must not draw the request to it."""
    from baton.router.registry import Registry, Worker

    (tiered, prompt), (bare, _) = _indexed(host=range(6)), _indexed()
    policy = RouterConfig().policy()
    decodes = [Worker("bare", "decode", None, state="up", index=bare),  # type: ignore[arg-type]
               Worker("tiered", "decode", None, state="up", index=tiered)]  # type: ignore[arg-type]
    registry = Registry([], decodes, policy=policy)
    assert registry.pick_decode(None, prompt=prompt)[0].address == "bare"  # a tie: the first
    # The same tier blocks do count where the prompt is computed (prefill picks).
    assert policy.cost(decodes[1], prompt) < policy.cost(decodes[0], prompt)


def test_a_snapshot_tells_a_bounded_part_of_a_large_tier(monkeypatch):
    """A snapshot must fit one gRPC message: past SNAPSHOT_TIER_HASHES a tier is told in
    part (the pool whole), and the events after it still apply."""
    from baton.services.common import kv_events

    monkeypatch.setattr(kv_events, "SNAPSHOT_TIER_HASHES", 5)
    log = KvEventLog()
    for i in range(12):
        log.stored(_h(i), DISK)
    log.stored(_h(99))
    snap = log.read(0)
    assert snap.snapshot and snap.stored == [_h(99)] and len(snap.tiers[DISK].stored) == 5
    assert set(snap.tiers[DISK].stored) <= {_h(i) for i in range(12)}
    index = PrefixIndex()
    index.apply(_reply(log, 0))
    assert set(index._tiers) == set(snap.tiers[DISK].stored)
    told = snap.tiers[DISK].stored[0]
    log.removed(told, DISK)
    log.stored(_h(50), DISK)
    index.apply(_reply(log, index.seq))
    assert set(index._tiers) == set(snap.tiers[DISK].stored[1:]) | {_h(50)}


def test_rejected_tier_blocks_reach_the_connectors_stats_and_the_metrics(tmp_path):
    """A block forged in the host tier (its MAC made with another key) is a miss, counted
    as `host_forged` by the connector and as baton:kv_offload_rejected_total."""
    import torch
    from prometheus_client import generate_latest

    from baton.services.engine.kv_connector.offload import OffloadConnector
    from baton.services.engine.kv_offload import block_file
    from baton.services.engine.kv_offload.store import BlockStore
    from baton.services.engine.outputs import EngineStats
    from baton.services.worker.metrics import WorkerMetrics

    caches = [torch.zeros(4, 2, 1, 4, 8) for _ in range(2)]
    conn = OffloadConnector([BlockStore(tmp_path, 1 << 20, "host")], [caches], "f", 4)
    key = conn._keys(bytes(16))[0]
    data = bytes(conn.payload_bytes[0])
    path = conn.tiers[0].path(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(block_file.header(bytes(32), key.encode(), memoryview(data)) + data)
    assert not conn._load_block(bytes(16), 1)
    stats = conn.stats()
    conn.close()
    assert (stats["host_forged"], stats["load_misses"]) == (1, 1)
    metrics = WorkerMetrics(lambda: EngineStats(kv_offload=tuple(sorted(stats.items()))),
                            "m", 1)
    text = generate_latest(metrics.registry).decode()
    assert 'baton:kv_offload_rejected_total{medium="host",model_name="m",reason="forged"} ' \
           '1.0' in text
