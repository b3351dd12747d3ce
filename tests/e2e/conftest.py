"""One disaggregated topology (router, prefill, decode over NIXL) per test session, on
the tiny serving model: these tests check the mechanics of serving (routing, transfer,
failures, APIs) against an offline engine of the same model. tests/e2e/test_real_model.py
serves the default model once, for fidelity."""

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
