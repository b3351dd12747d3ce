"""Tensor-parallel workers as services: a prefill worker with TP=2 hands its KV to a decode
worker with TP=1 over NIXL, and a TP=1 prefill worker to a TP=2 decode worker over the gRPC
stream, each behind a router: the offline engine's greedy text, every block free and no
lease left after. One worker spanning two "nodes" on loopback (--nnodes 2) serves the same
text; a rank that dies takes its worker down (health NOT_SERVING, then the process ends
non-zero) and the router moves its stream to another decode worker; over two nodes, a
request ends with an error rather than hanging."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from baton.services.engine import SamplingParams
from baton.v1 import generation_pb2 as gen
from baton.v1 import generation_pb2_grpc as gen_grpc
from tests.e2e.helpers import (
    all_free_within,
    greedy,
    health,
    joined,
    run,
    running_worker,
    stats,
    stream_diff,
    until_served,
)
from tests.e2e.topology import Topology, channel, free_port

PROMPTS = ["The three primary colours are", "Paged KV blocks move between ranks. " * 6]


@pytest.fixture(scope="module")
def services(tmp_path_factory, tiny_model):
    topo = Topology(tmp_path_factory.mktemp("tp"), tiny_model)
    try:
        p2 = topo.worker("prefill", "--kv-transport", "nixl", "--tensor-parallel-size", "2",
                         wait=False)
        d1 = topo.worker("decode", "--kv-transport", "nixl", wait=False)
        p1 = topo.worker("prefill", "--kv-transport", "grpc", wait=False)
        d2 = topo.worker("decode", "--kv-transport", "grpc", "--tensor-parallel-size", "2",
                         wait=False)
        spare = topo.worker("decode", "--kv-transport", "grpc", wait=False)
        nixl = topo.start("router", "--prefill", p2, "--decode", d1, wait=False)
        grpc_router = topo.start("router", "--prefill", p1, "--decode", d2, wait=False)
        # Both decode workers: where the TP=2 one's requests move when a rank dies.
        both = topo.start("router", "--prefill", p1, "--decode", d2, "--decode", spare,
                          "--worker-timeout", "60")
        yield {"topology": topo, "nixl": (nixl, p2, d1), "grpc": (grpc_router, p1, d2),
               "both": both, "d2": d2, "spare": spare}
    finally:
        topo.stop()


def _ranks(pid: int) -> list[int]:
    """The processes a worker spawned for its ranks (not multiprocessing's tracker)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    kids = [int(p) for p in path.read_text().split()] if path.exists() else []
    return [k for k in kids
            if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


@pytest.mark.parametrize("pair", ["nixl", "grpc"])
def test_pd_between_tp_sizes_gives_the_offline_text(services, offline, pair):
    router, prefill, decode = services[pair]
    want = offline.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0))
    # A router may serve before its decode worker has paired with the prefill worker (the
    # decode worker then computes the prompt): warm up until a request is handed over.
    deadline = time.monotonic() + 60
    while until_served(router, gen.GenerateRequest(text="warm up", sampling=greedy(2))
                       )[-1].timings.local_prefill:
        assert time.monotonic() < deadline, "the decode worker never pulled a prompt"
        time.sleep(0.2)
    before = stats(decode).num_blocks_pulled
    for prompt, ref in zip(PROMPTS, want, strict=True):
        msgs = until_served(router, gen.GenerateRequest(text=prompt, sampling=greedy(20)))
        assert joined(msgs) == (ref.token_ids, ref.text)
        assert not msgs[-1].timings.local_prefill, "the prompt was meant to be handed over"
    assert stats(decode).num_blocks_pulled - before == sum(
        -(-len(r.prompt_token_ids) // 16) for r in want)
    assert all_free_within([prefill, decode], 5.0), (stats(prefill), stats(decode))


def test_a_dead_rank_takes_its_worker_down_and_the_router_moves_its_stream(services,
                                                                           offline):
    """A long stream decoding on the TP=2 worker when its rank 1 is killed: the worker
    turns NOT_SERVING and exits non-zero, and the router hands the stream to the other
    decode worker: the client still gets the offline text, whole."""
    topo: Topology = services["topology"]
    n = 600
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    worker = topo.process(services["d2"])
    for attempt in range(8):  # until the router puts one on the TP=2 worker
        prompt = f"{attempt}: " + PROMPTS[1]
        req = gen.GenerateRequest(text=prompt, sampling=greedy(n, ignore_eos=True))
        msgs, killed = [], []
        with channel(services["both"]) as ch:
            for msg in gen_grpc.GenerationStub(ch).Generate(req, timeout=180):
                msgs.append(msg)
                if len(msgs) == 6 and not killed:
                    on = running_worker(services, ("d2", "spare"))
                    if on != "d2":
                        break
                    ranks = _ranks(worker.pid)
                    assert ranks, "the TP=2 decode worker was meant to run its rank 1"
                    os.kill(ranks[0], signal.SIGKILL)
                    killed.append(ranks[0])
        if killed:
            break
    assert killed, "the router never put a request on the TP=2 decode worker"
    ref = offline.generate([prompt], params)[0]  # of the stream that moved only
    assert joined(msgs) == (ref.token_ids, ref.text), stream_diff(msgs, ref.token_ids,
                                                                  ref.text)
    deadline = time.monotonic() + 30
    while health(services["d2"]) == health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "health stayed SERVING after a rank died"
        time.sleep(0.05)
    assert worker.wait(timeout=60) != 0, "the worker was meant to stop itself, failed"


def test_one_worker_over_two_nodes_on_loopback(tmp_path_factory, tiny_model, offline):
    topo = Topology(tmp_path_factory.mktemp("nodes"), tiny_model)
    meet = f"127.0.0.1:{free_port()}"
    flags = ("--tensor-parallel-size", "2", "--nnodes", "2", "--distributed-init-address",
             meet)
    try:  # the workers' small fp32 engine (topology.WORKER_FLAGS), as the offline one
        topo.worker("colocated", *flags, "--node-rank", "1", healthy=False, wait=False)
        address = topo.worker("colocated", *flags, "--node-rank", "0")
        want = offline.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0))
        for prompt, ref in zip(PROMPTS, want, strict=True):
            msgs = run(address, gen.GenerateRequest(text=prompt, sampling=greedy(16)))
            assert joined(msgs) == (ref.token_ids, ref.text)
        # Node 1 is a process of its own, not a child: the idle worker's heartbeat to its
        # ranks finds it gone, with no request to run.
        node1 = topo.procs[0]
        node1.send_signal(signal.SIGKILL)
        node1.wait()
        deadline = time.monotonic() + 30
        while health(address) == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "health stayed SERVING after node 1 died"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError):
            run(address, gen.GenerateRequest(text=PROMPTS[0], sampling=greedy(16)),
                timeout=60)
        assert topo.procs[1].wait(timeout=60) != 0, "the worker was meant to exit, failed"
    finally:
        topo.stop()
