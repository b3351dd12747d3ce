"""The KV connector interface on its own (no model): a connector's loads drive the
scheduler (only what failed to load is recomputed), connectors are chosen by name and
stacked, and vLLM's --kv-transfer-config JSON maps onto Baton's settings or is refused
by name."""

from __future__ import annotations

import json

import pytest

from baton.services.engine.block_pool import BlockPool
from baton.services.engine.config import EngineConfig
from baton.services.engine.kv_cache_manager import KVCacheManager
from baton.services.engine.kv_connector.base import KVConnector, LoadResult
from baton.services.engine.kv_connector.transfer_config import parse
from baton.services.engine.request import RequestStatus
from baton.services.engine.scheduler import Scheduler
from tests.unit.test_scheduler import BS, req, step


class Tier(KVConnector):
    """A tier the test drives: it holds the blocks with the hashes in `held`, a load
    stays in flight until `finish(n_ok, error)`, and it records what it was given."""

    name = "tier"
    saves = True

    def __init__(self):
        self.held: set[bytes] = set()
        self.loads: dict[str, tuple[int, list[int]]] = {}
        self.results: dict[str, LoadResult] = {}
        self.saved: list[bytes] = []

    def match(self, r, num_hit_blocks):
        n = 0
        for h in r.block_hashes[num_hit_blocks:(r.num_tokens - 1) // BS]:
            if h not in self.held:
                break
            n += 1
        return n * BS if n else None

    def start_load(self, load_id, r, first_block, block_ids):
        self.loads[load_id] = (first_block, list(block_ids))

    def finish(self, num_ok: int, error: str | None = None) -> None:
        for load_id in list(self.loads):
            self.results[load_id] = LoadResult(num_ok, error)
            del self.loads[load_id]

    def poll(self, load_id):
        return self.results.pop(load_id, None)

    def save(self, blocks):
        self.saved += [b.block_hash for b in blocks]


def only_in_the_tier(s: Scheduler, tier: Tier, n: int) -> None:
    """A first request computes an n-token prompt; the tier keeps its full blocks and
    the pool forgets them."""
    s.add_request(req("first", n, max_tokens=1))
    step(s)
    tier.held = set(tier.saved)
    s.kv.pool.reset_prefix_cache()


def make(tier: Tier, num_blocks: int = 32):
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, BS)
    kv.record_published = True
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                     connectors=[tier]), pool


@pytest.mark.parametrize("num_ok,error", [(4, None), (2, "block 2 was corrupt"),
                                          (0, "every tier missed")])
def test_only_what_did_not_load_is_computed(num_ok, error):
    tier = Tier()
    s, pool = make(tier)
    only_in_the_tier(s, tier, 19)
    assert s.requests == {} and len(tier.saved) == 4  # the 4 full prompt blocks
    s.add_request(r := req("r", 19, max_tokens=1))
    s.schedule()
    assert r.status is RequestStatus.WAITING_FOR_KV
    (first_block, block_ids), = tier.loads.values()
    assert first_block == 0 and len(block_ids) == 4  # never the block with the last token
    tier.finish(num_ok, error)
    out = s.schedule()
    assert r.status is RequestStatus.RUNNING
    # The step computes the prompt from the first block that did not load.
    assert [(x.request_id, n) for x, n in out.scheduled] == [("r", 19 - num_ok * BS)]
    assert s.loads.num_failures == (error is not None)
    s.abort("r")
    pool.check_all_free()


def test_a_load_failure_under_the_fail_policy_ends_the_request():
    tier = Tier()
    s, pool = make(tier)
    s.load_failure_policy = "fail"
    only_in_the_tier(s, tier, 9)
    s.add_request(r := req("r", 9, max_tokens=1))
    s.schedule()
    tier.finish(1, "disk went away")
    out = s.schedule()
    assert out.finished == [r] and "disk went away" in r.error
    pool.check_all_free()


def test_loaded_blocks_enter_the_prefix_cache():
    tier = Tier()
    s, pool = make(tier)
    only_in_the_tier(s, tier, 9)
    s.add_request(req("r", 9, max_tokens=2))
    s.schedule()
    tier.finish(2)
    step(s)
    # A third request on the same prefix hits the pool, no load.
    s.add_request(t := req("t", 9, max_tokens=1))
    out = s.schedule()
    assert t.status is RequestStatus.RUNNING and t.num_cached_tokens == 8
    assert [(x.request_id, n) for x, n in out.scheduled if x is t] == [("t", 1)]
    s.abort("r")
    s.abort("t")
    pool.check_all_free()


# ---- choosing connectors ----------------------------------------------------------


def ctx(receiver=None, **kw):
    """What the registry builds from: these EngineConfig settings, no model."""
    from baton.services.engine.kv_connector.context import ConnectorContext

    return ConnectorContext(EngineConfig(**kw), None, [], receiver, None)  # type: ignore[arg-type]


def test_unknown_and_missing_connectors_are_refused_by_name():
    from baton.services.engine.kv_connector.registry import build

    with pytest.raises(ValueError, match="'lmcache'"):
        build(ctx(kv_connector="lmcache"))
    with pytest.raises(ValueError, match="must be named"):
        build(ctx(receiver=object(), kv_connector="offload", kv_offload_gib=1.0))
    with pytest.raises(ValueError, match="no KV receiver"):
        build(ctx(kv_connector="pd"))
    assert build(ctx()) == []  # nothing asked for: no connector at all


def test_engine_config_checks_the_tiers():
    with pytest.raises(ValueError, match="needs a tier"):
        EngineConfig(kv_connector="offload")
    with pytest.raises(ValueError, match="kv_offload_disk_gib"):
        EngineConfig(kv_offload_disk_path="/tmp/x")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_offload_gib=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="leaves out 'offload'"):
        EngineConfig(kv_connector="pd", kv_offload_gib=1.0)


# ---- vLLM's --kv-transfer-config --------------------------------------------------


def test_vllm_transfer_config_maps_onto_baton_settings():
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
             "kv_load_failure_policy": "fail",
             "kv_connector_extra_config": {"connectors": [
                 {"kv_connector": "NixlConnector"},
                 {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
                     "cpu_bytes_to_use": 1 << 29, "disk_path": "/var/kv",
                     "disk_bytes_to_use": 3 << 30}}]}}
    config = EngineConfig(kv_transfer_config=json.dumps(multi))
    assert (config.kv_connector, config.kv_role, config.kv_load_failure_policy,
            config.kv_offload_gib, config.kv_offload_disk_path,
            config.kv_offload_disk_gib) == ("pd,offload", "decode", "fail", 0.5, "/var/kv", 3)
    assert parse('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}') == {
        "kv_connector": "pd", "kv_role": "colocated"}


@pytest.mark.parametrize("doc,named", [
    ({"kv_connector": "NixlConnector", "kv_ip": "10.0.0.1"}, "'kv_ip'"),
    ({"kv_connector": "NixlConnector", "kv_buffer_size": 1e9}, "'kv_buffer_size'"),
    ({"kv_connector": "LMCacheConnectorV1"}, "LMCacheConnectorV1"),
    ({"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"num_cpu_blocks": 10}}, "'num_cpu_blocks'"),
    ({"kv_connector": "NixlConnector",
      "kv_connector_extra_config": {"backends": ["GDS"]}}, "backends"),
    ({"kv_role": "kv_leader"}, "kv_leader"),
    ({"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"cpu_bytes_to_use": -1}}, "cpu_bytes_to_use"),
])
def test_a_key_or_value_that_would_do_nothing_is_refused_by_name(doc, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(kv_transfer_config=json.dumps(doc))


def test_a_worker_of_another_role_than_the_config_says_refuses_to_start():
    from baton.services.worker.runtime import make_engine

    config = EngineConfig(kv_transfer_config='{"kv_role": "kv_producer"}')
    with pytest.raises(ValueError, match="prefill worker; this one is a decode"):
        make_engine(config, None, role="decode")


# ---- what is saved, and when a connector is asked -----------------------------------


def test_a_saved_block_still_holds_the_hash_it_was_published_under(tmp_path):
    """A block published, then freed and taken by another request before the save (a
    preemption in the same schedule), or published for a step that failed (every hash
    dropped), is not saved: its bytes are not that prefix's."""
    from baton.services.common.sampling_params import SamplingParams
    from baton.services.engine.kv_connector.base import SavedBlock
    from baton.services.engine.request import Request

    pool = BlockPool(3)  # 2 usable blocks: b must take a's
    kv = KVCacheManager(pool, BS)
    kv.record_published = True
    a, b = req("a", 8), req("b", 8, first=50)
    assert kv.allocate_slots(a, 8)
    kv.free(a)
    assert kv.allocate_slots(b, 8)
    assert kv.take_published() == [(h, blk, None) for h, blk in zip(
        b.block_hashes, kv.block_ids("b"), strict=True)]
    kv.free(b)
    c = req("c", 8, first=90)
    assert kv.allocate_slots(c, 8)
    pool.reset_prefix_cache()  # what the engine does after a failed step
    assert kv.take_published() == []
    kv.free(c)
    # A LoRA request's blocks never reach a tier: its hash names the adapter as this
    # process bound it, which another process may bind to other weights.
    lora = Request("l", list(range(8)), SamplingParams(max_tokens=1), (2,),
                   lora_name="x")
    assert kv.allocate_slots(lora, 8)
    conn = _tiny_offload(tmp_path)
    conn.save([SavedBlock(*p) for p in kv.take_published()])
    assert conn.drain() and "host_saves" not in conn.stats()
    conn.close()
    kv.free(lora)
    pool.check_all_free()


def test_a_connector_whose_load_timed_out_is_not_asked_again():
    tier = Tier()
    tier.load_timeout_s = 0.0  # type: ignore[misc]
    s, pool = make(tier)
    only_in_the_tier(s, tier, 9)
    s.add_request(req("r", 9, max_tokens=1))
    out = s.schedule()
    # The load timed out at once; the request computes its prompt instead of queueing
    # one more load behind the one that is late.
    assert len(tier.loads) == 1 and s.loads.num_failures == 1
    assert [(x.request_id, n) for x, n in out.scheduled] == [("r", 9)]
    tier.finish(2)  # the late load ends: the blocks it held are freed
    s.abort("r")
    s.schedule()
    assert not s.loads.busy
    pool.check_all_free()


def test_a_producer_config_builds_no_pull_and_a_failed_stack_closes_what_it_built():
    from baton.services.engine.kv_connector.registry import build, register

    producer = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
    assert build(ctx(kv_transfer_config=producer)) == []  # the prefill side serves it
    closed = []

    class Closing(Tier):
        name = "test-closing"

        def close(self):
            closed.append(self)

    def boom(_ctx):
        raise ValueError("boom")

    register("test-closing", lambda _ctx: Closing())
    register("test-boom", boom)
    with pytest.raises(ValueError, match="boom"):
        build(ctx(kv_connector="test-closing,test-boom"))
    assert len(closed) == 1


def test_the_tiers_are_keyed_by_the_weights_too(tmp_path):
    """A checkpoint updated in place keeps its name (the P/D fingerprint's model): its
    files' sizes and times tell it apart, so a tier never serves the old weights' KV."""
    import os

    from baton.services.common.model_source import weights_identity

    (tmp_path / "model.safetensors").write_bytes(b"1" * 10)
    before = weights_identity(tmp_path, "auto", 0)
    assert weights_identity(tmp_path, "auto", 0) == before
    os.utime(tmp_path / "model.safetensors", ns=(1, 1))
    assert weights_identity(tmp_path, "auto", 0) != before
    assert weights_identity(tmp_path, "dummy", 0) != weights_identity(tmp_path, "dummy", 1)


def test_a_step_saves_what_the_queue_has_room_for_and_counts_the_rest(tmp_path,
                                                                      monkeypatch):
    """Past the queue's bytes a step's blocks are dropped, counted, and never copied;
    before it they are saved, and the bytes counted are the files' payloads."""
    import torch

    from baton.services.engine.kv_connector import offload
    from baton.services.engine.kv_connector.base import SavedBlock

    caches = _tiny_caches()
    per_block = 3 * 2 * 4 * 8 * 2
    monkeypatch.setattr(offload, "MAX_QUEUED_BYTES", int(2.5 * per_block))
    conn = _tiny_offload(tmp_path, caches=caches)
    conn.save([SavedBlock(bytes([i]) * 16, i + 1) for i in range(4)])
    assert conn.drain()
    stats = conn.stats()
    assert (stats["host_saves"], stats["save_dropped"]) == (2, 2)
    assert stats["host_save_bytes"] == 2 * per_block
    target = [torch.zeros_like(c) for c in caches]
    loader = _tiny_offload(tmp_path, caches=target)
    assert loader._load_block(bytes([1]) * 16, 5)  # the second block saved, into block 5
    assert all(torch.equal(t[5], c[2]) for t, c in zip(target, caches, strict=True))
    conn.close()
    loader.close()


def _tiny_caches() -> list:
    """3 layers of 8 blocks, each element distinct per layer."""
    import torch

    return [torch.arange(8 * 64, dtype=torch.bfloat16).view(8, 2, 4, 8) + i
            for i in range(3)]


def _tiny_offload(root, events=None, caches=None):
    """An offload connector over a 1 MiB host tier at `root` and `caches`."""
    from baton.services.engine.kv_connector import offload
    from baton.services.engine.kv_offload.store import BlockStore

    return offload.OffloadConnector([BlockStore(str(root), 1 << 20, "host")],
                                    [caches if caches is not None else _tiny_caches()],
                                    "f", BS, events)


def test_a_shared_tier_is_told_as_it_is_found_whoever_wrote_or_evicted(tmp_path):
    """Two workers on one host tier: what one saves, the other's events tell at its next
    sweep; what is gone from the tier (evicted by the other, found corrupt), too."""
    from baton.services.common.kv_events import HOST, KvEventLog
    from baton.services.engine.kv_connector.base import SavedBlock

    a_events, b_events = KvEventLog(), KvEventLog()
    a, b = _tiny_offload(tmp_path, a_events), _tiny_offload(tmp_path, b_events)
    a.save([SavedBlock(bytes([i]) * 16, i + 1) for i in range(3)])
    assert a.drain()
    saved = {bytes([i]) * 16 for i in range(3)}
    assert a_events.hashes(HOST) == saved and b_events.hashes(HOST) == set()
    b._sweep()
    assert b_events.hashes(HOST) == saved
    a.tiers[0].path(f"{a.namespaces[0]}/{(bytes([1]) * 16).hex()}").unlink()
    a._sweep()
    b._sweep()
    assert a_events.hashes(HOST) == b_events.hashes(HOST) == saved - {bytes([1]) * 16}
    a.close()
    b.close()


def test_a_load_that_raises_ends_failed_at_once(tmp_path):
    import time

    conn = _tiny_offload(tmp_path)

    def broken(*_):
        raise RuntimeError("a tier went away")

    conn._load_block = broken  # type: ignore[method-assign]
    r = req("r", 9)
    r.block_hashes = [bytes(16)]
    conn.start_load("l", r, 0, [1])
    deadline = time.monotonic() + 5
    while (result := conn.poll("l")) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert result == LoadResult(0, "the tier load failed")
    conn.close()
