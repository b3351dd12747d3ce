"""One disaggregated topology (router, prefill, decode over NIXL) per test session, on
the tiny serving model: these tests check the mechanics of serving (routing, transfer,
failures, APIs) against an offline engine of the same model. The default model is served
once too (`smollm`), for fidelity (tests/e2e/test_real_model.py) and for what a
random tiny model cannot show (test_structured_and_spec.py: drafts that are accepted)."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import all_free_within, stats
from tests.e2e.topology import Topology


@pytest.fixture(scope="session")
def topology(tmp_path_factory, tiny_model):
    topo = Topology(tmp_path_factory.mktemp("services"), tiny_model)
    try:  # the router answers SERVING once it has paired the workers
        yield {**topo.disaggregated("nixl"), "topology": topo}
    finally:
        topo.stop()


@pytest.fixture(scope="session")
def smollm(tmp_path_factory, model_path):
    """The default model as a colocated server, and a prefill + decode pair over NIXL
    behind a router, whose decode worker speculates (n-gram, 4 tokens: drafts change no
    greedy token). The modules that take it run on one test process
    (tests/xdist_groups.py), which starts it once."""
    topo = Topology(tmp_path_factory.mktemp("default"), model_path)
    try:
        prefill = topo.worker("prefill", "--kv-transport", "nixl", wait=False)
        decode = topo.worker("decode", "--kv-transport", "nixl", "--speculative-method",
                             "ngram", "--num-speculative-tokens", "4", wait=False)
        colocated = topo.worker("colocated", wait=False)
        router = topo.start("router", "--prefill", prefill, "--decode", decode)
        yield {"colocated": colocated, "router": router, "prefill": prefill,
               "decode": decode, "topology": topo}
    finally:
        topo.stop()


@pytest.fixture(scope="session")
def smollm_offline(make_llm):
    """The default model offline, as its workers run it (fp32, 256-token steps)."""
    return make_llm(dtype="float32", max_num_batched_tokens=256)


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
def offline(make_llm, tiny_model):
    """The offline engine the services' greedy text must equal (fp32, as the workers)."""
    return make_llm(model=str(tiny_model), dtype="float32", max_num_batched_tokens=256)


def both_free_within(topology, seconds: float) -> bool:
    """Whether both workers of `topology` hold nothing within `seconds`."""
    return all_free_within([topology["prefill"], topology["decode"]], seconds)
