"""Scale-out on real processes: decode workers found through DNS (a test DNS server, the
workers on 127.0.0.1-4 behind one name), routing on their KV events, and conditional
disaggregation."""

from __future__ import annotations

import itertools
import signal
import threading
import time

import grpc
import httpx
import pytest

from baton.services.common.sampling_params import SamplingParams
from baton.services.rpc.processes import wait_healthy
from baton.v1 import generation_pb2 as gen
from baton.worker.v1 import worker_pb2 as wk
from baton.worker.v1 import worker_pb2_grpc as wk_grpc
from tests.dns_server import DnsServer
from tests.e2e.helpers import all_free_within, greedy, joined, metric_value, run, stats
from tests.e2e.topology import Topology, channel, free_port

NAME = "decode.baton.test"
PREFIX = ("You are the support assistant of a bicycle shop. Answer in one short sentence, "
          "politely, and never invent prices. The shop opens at nine and closes at six; it "
          "repairs every kind of bicycle, sells helmets, locks and lights, and rents city "
          "bikes by the day. ")
QUESTIONS = ["When do you open?", "Do you rent bikes?", "Can you fix a flat tyre?",
             "Do you sell lights?"]


@pytest.fixture(scope="module")
def scale(tmp_path_factory, tiny_model):
    dns = DnsServer()
    topo = Topology(tmp_path_factory.mktemp("scale"), tiny_model)
    port = free_port()
    try:
        prefill = topo.worker("prefill", wait=False)
        decodes = [topo.worker("decode", host=f"127.0.0.{i}", port=port, wait=False)
                   for i in (1, 2, 3)]
        dns.set(NAME, ["127.0.0.1", "127.0.0.2", "127.0.0.3"])
        router = topo.start("router", "--prefill", prefill, "--decode",
                            f"dns://127.0.0.1:{dns.port}/{NAME}:{port}",
                            "--discovery-interval", "0.5", "--local-prefill-hit", "0.9")
        scale = {"router": router, "prefill": prefill, "decodes": decodes, "port": port,
                 "dns": dns, "topology": topo}
        # SERVING comes with the first decode worker (it can serve alone); wait until the
        # router has seen every worker up, so the first request is disaggregated.
        deadline = time.monotonic() + 60
        while _up(scale, "prefill") < 1 or _up(scale, "decode") < 3:
            assert time.monotonic() < deadline, _metrics(scale)
            time.sleep(0.2)
        wait_healthy(router, topo.procs[-1], timeout=30)  # and has paired them
        yield scale
    finally:
        topo.stop()
        dns.close()


def _events(address: str) -> set[bytes]:
    with channel(address) as ch:
        reply = wk_grpc.WorkerServiceStub(ch).GetKvEvents(wk.GetKvEventsRequest(), timeout=5)
    assert reply.snapshot and reply.block_size == 16
    return set(reply.stored)


def test_a_prefix_held_by_a_decode_worker_is_prefilled_there(scale, offline):
    """The first request of a prefix is disaggregated; once the router has the KV events
    of the decode worker that now holds the prefix (it polls them every 0.5 s; until then
    the next ones are disaggregated too), the next is routed there and computed there:
    the router's expectation (from KV events, hashed as the engine hashes) equals the hit
    the engine reports."""
    router = scale["router"]
    texts = [PREFIX + q for q in QUESTIONS]
    want = offline.generate(texts, SamplingParams(max_tokens=12, temperature=0.0))
    first = run(router, gen.GenerateRequest(text=texts[0], sampling=greedy(12)))
    assert not first[-1].timings.local_prefill and first[-1].timings.kv_transfer_s > 0
    assert joined(first) == (want[0].token_ids, want[0].text)
    holders = [d for d in scale["decodes"] if _events(d)]
    assert len(holders) == 1  # the worker that pulled the KV reports its blocks
    deadline = time.monotonic() + 60
    for i in itertools.cycle(range(1, len(texts))):  # the other questions, in turn
        assert time.monotonic() < deadline, "never prefilled on the decode worker"
        routed = metric_value(_metrics(scale), "baton:routed_expected_cached_blocks_total")
        second = run(router, gen.GenerateRequest(text=texts[i], sampling=greedy(12)))
        assert joined(second) == (want[i].token_ids, want[i].text)
        if second[-1].timings.local_prefill:
            break
    t, usage = second[-1].timings, second[-1].usage
    assert t.local_prefill and t.kv_transfer_s == 0
    assert t.expected_cached_blocks >= 3
    assert t.expected_cached_blocks * 16 == usage.cached_tokens
    assert all_free_within([scale["prefill"], *scale["decodes"]], 20.0)
    metrics = _metrics(scale)
    assert metric_value(metrics, "baton:local_prefills_total") == 1
    assert metric_value(metrics, "baton:routed_expected_cached_blocks_total") - routed == \
        t.expected_cached_blocks


def test_decode_workers_come_and_go_behind_one_name_and_no_request_fails(scale, offline):
    router, port, dns, topo = scale["router"], scale["port"], scale["dns"], scale["topology"]
    texts = [PREFIX + q for q in QUESTIONS]
    want = [(w.token_ids, w.text) for w in offline.generate(
        texts, SamplingParams(max_tokens=16, temperature=0.0))]
    failures, served = [], [0]
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                got = joined(run(router, gen.GenerateRequest(text=texts[i],
                                                             sampling=greedy(16))))
                if got != want[i]:
                    failures.append(f"request {i}: {got} != {want[i]}")
                served[0] += 1
            except grpc.RpcError as e:
                failures.append(f"request {i}: {e.code().name} {e.details()}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()

    def until(check, what: str) -> None:
        deadline = time.monotonic() + 60
        while not check():
            assert time.monotonic() < deadline and not failures, (what, failures)
            time.sleep(0.2)

    try:
        until(lambda: served[0] >= 4, "requests served before the kill")
        gone = f"127.0.0.2:{port}"
        topo.kill(gone, signal.SIGKILL)
        dns.set(NAME, ["127.0.0.1", "127.0.0.3"])
        new = topo.worker("decode", host="127.0.0.4", port=port)  # waits until healthy
        dns.set(NAME, ["127.0.0.1", "127.0.0.3", "127.0.0.4"])
        t0 = time.monotonic()
        until(lambda: stats(new).num_generation_tokens > 0, "the router used the new worker")
        followed = time.monotonic() - t0
        after = served[0]
        until(lambda: served[0] >= after + 4, "requests served after")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert failures == []
    assert served[0] >= 8
    assert _up(scale, "decode") == 3  # 127.0.0.1, .3 and .4
    print(f"the router used the new decode worker {followed:.1f}s after its DNS record")
    assert all_free_within([scale["prefill"], f"127.0.0.1:{port}", f"127.0.0.3:{port}", new],
                           20.0)


def _metrics(scale) -> str:
    http = scale["topology"].http[scale["router"]]
    return httpx.get(f"http://{http}/metrics", timeout=10).text


def _up(scale, role: str) -> float:
    """The router's count of `role` workers up (its baton:workers gauge)."""
    return metric_value(_metrics(scale), "baton:workers", role=role, state="up")
