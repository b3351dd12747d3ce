"""Faults an outside probe found, with real processes: a pull after the lease ended, a
frozen worker, a drained prefill worker. Each compares text with an undisturbed run.

One topology for the module: a prefill worker with a tiny KV pool (28 blocks, so other
prompts reuse freed blocks at once) and a short lease, two decode workers, a router.
The drain test runs last: it stops the prefill worker.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from baton.services.engine import SamplingParams
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc
from tests.e2e.helpers import (
    all_free_within,
    greedy,
    health,
    joined,
    run,
    running_worker,
    stats,
    until_served,
)
from tests.e2e.topology import Topology, channel

LEASE_S = 4.0
WAIT_S = 60.0  # for what comes after LEASE_S (an expiry, and the engine's next look)
STOPPED: set[str] = set()  # workers a test stopped for good
VICTIM = "A lighthouse keeper writes in her log every night about the sea. " * 5


@pytest.fixture(scope="module")
def faults(tmp_path_factory, tiny_model):
    topo = Topology(tmp_path_factory.mktemp("faults"), tiny_model)
    try:
        nixl = ("--kv-transport", "nixl")
        # About 29 blocks of the tiny model's KV: the fillers below reuse them.
        p = topo.worker("prefill", *nixl, "--kv-cache-gib", "0.00022", "--kv-lease-timeout",
                        str(LEASE_S), wait=False)
        d1 = topo.worker("decode", *nixl, wait=False)
        d2 = topo.worker("decode", *nixl, wait=False)
        topo.wait()
        router = topo.start("router", "--prefill", p, "--decode", d1, "--decode", d2)
        until_served(router, gen.GenerateRequest(text="hi", sampling=greedy(2)))
        yield {"topology": topo, "p": p, "d1": d1, "d2": d2, "router": router}
    finally:
        topo.stop()


@pytest.fixture(autouse=True)
def faults_leave_nothing_behind(request):
    """After each test every worker of the module's topology holds nothing (a lease the
    test stranded expires after LEASE_S; the wait only bounds a hang)."""
    yield
    topo = request.getfixturevalue("faults")
    workers = [topo[w] for w in ("p", "d1", "d2") if topo[w] not in STOPPED]
    assert all_free_within(workers, 60), [stats(w) for w in workers]


def _prefill(address: str, rid: str, ids: list[int], max_tokens: int) -> wk.PrefillResponse:
    with channel(address) as ch:
        return wk_grpc.PrefillServiceStub(ch).Prefill(wk.PrefillRequest(
            request_id=rid, prompt_token_ids=ids, sampling=greedy(max_tokens)), timeout=60)


def _fill(prefill: str, offline, n: int = 4) -> None:
    """Prompts that take every block of the prefill worker's pool, and give it back."""
    for i in range(n):
        ids = offline.engine.tokenizer.encode(f"Filler {i}: the quick brown fox. " * 40)[:400]
        _prefill(prefill, f"fill-{i}-{time.monotonic()}", ids, 1)  # ends at once: no lease


def _holds(s: wk.GetStatsResponse) -> bool:
    return s.num_waiting + s.num_running + s.num_leases > 0


def _wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def test_a_pull_after_the_lease_ended_never_serves_another_requests_kv(faults, offline):
    """The decode worker is paused while the prefill worker answers; the lease expires and
    other prompts take its blocks; the decode worker resumes and pulls. It must notice
    the blocks are no longer that request's and recompute: the undisturbed text."""
    p, d1 = faults["p"], faults["d1"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = offline.generate([VICTIM], params)[0]
    ids = ref.prompt_token_ids
    with channel(d1) as ch:  # the router has paired them already; this is idempotent
        wk_grpc.DecodeServiceStub(ch).Connect(wk.ConnectRequest(prefill_address=p), timeout=30)
    first = _prefill(p, "victim", ids, 16)
    failures = stats(d1).num_load_failures
    expired = stats(p).num_leases_expired
    topo = faults["topology"]
    topo.kill(d1, signal.SIGSTOP)
    got: dict[str, object] = {}

    def decode() -> None:
        req = wk.DecodeRequest(request_id="victim", prompt_token_ids=ids,
                               first_token_id=first.delta.token_ids[0],
                               sampling=greedy(16, ignore_eos=True), handle=first.handle,
                               prefill_address=p)
        try:
            with channel(d1) as ch:
                got["msgs"] = list(wk_grpc.DecodeServiceStub(ch).Decode(req, timeout=60))
        except grpc.RpcError as e:
            got["error"] = (e.code(), e.details())

    thread = threading.Thread(target=decode)
    try:
        thread.start()
        _wait_for(lambda: stats(p).num_leases_expired > expired, WAIT_S,
                  "the victim's lease never expired")
        _fill(p, offline)
    finally:
        topo.kill(d1, signal.SIGCONT)
    thread.join(timeout=60)
    assert "error" not in got, got
    tokens, text = joined([first, *got["msgs"]])
    assert (tokens, text) == (ref.token_ids, ref.text)
    assert stats(d1).num_load_failures == failures + 1  # noticed, then recomputed


def test_a_pull_that_starts_after_its_lease_expired_recomputes(faults, offline):
    """The handle reaches the decode worker after the lease has expired (a slow queue, a
    pause, clock skew): the pull is caught, the prompt recomputed, nothing hangs."""
    p, d1 = faults["p"], faults["d1"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompt = "Clock skew between two workers is a fact of life. " * 4
    ref = offline.generate([prompt], params)[0]
    expired = stats(p).num_leases_expired
    first = _prefill(p, "stale", ref.prompt_token_ids, 12)
    _wait_for(lambda: stats(p).num_leases_expired > expired, WAIT_S, "no expiry")
    failures = stats(d1).num_load_failures
    t0 = time.monotonic()
    msgs = _decode(d1, p, "stale", ref.prompt_token_ids, first, greedy(12))
    assert time.monotonic() - t0 < 5  # nothing hangs: 30 ms idle
    assert joined([first, *msgs]) == (ref.token_ids, ref.text)
    assert stats(d1).num_load_failures == failures + 1


def _decode(decode: str, prefill: str, rid: str, ids: list[int], first, sampling):
    req = wk.DecodeRequest(request_id=rid, prompt_token_ids=ids,
                           first_token_id=first.delta.token_ids[0], sampling=sampling,
                           handle=first.handle, prefill_address=prefill)
    with channel(decode) as ch:
        return list(wk_grpc.DecodeServiceStub(ch).Decode(req, timeout=60))


def test_a_frozen_prefill_worker_is_treated_as_dead(faults, offline):
    """SIGSTOP: alive, silent. A pull from it cannot be confirmed, so the decode worker
    recomputes; the router stops sending it prompts, and a prompt stuck on it moves on."""
    p, d1, router, topo = faults["p"], faults["d1"], faults["router"], faults["topology"]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    prompt = "A worker that stops answering is as good as gone. " * 3
    ref = offline.generate([prompt], params)[0]
    first = _prefill(p, "frozen-source", ref.prompt_token_ids, 10)
    failures = stats(d1).num_load_failures
    topo.kill(p, signal.SIGSTOP)
    try:
        t0 = time.monotonic()  # the pull lands, the lease check gets no answer
        msgs = _decode(d1, p, "frozen-source", ref.prompt_token_ids, first, greedy(10))
        assert joined([first, *msgs]) == (ref.token_ids, ref.text)
        assert stats(d1).num_load_failures == failures + 1
        # The lease check gives up after its 3 s (CONFIRM_TIMEOUT_S): ten times that
        # bounds it, short of the call's own 60 s.
        assert time.monotonic() - t0 < 30
        t0 = time.monotonic()  # through the router: the prompt goes to a decode worker
        msgs = run(router, gen.GenerateRequest(text=prompt, sampling=greedy(10)))
        assert joined(msgs) == (ref.token_ids, ref.text)
        # At most the router's worker timeout (3 s) and a poll, if it has not called the
        # worker down yet: ten times that.
        assert time.monotonic() - t0 < 35
    finally:
        topo.kill(p, signal.SIGCONT)
    _wait_for(lambda: stats(p).num_leases == 0, WAIT_S, "the lease was never freed")


def test_a_frozen_decode_worker_mid_stream_hands_over(faults, offline):
    router, topo = faults["router"], faults["topology"]
    # Long enough that the tiny model is still decoding when the fourth reply arrives.
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    prompt = "Count the waves as they come in, one by one. "
    ref = offline.generate([prompt], params)[0]
    until_served(router, gen.GenerateRequest(text="hi", sampling=greedy(2)))
    msgs, frozen, arrived = [], [], []  # arrived: from the freeze on
    try:
        with channel(router) as ch:
            req = gen.GenerateRequest(text=prompt, sampling=greedy(400, ignore_eos=True))
            for msg in gen_grpc.GenerationStub(ch).Generate(req, timeout=60):
                msgs.append(msg)
                if frozen:
                    arrived.append(time.monotonic())
                if len(msgs) == 4:
                    victim = running_worker(faults, ("d1", "d2"))
                    topo.kill(faults[victim], signal.SIGSTOP)
                    frozen.append(victim)
                    arrived.append(time.monotonic())
    finally:
        for victim in frozen:
            topo.kill(faults[victim], signal.SIGCONT)
    assert joined(msgs) == (ref.token_ids, ref.text)
    # The stream's one long wait is the worker timeout (3 s) and a poll, 3.5 s idle (what
    # the victim sent before it froze arrives first): ten times that, short of the 60 s
    # the stream would wait on the frozen worker.
    assert max(b - a for a, b in zip(arrived, arrived[1:], strict=False)) < 35


def test_sigterm_on_the_prefill_worker_hands_over_what_it_holds(faults, offline):
    """A prefill worker told to stop finishes the prompts it holds and hands their KV to
    the decode workers (no recompute); health reads NOT_SERVING meanwhile; every request
    gets the undisturbed text. Runs last: the prefill worker is gone afterwards."""
    p, topo = faults["p"], faults["topology"]
    # A router of its own that waits a minute before it calls a silent worker down: the
    # decode workers are paused below for as long as the prefill worker takes to hold a
    # lease, which on a loaded machine is more than the module router's 3 s.
    router = topo.start("router", "--prefill", p, "--decode", faults["d1"], "--decode",
                        faults["d2"], "--worker-timeout", "60")
    until_served(router, gen.GenerateRequest(text="hi", sampling=greedy(2)))
    # About 100 tokens each: four fit in the prefill worker's pool at once, so when the
    # drain starts some are still waiting, some prefilling, some held under leases.
    prompts = [f"Drain probe {i}: tell me about harbours and their ships. " * 8
               for i in range(6)]
    want = offline.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    before = {d: stats(faults[d]) for d in ("d1", "d2")}
    results: dict[int, object] = {}

    def client(i: int) -> None:
        try:
            results[i] = joined(run(router, gen.GenerateRequest(text=prompts[i],
                                                                sampling=greedy(8))))
        except grpc.RpcError as e:
            results[i] = (e.code(), e.details())

    # The decode workers pause (for less than the router's --worker-timeout), so the
    # prefill worker still holds leases when the drain starts, and the drain waits on them.
    for d in ("d1", "d2"):
        topo.kill(faults[d], signal.SIGSTOP)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    try:
        for t in threads:
            t.start()
        # Every request in the prefill worker (one that arrives after the drain starts is
        # refused, by design, and there is no other prefill worker) and one held already.
        def all_in_and_one_held() -> bool:
            s = stats(p)
            return s.num_leases > 0 and s.num_waiting + s.num_running + s.num_leases >= 6

        _wait_for(all_in_and_one_held, 30, "the prefill worker holds no lease, or not all six")
        proc = topo.kill(p, signal.SIGTERM)
        STOPPED.add(p)
        _wait_for(lambda: health(p) != health_pb2.HealthCheckResponse.SERVING, 60,
                  "health still says SERVING")
        status = health(p)  # in the drain: it still answers, NOT_SERVING
    finally:
        for d in ("d1", "d2"):
            topo.kill(faults[d], signal.SIGCONT)
    for t in threads:
        t.join(timeout=120)
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert [results.get(i) for i in range(6)] == [(w.token_ids, w.text) for w in want]
    assert proc is not None and proc.wait(timeout=60) == 0
    after = {d: stats(faults[d]) for d in ("d1", "d2")}
    assert sum(after[d].num_load_failures - before[d].num_load_failures for d in after) == 0
    assert sum(after[d].num_blocks_pulled - before[d].num_blocks_pulled for d in after) > 0

