"""A prefill worker killed and restarted on its address (a new engine id) is used again:
paired in the background as soon as a poll finds it, and a request that comes before the
handshake ends waits for it instead of having its prompt computed on a decode worker; the
router stays SERVING meanwhile. Every prompt a decode worker does compute says why: a log
line and `baton:local_prefills_total{reason}` (router/fallback.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.router import fallback, registry
from baton.router.metrics import RouterMetrics
from tests.router_fakes import PROMPT, cluster, expected, tokens


def run(coro):
    return asyncio.run(coro)


async def _until(check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.005)


def _count(c, reason: str) -> float:
    return c.router.metrics.registry.get_sample_value(
        "baton:local_prefills_total", {"model_name": "fake", "reason": reason}) or 0.0


def _said(caplog, reason: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == fallback.__name__ and f"({reason})" in r.getMessage()]


def test_a_restarted_prefill_worker_is_waited_for_while_it_pairs_then_used(tok, monkeypatch):
    # However slow the machine, the request below comes within the wait.
    monkeypatch.setattr(registry, "PAIRING_WAIT_S", 60.0)

    async def main():
        async with cluster(tok) as c:
            d = c.decode[0]
            d.connect_hangs = True  # the next handshake holds (a transport's first transfer)
            p = await c.restart(c.prefill[0])
            await _until(lambda: d.connects == 2)  # seen back: the handshake began
            stream = asyncio.create_task(c.generate(PROMPT, 4))
            await _until(lambda: c.router.inflight == 1)
            ready, why = c.registry.readiness()
            assert ready, why  # its decode worker serves meanwhile: no NOT_SERVING flap
            async with grpc.aio.insecure_channel(c.address) as ch:
                health = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            d.connect_hangs = False
            msgs = await stream
            assert tokens(msgs) == expected(PROMPT, 4)
            assert not msgs[-1].timings.local_prefill
            assert p.prefills and d.decodes[-1].handle.engine_id == p.engine_id
            assert _count(c, "prefill_unpaired") == _count(c, "prefill_down") == 0

    run(main())


def test_past_the_wait_a_pending_handshake_is_the_reason_given(tok, monkeypatch, caplog):
    monkeypatch.setattr(registry, "PAIRING_WAIT_S", 0.0)  # requests never wait

    async def main():
        async with cluster(tok) as c:
            d = c.decode[0]
            d.connect_hangs = True
            p = await c.restart(c.prefill[0])
            await _until(lambda: d.connects == 2)
            msgs = await c.generate(PROMPT, 4)
            assert tokens(msgs) == expected(PROMPT, 4)
            assert msgs[-1].timings.local_prefill and not p.prefills
            assert _count(c, "prefill_unpaired") == 1
            [line] = _said(caplog, "prefill_unpaired")
            assert p.engine_id in line and "handshake under way" in line
            d.connect_hangs = False

    with caplog.at_level(logging.WARNING):
        run(main())


def test_no_prefill_worker_up_and_every_one_failing_are_said(tok, caplog):
    async def main():
        async with cluster(tok) as c:
            p = c.prefill[0]
            p.fail_with = grpc.StatusCode.UNAVAILABLE  # it fails the prompt: the next...
            assert tokens(await c.generate(PROMPT, 3)) == expected(PROMPT, 3)
            assert _count(c, "prefill_failed") == 1
            assert p.address in _said(caplog, "prefill_failed")[0]
            p.fail_with = None
            p.freeze()  # silent: called down
            await _until(lambda: c.registry.prefill[0].state == "down")
            msgs = await c.generate(PROMPT, 3)
            assert msgs[-1].timings.local_prefill and _count(c, "prefill_down") == 1
            assert f"{p.address} down" in _said(caplog, "prefill_down")[0]
            p.thaw()

    with caplog.at_level(logging.WARNING):
        run(main())


def test_a_handle_no_decode_worker_can_pull_is_said(tok, caplog):
    async def main():
        async with cluster(tok, decodes=2) as c:
            d0, d1 = c.decode
            d1.connect_hangs = True
            c.registry.decode[1].pairs.clear()  # d1 has not paired with the prefill engine
            await c.polled()
            d0.fail_with = grpc.StatusCode.UNAVAILABLE  # the paired one fails the stream
            msgs = await c.generate(PROMPT, 4)
            assert tokens(msgs) == expected(PROMPT, 4) and msgs[-1].timings.local_prefill
            assert not d1.decodes[-1].HasField("handle")  # it computed the prompt again
            assert _count(c, "decode_unpaired") == 1
            assert "p0" in _said(caplog, "decode_unpaired")[0]
            d1.connect_hangs = False
            await c.settle()
            assert c.leases_held() == 0

    with caplog.at_level(logging.WARNING):
        run(main())


def test_a_failed_pull_the_decode_worker_recomputed_is_said(tok, caplog):
    async def main():
        async with cluster(tok) as c:
            c.decode[0].pull_fails = True
            msgs = await c.generate(PROMPT, 4)
            assert tokens(msgs) == expected(PROMPT, 4)
            assert not msgs[0].timings.local_prefill  # the first token: prefilled...
            assert msgs[-1].timings.local_prefill  # ... but the decode worker computed it
            assert _count(c, "kv_pull_failed") == 1
            assert c.decode[0].address in _said(caplog, "kv_pull_failed")[0]

    with caplog.at_level(logging.WARNING):
        run(main())


@pytest.mark.parametrize("kw, reason", [({"prefills": 0}, "no_prefill_worker"),
                                        ({"local_prefill_tokens": 64}, "short_prompt")])
def test_a_deliberate_local_prefill_is_counted_and_only_a_debug_line(tok, caplog, kw, reason):
    async def main():
        async with cluster(tok, **kw) as c:
            msgs = await c.generate(PROMPT, 3)
            assert msgs[-1].timings.local_prefill and _count(c, reason) == 1

    with caplog.at_level(logging.DEBUG, logger=fallback.__name__):
        run(main())
    assert [r.levelno for r in caplog.records if r.name == fallback.__name__] == [
        logging.DEBUG]


def test_warnings_come_once_per_reason_a_while_counting_the_rest(monkeypatch, caplog):
    clock = iter([0.0, 1.0, 2.0, 3.0, fallback.LOG_EVERY_S + 0.5])
    monkeypatch.setattr(fallback.time, "monotonic", lambda: next(clock))
    metrics = RouterMetrics("m")
    said = fallback.LocalPrefills(metrics)
    with caplog.at_level(logging.WARNING):
        for i, reason in enumerate(["prefill_down", "prefill_down", "prefill_failed",
                                    "prefill_down", "prefill_down"]):
            said.record(reason, f"r{i}", "why")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "r0" in lines[0] and "r2" in lines[1]
    assert "r4" in lines[2] and "2 more" in lines[2]
    assert metrics.registry.get_sample_value(
        "baton:local_prefills_total", {"model_name": "m", "reason": "prefill_down"}) == 4
    with pytest.raises(ValueError, match="no_such"):
        said.record("no_such", "r", "")
