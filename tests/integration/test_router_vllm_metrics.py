"""The front door of a disaggregated cluster exports vLLM's metric names (`vllm:`) for the
whole request, from its arrival at the router to its end, beside Baton's (`baton:`), as
`vllm serve` does on its port; each name once per process, colocated included."""

from __future__ import annotations

import asyncio

from baton.router.metrics import RouterMetrics
from baton.services.engine.outputs import EngineStats
from baton.services.rpc.metrics import union
from baton.services.worker.metrics import WorkerMetrics
from tests.integration.test_local_prefill import _until, run
from tests.router_fakes import PROMPT, cluster, expected, tokens


def _reader(c):
    registry = c.router.metrics.registry

    def value(name: str, **labels) -> float:
        return registry.get_sample_value(name, {"model_name": "fake", **labels}) or 0.0

    return value


def test_the_router_exports_vllms_names_for_the_whole_disaggregated_request(tok):
    async def main():
        async with cluster(tok) as c:  # a prefill and a decode worker
            value, d = _reader(c), c.decode[0]
            d.gate, d.ungated = asyncio.Event(), 1  # the decode worker's second token waits
            stream = asyncio.create_task(c.generate(PROMPT, 6))
            await _until(lambda: value("vllm:num_requests_running") == 1)
            assert value("vllm:num_requests_waiting") == 0  # it has its first token
            d.gate.set()
            outs = [await stream] + [await c.generate(PROMPT, 6) for _ in range(2)]
            assert [tokens(o) for o in outs] == [expected(PROMPT, 6)] * 3
            # Each request once, whole: its first token from the prefill worker, the other
            # five from the decode worker.
            assert value("vllm:request_success_total", finished_reason="length") == 3
            for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                         "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                         "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
                assert value(f"{name}_count") == 3, name
            for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
                assert value(f"{name}_count") == 3 * 5, name
            assert value("vllm:request_generation_tokens_sum") == 3 * 6
            assert value("vllm:generation_tokens_total") == 3 * 6
            assert value("vllm:request_prompt_tokens_sum") == 3 * len(PROMPT)
            assert value("vllm:prompt_tokens_total") == 3 * len(PROMPT)
            assert value("vllm:num_requests_running") == value("vllm:num_requests_waiting") == 0
            # Baton's own, beside them.
            assert value("baton:request_success_total", finished_reason="length") == 3
            assert value("baton:time_to_first_token_seconds_count") == 3

    run(main())


def test_a_request_without_its_first_token_is_waiting(tok):
    async def main():
        async with cluster(tok, prefills=0) as c:  # the decode worker computes the prompt
            value, d = _reader(c), c.decode[0]
            d.gate = asyncio.Event()  # even its first token waits
            stream = asyncio.create_task(c.generate(PROMPT, 3))
            await _until(lambda: value("vllm:num_requests_waiting") == 1)
            assert value("vllm:num_requests_running") == 0
            d.gate.set()
            assert tokens(await stream) == expected(PROMPT, 3)
            assert value("vllm:num_requests_waiting") == 0
            assert value("vllm:request_success_total", finished_reason="length") == 1

    run(main())


def test_each_name_once_on_a_port_colocated_included():
    worker = WorkerMetrics(lambda: EngineStats(num_blocks=4, num_free_blocks=4), "m", 1)
    for router, vllm in ((RouterMetrics("m"), True), (RouterMetrics("m", vllm=False), False)):
        names = [f.name for f in router.registry.collect()]
        assert ("vllm:time_to_first_token_seconds" in names) is vllm
        assert ("vllm:num_requests_running" in names) is vllm
    # Colocated: the router's Baton names and the engine's full set, each name once.
    names = [f.name for f in union([RouterMetrics("m", vllm=False).registry,
                                    worker.registry]).collect()]
    assert len(names) == len(set(names))
    assert "vllm:time_to_first_token_seconds" in names and "baton:workers" in names
