"""Prefill and decode roles of the engine, joined by the in-memory connector: the same
greedy tokens as one engine, only missing blocks pulled, and no block leaked on any path
(the autouse pool invariant checks both engines after each test)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from baton.kv_transfer.base import KVHandle, KVReceiver, TransferState
from baton.kv_transfer.blocks import read_blocks
from baton.kv_transfer.fake import FakeConnector
from baton.kv_transfer.lease_check import LeaseCheckedReceiver
from baton.services.engine import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about paged attention and memory blocks in a serving system.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,",
]


@pytest.fixture(scope="module")
def llm(make_llm, tiny_model):
    """The one engine the pair must equal (the tiny serving model: what is checked is the
    handoff, not the model)."""
    return make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=128,
                    max_num_seqs=16)


@pytest.fixture(scope="module")
def pair(make_llm, tiny_model):
    """A prefill engine and a decode engine, wired through fake connectors; the decode
    engine's pulls are checked against the prefill engine's leases, as a worker's are."""
    model = str(tiny_model)
    p = make_llm(model=model, dtype="float32", max_num_batched_tokens=64).engine
    made = {}

    def receiver(layout, kv_caches):
        made["fake"] = FakeConnector("decode-0", layout, kv_caches)
        return LeaseCheckedReceiver(made["fake"], confirm=lambda h: p_release(h))

    def p_release(h: KVHandle) -> bool:  # ReleaseKv on the prefill worker, in-process
        return p.release_lease(h.request_id, h.lease_id)

    d = make_llm(model=model, dtype="float32", kv_receiver=receiver).engine
    sender = FakeConnector("prefill-0", p.kv_layout, p.rank_kv_caches)
    made["fake"].add_peer("prefill-0", p.kv_layout, sender.metadata())
    yield p, d, made["fake"]
    sender.close()
    made["fake"].close()


def _drain(engine, outs=None):
    outs = outs if outs is not None else {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _prefill(p, prompts, params):
    ids = [p.add_request(x, params, request_id=f"r{i}", kv_hold=True)
           for i, x in enumerate(prompts)]
    outs = _drain(p)
    return {rid: outs[rid][-1] for rid in ids}


def _handle(rid, o, deadline=float("inf")) -> KVHandle:
    """The engines of `pair` trust each other, as a cluster's do (a cluster token)."""
    return KVHandle("prefill-0", rid, o.kv_lease_id, tuple(o.kv_block_ids),
                    len(o.prompt_token_ids), deadline, verified=True)


def _handoff(p, d, firsts, params):
    for rid, o in firsts.items():
        if o.finished:
            continue
        d.add_remote_request(o.prompt_token_ids, o.new_token_ids[0], _handle(rid, o), params,
                             request_id=rid)


def test_disaggregated_greedy_equals_one_engine(pair, llm):
    p, d, _ = pair
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = [o.token_ids for o in llm.generate(PROMPTS, params)]
    firsts = _prefill(p, PROMPTS, params)
    assert all(o.kv_block_ids and o.finish_reason is None for o in firsts.values())
    assert p.stats().num_leases == len(PROMPTS)
    _handoff(p, d, firsts, params)
    outs = _drain(d)
    for rid in firsts:
        p.release_lease(rid)
    got = [firsts[f"r{i}"].new_token_ids + [t for o in outs[f"r{i}"] for t in o.new_token_ids]
           for i in range(len(PROMPTS))]
    assert got == want
    texts = [firsts[f"r{i}"].new_text + "".join(o.new_text for o in outs[f"r{i}"])
             for i in range(len(PROMPTS))]
    assert texts == [o.text for o in llm.generate(PROMPTS, params)]
    assert all(outs[f"r{i}"][-1].transfer_time is not None for i in range(len(PROMPTS)))


def test_kv_bytes_equal_after_transfer(pair):
    """The decode engine's copy of the prompt's blocks is the prefill engine's, byte for
    byte. Both caches start empty, so every block is pulled: a block either engine cached
    in an earlier test was computed in another batch shape, and on some CPUs (AMX) a
    matmul's low bits depend on the batch shape."""
    p, d, _ = pair
    p.reset_prefix_cache()
    d.reset_prefix_cache()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    firsts = _prefill(p, [PROMPTS[1]], params)
    src = read_blocks(p.kv_caches, firsts["r0"].kv_block_ids)
    pulled = d.stats().num_blocks_pulled
    _handoff(p, d, firsts, params)
    d.step()  # admits the request, pulls its blocks, decodes once
    assert d.stats().num_blocks_pulled - pulled == len(firsts["r0"].kv_block_ids)
    dst = read_blocks(d.kv_caches, d.kv.block_ids("r0")[:len(firsts["r0"].kv_block_ids)])
    p.release_lease("r0")
    _drain(d)
    # The last, partial block differs past the prompt: decode wrote the first token there.
    n = len(firsts["r0"].prompt_token_ids)
    full = n // p.config.block_size * (len(src) // len(firsts["r0"].kv_block_ids))
    assert src[:full] == dst[:full]
    assert len(src) == len(dst)


def test_only_missing_blocks_are_pulled(pair, llm):
    p, d, receiver = pair
    d.reset_prefix_cache()
    params = SamplingParams(max_tokens=4, temperature=0.0)
    base = "Paged attention splits the KV cache into fixed blocks. " * 6
    longer = base + "Then a decode worker pulls only what it lacks."
    for prompt in (base, longer):
        before = d.stats()
        firsts = _prefill(p, [prompt], params)
        _handoff(p, d, firsts, params)
        outs = _drain(d)
        p.release_lease("r0")
        after = d.stats()
        pulled = after.num_blocks_pulled - before.num_blocks_pulled
        local = after.num_blocks_local - before.num_blocks_local
        n = len(firsts["r0"].prompt_token_ids)
        assert pulled + local == -(-n // 16)
        got = firsts["r0"].new_token_ids + [t for o in outs["r0"] for t in o.new_token_ids]
        assert got == llm.generate([prompt], params)[0].token_ids
    # The second prompt shares the first one's full blocks: those were not pulled again.
    n_base = len(p.tokenizer.encode(base))
    assert local == n_base // 16 > 0


def test_kv_from_an_unverified_peer_serves_its_request_but_is_never_cached(pair, llm):
    """A handle nobody vouched for (no cluster token, no mutual TLS): its blocks give the
    same tokens, but neither they nor what the request computes on them enter the decode
    engine's prefix cache, so the same prompt is pulled in full again. A verified handle's
    blocks are cached, and the next request finds them there."""
    p, d, _ = pair
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = llm.generate([PROMPTS[1]], params)[0].token_ids
    d.reset_prefix_cache()
    for verified, found_locally in ((False, False), (False, False), (True, False),
                                    (True, True)):
        o = _prefill(p, [PROMPTS[1]], params)["r0"]
        before = d.stats()
        d.add_remote_request(o.prompt_token_ids, o.new_token_ids[0],
                             replace(_handle("r0", o), verified=verified), params,
                             request_id="r0")
        outs = _drain(d)
        p.release_lease("r0")
        assert o.new_token_ids + [t for x in outs["r0"] for t in x.new_token_ids] == want
        local = d.stats().num_blocks_local - before.num_blocks_local
        full = len(o.prompt_token_ids) // d.config.block_size
        assert local == (full if found_locally else 0), (verified, local)
        assert bool(d.scheduler.kv.pool.cached) == verified


def test_abort_while_loading_frees_after_transport_is_done(pair):
    p, d, receiver = pair
    params = SamplingParams(max_tokens=8, temperature=0.0)
    firsts = _prefill(p, [PROMPTS[2]], params)
    receiver.hold = True
    try:
        _handoff(p, d, firsts, params)
        d.step()
        assert d.stats().num_loading == 1
        d.abort_request("r0")
        d.step()
        assert d.has_unfinished_requests()  # blocks stay until the transport lets go
        assert d.stats().num_free_blocks < d.stats().num_blocks
    finally:
        receiver.hold = False
        _drain(d)
        p.release_lease("r0")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_transfer_follows_the_policy(pair, llm, policy):
    """recompute: the decode engine prefills the prompt itself, same tokens; fail: the
    request ends with the transport's reason. Either way no block is left held."""
    p, d, receiver = pair
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = llm.generate([PROMPTS[1]], params)[0].token_ids
    firsts = _prefill(p, [PROMPTS[1]], params)
    d.reset_prefix_cache()  # so there is something to pull
    receiver.fail = "peer went away"
    d.scheduler.load_failure_policy = policy
    failures = d.stats().num_load_failures
    try:
        _handoff(p, d, firsts, params)
        outs = _drain(d)
    finally:
        receiver.fail = None
        d.scheduler.load_failure_policy = "recompute"
        p.release_lease("r0")
    last = outs["r0"][-1]
    assert d.stats().num_load_failures == failures + 1
    if policy == "fail":
        assert last.finish_reason == "abort" and "peer went away" in last.error
    else:
        got = firsts["r0"].new_token_ids + [t for o in outs["r0"] for t in o.new_token_ids]
        assert got == want and last.error is None
        # Each output says it was computed here, and why (the router counts it).
        assert all("peer went away" in o.kv_load_error for o in outs["r0"])


def test_lease_expires(pair):
    p, _, _ = pair
    p.scheduler.leases.timeout_s = 0.0
    expired = p.stats().num_leases_expired
    try:
        _prefill(p, [PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0))
        assert p.stats().num_leases == 1
        p.step()
        assert p.stats().num_leases == 0
        assert p.stats().num_leases_expired == expired + 1
    finally:
        p.scheduler.leases.timeout_s = 30.0


def test_first_token_that_finishes_holds_nothing(pair):
    p, _, _ = pair
    firsts = _prefill(p, [PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0.0))
    assert firsts["r0"].finish_reason == "length" and firsts["r0"].kv_block_ids is None
    assert p.stats().num_leases == 0


def test_remote_request_is_validated(pair):
    _, d, _ = pair
    with pytest.raises(ValueError, match="blocks"):
        d.add_remote_request([1] * 40, 5, KVHandle("prefill-0", "x", 1, (1, 2), 40),
                             SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="holds 39 tokens"):
        d.add_remote_request([1] * 40, 5, KVHandle("prefill-0", "x", 1, (1, 2, 3), 39),
                             SamplingParams(max_tokens=4))
    assert not d.has_unfinished_requests()


def test_preempted_decode_recomputes_instead_of_pulling_again(pair, llm):
    """Once its KV has landed, a decode request owns it: after a preemption it recomputes
    locally and never reads the prefill engine's (released, maybe reused) blocks again."""
    p, d, receiver = pair
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = llm.generate([PROMPTS[1]], params)[0].token_ids
    firsts = _prefill(p, [PROMPTS[1]], params)
    blocks = firsts["r0"].kv_block_ids
    _handoff(p, d, firsts, params)
    outs = {}
    for _ in range(3):
        for o in d.step():
            outs.setdefault(o.request_id, []).append(o)
    p.release_lease("r0")
    for kv in p.runner.kv_caches:  # the prefill engine reused those blocks
        kv[blocks] = 0  # whole blocks (kernels/kv_layout.py)
    pulled = d.stats().num_blocks_pulled
    req = d.scheduler.requests["r0"]
    d.scheduler.running.remove(req)
    d.scheduler._preempt(req)
    _drain(d, outs)
    assert d.stats().num_blocks_pulled == pulled
    got = firsts["r0"].new_token_ids + [t for o in outs["r0"] for t in o.new_token_ids]
    assert got == want


def test_seeded_sampling_matches_one_engine(pair, llm):
    p, d, _ = pair
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    want = llm.generate([PROMPTS[0]], params)[0].token_ids
    firsts = _prefill(p, [PROMPTS[0]], params)
    _handoff(p, d, firsts, params)
    outs = _drain(d)
    p.release_lease("r0")
    assert firsts["r0"].new_token_ids + [t for o in outs["r0"] for t in o.new_token_ids] == want


def test_abort_after_prefill_releases_the_lease(pair):
    p, _, _ = pair
    _prefill(p, [PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0))
    assert p.stats().num_leases == 1
    p.abort_request("r0")
    assert p.stats().num_leases == 0


def test_expired_lease_fails_the_request_without_pulling(pair):
    p, d, _ = pair
    d.scheduler.load_failure_policy = "fail"
    params = SamplingParams(max_tokens=8, temperature=0.0)
    firsts = _prefill(p, [PROMPTS[2]], params)
    o = firsts["r0"]
    pulled = d.stats().num_blocks_pulled
    d.add_remote_request(o.prompt_token_ids, o.new_token_ids[0], _handle("r0", o, 0.0),
                         params, request_id="r0")
    outs = _drain(d)
    p.release_lease("r0")
    d.scheduler.load_failure_policy = "recompute"
    assert outs["r0"][-1].finish_reason == "abort" and "lease" in outs["r0"][-1].error
    assert d.stats().num_blocks_pulled == pulled


def test_resume_mid_stream_gives_the_undisturbed_tokens(pair, llm):
    """What a migration does: another engine continues from the tokens already streamed,
    computing their KV itself, and the rest equals an undisturbed run."""
    _, d, _ = pair
    params = SamplingParams(max_tokens=20, temperature=0.0)
    ref = llm.generate([PROMPTS[1]], params)[0]
    d.resume_request(ref.prompt_token_ids, ref.token_ids[:7], params, request_id="m")
    outs = _drain(d)
    assert ref.token_ids[:7] + [t for o in outs["m"] for t in o.new_token_ids] == ref.token_ids
    assert "".join(o.new_text for o in outs["m"]) == ref.text[len(
        llm.engine.tokenizer.decode(ref.token_ids[:7])):]


def test_a_pull_of_blocks_no_longer_leased_is_caught_and_recomputed(pair, llm):
    """The lease ends (expiry) and the prefill engine reuses the blocks before the decode
    engine pulls them: the pull itself succeeds, but the source no longer holds the lease
    when asked, so the pull fails and the prompt is recomputed: the undisturbed tokens."""
    p, d, _ = pair
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = llm.generate([PROMPTS[1]], params)[0].token_ids
    d.reset_prefix_cache()
    firsts = _prefill(p, [PROMPTS[1]], params)
    assert p.release_lease("r0")  # as if it expired
    for kv in p.kv_caches:  # another request's KV now sits in those blocks
        kv[firsts["r0"].kv_block_ids] = 0.5  # whole blocks (kernels/kv_layout.py)
    failures = d.stats().num_load_failures
    _handoff(p, d, firsts, params)
    outs = _drain(d)
    got = firsts["r0"].new_token_ids + [t for o in outs["r0"] for t in o.new_token_ids]
    assert got == want
    assert d.stats().num_load_failures == failures + 1


class _Landed(KVReceiver):
    """A transport whose every pull has landed (it copies nothing)."""

    def add_peer(self, engine_id, layout, metadata):
        pass

    def start_load(self, transfer_id, handle, remote_block_ids, local_block_ids):
        pass

    def poll(self, transfer_id):
        return TransferState.SUCCESS, None


@pytest.mark.parametrize("answer", ["held", "gone", "unreachable"])
def test_lease_check_trusts_a_pull_only_if_the_source_still_held_the_lease(answer):
    def confirm(handle: KVHandle) -> bool:
        if answer == "unreachable":  # dead or frozen: it cannot vouch for the bytes
            raise ConnectionError("no answer")
        return answer == "held"

    checked = LeaseCheckedReceiver(_Landed(), confirm)
    checked.start_load("x", KVHandle("prefill-0", "x", 7, (1,), 1), [1], [1])
    deadline = time.monotonic() + 60
    while (state := checked.poll("x"))[0] is TransferState.TRANSFERRING:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    checked.close()
    assert state[0] is (TransferState.SUCCESS if answer == "held" else TransferState.FAILED)
    if answer != "held":
        assert ("no answer" if answer == "unreachable" else "lease") in state[1]
    assert checked.poll("x")[0] is TransferState.FAILED  # forgotten once reported
