"""One disaggregated topology (router, prefill, decode over NIXL) per test session, on
the tiny serving model: these tests check the mechanics of serving (routing, transfer,
failures, APIs) against an offline engine of the same model. The default model is served
once too (`smollm`), for fidelity (tests/e2e/test_real_model.py) and for what a
random tiny model cannot show (test_structured_and_spec.py: drafts that are accepted).

Both are stopped after the last test that takes them (`pytest_runtest_teardown` below),
not at the session's end: an idle worker still spends 4% of a core (the router's polls
and their answers, gRPC's and the metrics server's threads), and seven of them idling
through the rest of a run took 20-30 s of a 2-core machine's 300."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.e2e.helpers import all_free_within, stats
from tests.e2e.topology import Topology
from tests.xdist_groups import group

# The session's shared services, by fixture name: how to stop them, once their last
# test has run; and the names already stopped.
SHARED_SERVICES = ("topology", "smollm")
STOPPERS: dict[str, Callable[[], None]] = {}
STOPPED: set[str] = set()


@pytest.fixture(scope="session")
def topology(tmp_path_factory, tiny_model):
    topo = Topology(tmp_path_factory.mktemp("services"), tiny_model)
    STOPPERS["topology"] = topo.stop
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
    STOPPERS["smollm"] = topo.stop
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
    for name in STOPPED & set(request.fixturenames):
        pytest.fail(f"the session's {name!r} services were stopped after the last test "
                    f"that takes it as an argument (tests/xdist_groups.py): take it so")
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


def _last_of_each_group(session) -> dict[str, str]:
    """For each shared fixture with a stopper: the nodeid of the last test in this
    session's order whose module takes it (tests/xdist_groups.py: a group runs whole on
    one test process, in that order)."""
    last: dict[str, str] = {}
    for item in session.items:
        name = group(session.config.rootpath, item.nodeid.split("::")[0])
        if name in SHARED_SERVICES:
            last[name] = item.nodeid
    return last


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a shared fixture's group has torn down: its services stop."""
    yield
    session = item.session
    if not hasattr(session, "_baton_last_of_group"):
        session._baton_last_of_group = _last_of_each_group(session)
    for name, nodeid in session._baton_last_of_group.items():
        if nodeid == item.nodeid and name in STOPPERS and name not in STOPPED:
            STOPPED.add(name)
            STOPPERS[name]()
