"""One disaggregated topology (router, prefill, decode over NIXL) per test session."""

from __future__ import annotations

import time

import pytest

from baton.v1 import worker_pb2 as wk
from baton.v1 import worker_pb2_grpc as wk_grpc
from tests.e2e.topology import Topology, channel


@pytest.fixture(scope="session")
def topology(tmp_path_factory, model_path):
    topo = Topology(tmp_path_factory.mktemp("services"))
    try:
        services = topo.disaggregated("nixl")
        _wait_paired(services["router"], services["decode"])
        yield {**services, "topology": topo}
    finally:
        topo.stop()


def _wait_paired(router: str, decode: str, timeout: float = 30.0) -> None:
    """The router's first poll makes the decode worker shake hands with the prefill."""
    from baton.v1 import generation_pb2 as gen
    from baton.v1 import generation_pb2_grpc as gen_grpc

    deadline = time.monotonic() + timeout
    with channel(router) as ch:
        stub = gen_grpc.GenerationStub(ch)
        while time.monotonic() < deadline:
            try:
                req = gen.GenerateRequest(text="hi", sampling=gen.SamplingParams(max_tokens=2))
                list(stub.Generate(req, timeout=30))
                return
            except Exception:  # noqa: BLE001 - not paired yet
                time.sleep(0.2)
    raise TimeoutError("router never paired the workers")


@pytest.fixture(autouse=True)
def topology_stays_clean(request):
    """The e2e leak check: after each test that used the session topology, every block of
    both workers is free again and no lease or request is left (within a few seconds:
    releases and aborts travel over RPCs)."""
    yield
    if "topology" not in request.fixturenames:
        return
    topo = request.getfixturevalue("topology")
    assert both_free_within(topo, 5.0), (
        f"leaked on a worker after the test: {stats(topo['prefill'])} {stats(topo['decode'])}")


@pytest.fixture(scope="session")
def offline(make_llm):
    """The offline engine the services' greedy text must equal (fp32, as the workers)."""
    return make_llm(dtype="float32", max_num_batched_tokens=256)


def all_free(address: str) -> bool:
    s = stats(address)
    return (s.num_free_blocks == s.num_blocks and s.num_running == s.num_waiting ==
            s.num_loading == s.num_leases == 0)


def both_free_within(topology, seconds: float) -> bool:
    """Whether both workers of `topology` hold nothing within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        if all_free(topology["prefill"]) and all_free(topology["decode"]):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def stats(address: str) -> wk.GetStatsResponse:
    with channel(address) as ch:
        return wk_grpc.WorkerServiceStub(ch).GetStats(wk.GetStatsRequest(), timeout=5)
