"""The scheduler on its own (no model): the token budget, decodes first, chunked prefill,
preemption, priorities, stop conditions, leases and remote-KV pulls. The "model" is the
test itself: it says which token each request sampled."""

from __future__ import annotations

import pytest

from baton.kv_transfer.base import KVHandle, KVLayout, KVReceiver, TransferState
from baton.services.common.sampling_params import SamplingParams
from baton.services.engine.block_pool import BlockPool
from baton.services.engine.kv_cache_manager import KVCacheManager
from baton.services.engine.kv_connector.pd import PDConnector
from baton.services.engine.outputs import SampledTokens
from baton.services.engine.request import Request, RequestStatus
from baton.services.engine.scheduler import Scheduler

BS = 4  # tokens per block


class Pulls(KVReceiver):
    """A transport the test drives: a pull stays in flight until `finish` decides it.
    Pulls are named by request id here (the loader's transfer ids are `rid/n`)."""

    def __init__(self):
        self.started: dict[str, tuple[list[int], list[int]]] = {}
        self.outcome: dict[str, tuple[TransferState, str | None]] = {}

    def add_peer(self, engine_id: str, layout: KVLayout, metadata: bytes) -> None:
        pass

    def start_load(self, transfer_id, handle, remote_block_ids, local_block_ids) -> None:
        self.started[transfer_id.split("/")[0]] = (list(remote_block_ids),
                                                   list(local_block_ids))

    def finish(self, rid: str, error: str | None = None) -> None:
        self.outcome[rid] = ((TransferState.FAILED, error) if error
                             else (TransferState.SUCCESS, None))

    def poll(self, transfer_id):
        rid = transfer_id.split("/")[0]
        if rid not in self.started:
            return TransferState.FAILED, "unknown transfer"
        if rid not in self.outcome:
            return TransferState.TRANSFERRING, None
        del self.started[rid]
        return self.outcome.pop(rid)


def make(num_blocks: int = 32, budget: int = 16, policy: str = "fcfs", receiver=None,
         load_failure_policy: str = "recompute", prefix_caching: bool = True):
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, BS, prefix_caching)
    connectors = [PDConnector(receiver, BS)] if receiver is not None else []
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64,
                     policy=policy, connectors=connectors,
                     load_failure_policy=load_failure_policy), pool


_arrival = iter(range(10**6))


def req(rid: str, n: int, max_tokens: int = 4, priority: int = 0, first: int = 10,
        **params) -> Request:
    return Request(rid, list(range(first, first + n)),
                   SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                   eos_token_ids=(2,), priority=priority, arrival_time=next(_arrival))


def step(s: Scheduler, token: int = 50, stopped: set[str] = frozenset()):
    """One step in which every request that catches up samples `token`."""
    out = s.schedule()
    sampled = {r.request_id: SampledTokens([token]) for r, n in out.scheduled
               if r.num_computed_tokens + n == r.num_tokens}
    s.update(out, sampled, lambda r, _: RequestStatus.FINISHED_STOPPED
             if r.request_id in stopped else None)
    return out


def test_decodes_go_first_and_a_long_prompt_is_chunked_by_the_budget():
    s, _ = make(budget=16)
    a, b = req("a", 6), req("b", 6, first=30)
    s.add_request(a)
    s.add_request(b)
    step(s)  # both prompts fit one budget (6 + 6): each samples its first token
    assert a.num_output_tokens == b.num_output_tokens == 1
    s.add_request(long := req("long", 40, first=60))
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1),
                                                             ("long", 14)]
    assert set(out.block_ids) == {"a", "b", "long"} and len(out.block_ids["long"]) == 4
    out = step(s)
    assert [n for _, n in out.scheduled] == [1, 1, 14] and long.num_computed_tokens == 28
    step(s)  # the rest of the prompt and its first token
    assert long.num_output_tokens == 1


def test_preemption_takes_the_request_that_would_run_last_and_requeues_it_first():
    s, pool = make(num_blocks=7, budget=32)  # 6 usable blocks
    a, b = req("a", 8, max_tokens=20), req("b", 8, max_tokens=20, first=40)
    s.add_request(a)
    s.add_request(b)
    step(s)  # 2 + 2 blocks; each grows a block every 4 tokens: the pool runs out
    for _ in range(8):
        out = step(s)
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == ["b"]  # the later arrival
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.waiting.peek() is b and b.num_preemptions == 1
    assert len(s.kv.block_ids("b")) == 0
    s.abort("a")
    s.abort("b")
    pool.check_all_free()


def test_priority_policy_admits_the_most_urgent_first():
    s, _ = make(budget=8, policy="priority")
    s.add_request(req("late-but-urgent", 8, priority=-1, first=70))
    s.add_request(low := req("low", 8, priority=5))
    s.waiting.remove(low)
    s.waiting.push(low)
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["late-but-urgent"]


def test_a_stop_string_wins_over_a_length_limit_on_the_same_token():
    s, _ = make()
    a = req("a", 4, max_tokens=1)
    s.add_request(a)
    step(s, stopped={"a"})
    assert a.status is RequestStatus.FINISHED_STOPPED
    b = req("b", 4, max_tokens=1, first=40)
    s.add_request(b)
    step(s)
    assert b.status is RequestStatus.FINISHED_LENGTH


def test_eos_and_stop_tokens_finish_and_free():
    s, pool = make()
    s.add_request(a := req("a", 5, max_tokens=10))
    s.add_request(b := req("b", 5, max_tokens=10, stop_token_ids=(77,), first=40,
                           ignore_eos=True))
    step(s, token=2)  # EOS for a; not a stop token for b
    assert a.status is RequestStatus.FINISHED_STOPPED and b.status is RequestStatus.RUNNING
    step(s, token=77)
    assert b.status is RequestStatus.FINISHED_STOPPED
    pool.check_all_free()


def test_kv_hold_ends_prefilled_under_a_lease_that_only_its_own_id_releases():
    s, pool = make()
    a = req("a", 9, max_tokens=10)
    a.kv_hold = True
    s.add_request(a)
    step(s)
    assert a.status is RequestStatus.PREFILLED and "a" in s.leases and a.lease_id
    held = s.leases.blocks("a", a.lease_id)
    assert held == s.kv.block_ids("a") and len(held) == 3
    assert s.leases.blocks("a", a.lease_id + 1) is None
    assert not s.leases.release("a", a.lease_id + 1)  # another grant: not this one
    assert s.leases.release("a", a.lease_id)
    assert not s.leases.release("a", a.lease_id)  # released once
    pool.check_all_free()


def test_a_first_token_that_finishes_grants_no_lease():
    s, pool = make()
    a = req("a", 4, max_tokens=1)
    a.kv_hold = True
    s.add_request(a)
    step(s)
    assert a.status is RequestStatus.FINISHED_LENGTH and "a" not in s.leases
    pool.check_all_free()


def _remote(rid: str, n: int, deadline: float = float("inf"), first: int = 10) -> Request:
    r = req(rid, n, max_tokens=5, first=first)
    r.token_ids.append(99)  # the first token, sampled on the prefill engine
    r.remote = KVHandle("p", rid, 1, tuple(range(100, 100 + -(-n // BS))), n, deadline)
    return r


def test_a_remote_request_pulls_only_what_its_prefix_cache_lacks_then_runs():
    pulls = Pulls()
    s, pool = make(receiver=pulls)
    s.add_request(local := req("local", 8, max_tokens=1))  # caches two full blocks
    step(s)
    s.add_request(r := _remote("r", 10))
    s.schedule()
    assert r.status is RequestStatus.WAITING_FOR_KV
    remote_ids, local_ids = pulls.started["r"]
    assert remote_ids == [102]  # blocks 100 and 101 were cached here already
    assert len(local_ids) == 1 and s.loads.connectors[0].stats()["blocks_local"] == 2
    pulls.finish("r")
    out = step(s)
    assert r.status is RequestStatus.RUNNING and r.num_computed_tokens == 11
    assert [(x.request_id, n) for x, n in out.scheduled] == [("r", 1)]
    assert local.status.finished
    s.abort("r")
    pool.check_all_free()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_pull_follows_the_policy(policy):
    pulls = Pulls()
    s, pool = make(receiver=pulls, load_failure_policy=policy)
    s.add_request(r := _remote("r", 10))
    s.schedule()
    pulls.finish("r", "peer went away")
    out = s.schedule()
    if policy == "recompute":  # prefills the prompt and the first token itself
        assert r.status is RequestStatus.RUNNING and r.remote is None
        assert [(x.request_id, n) for x, n in out.scheduled] == [("r", 11)]
        s.abort("r")
    else:
        assert out.finished == [r] and r.status is RequestStatus.FINISHED_ABORTED
        assert "peer went away" in r.error
    assert s.loads.num_failures == 1
    pool.check_all_free()


def test_an_aborted_pull_keeps_its_blocks_until_the_transport_lets_go():
    pulls = Pulls()
    s, pool = make(receiver=pulls)
    s.add_request(r := _remote("r", 10))
    s.schedule()
    s.abort("r")
    assert r.status is RequestStatus.FINISHED_ABORTED
    assert s.has_unfinished_requests() and pool.num_free_blocks < pool.num_blocks - 1
    s.schedule()
    assert s.has_unfinished_requests()  # still in flight: the transport may write
    pulls.finish("r")
    s.schedule()
    assert not s.has_unfinished_requests()
    pool.check_all_free()


def test_a_handle_past_its_deadline_starts_no_pull():
    pulls = Pulls()
    s, pool = make(receiver=pulls, load_failure_policy="fail")
    s.add_request(r := _remote("r", 10, deadline=0.0))
    out = s.schedule()
    assert "r" not in pulls.started and out.finished == [r] and "lease" in r.error
    pool.check_all_free()


def test_a_remote_request_without_a_receiver_is_refused():
    s, _ = make()
    with pytest.raises(ValueError, match="receiver"):
        s.add_request(_remote("r", 10))


def test_a_lease_revoked_from_another_thread_keeps_its_blocks_until_the_engine_collects():
    s, pool = make()
    a = req("a", 9, max_tokens=10)
    a.kv_hold = True
    s.add_request(a)
    step(s)
    free = pool.num_free_blocks
    assert s.leases.revoke("a", a.lease_id)  # a worker's event loop answering a check
    assert s.leases.blocks("a", a.lease_id) is None and not s.leases.revoke("a")
    assert pool.num_free_blocks == free  # nothing can reuse them yet
    s.leases.expire(0.0)  # the engine thread's next step collects
    pool.check_all_free()


def test_a_pull_that_never_lands_fails_and_its_blocks_wait_for_the_transport(monkeypatch):
    """A transport stuck on a frozen peer: after the connector's load timeout the
    request recomputes with new blocks; the old ones stay set aside (it may still write)
    until it lets go."""
    pulls = Pulls()
    s, pool = make(receiver=pulls)
    s.add_request(r := _remote("r", 10))
    s.schedule()
    held = set(s.kv.block_ids("r"))
    monkeypatch.setattr(PDConnector, "load_timeout_s", 0.0)
    out = s.schedule()
    assert r.status is RequestStatus.RUNNING and r.remote is None  # recomputing
    assert [(x.request_id, n) for x, n in out.scheduled] == [("r", 11)]
    assert not held & set(s.kv.block_ids("r"))  # new blocks: the old are set aside
    s.abort("r")
    assert s.has_unfinished_requests()  # the stuck pull still holds its blocks
    pulls.finish("r")
    s.schedule()
    assert not s.has_unfinished_requests()
    pool.check_all_free()


def test_drafts_are_dropped_before_anything_is_preempted_for_them():
    """Two running requests fill the pool; one drafts past its last block. Its drafts
    go, nobody is preempted, and both decode."""
    s, pool = make(num_blocks=1 + 2 * 2, budget=64)  # 4 usable blocks: 2 each
    a, b = req("a", 2 * BS - 1, max_tokens=8), req("b", 2 * BS - 1, max_tokens=8, first=40)
    s.add_request(a)
    s.add_request(b)
    step(s)  # both prefill and sample: each now holds 2 full blocks' worth of tokens
    assert pool.num_free_blocks == 0
    a.spec_token_ids = [7, 8, 9]  # would need a third block
    out = step(s)
    assert not out.preempted and s.num_preemptions == 0
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]
    assert a.spec_token_ids == []
