"""A worker's metrics under vLLM's own names (`vllm:`), beside Baton's (`baton:`), so that
dashboards, alerts and the Gateway API Inference Extension's endpoint picker read a Baton
worker as they read a vLLM server: the same names, the same `model_name` label (the
served model name) and the same histogram buckets (defined once, services/rpc/
vllm_metrics.py, with the router's).

The gauges and token counters are read at scrape time from the engine thread's stats
snapshot. The request histograms and `vllm:request_success_total` come from each
request's outputs as they reach the event loop (`AsyncEngine.observer`): times are
measured where this worker sees the request, from its arrival here. A prefill worker's
request that is handed off records its first token (time to first token, queue and
prefill times) and ends on a decode worker, which records the rest of it."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.outputs import EngineStats, RequestOutput
from ..rpc import vllm_metrics as names
from ..rpc.vllm_metrics import VllmRequestMetrics


def _kv_usage(s: EngineStats) -> float:
    return 1 - s.num_free_blocks / max(1, s.num_blocks)


_KV = "KV cache usage (1 = full)"
GAUGES: dict[str, tuple[str, Callable[[EngineStats], float]]] = {  # name: (help, read)
    names.RUNNING: (names.HELP[names.RUNNING], lambda s: s.num_running),
    names.WAITING: (names.HELP[names.WAITING], lambda s: s.num_waiting + s.num_loading),
    "vllm:kv_cache_usage_perc": (_KV, _kv_usage),
    # The name vLLM had before kv_cache_usage_perc; older endpoint pickers read it.
    "vllm:gpu_cache_usage_perc": (_KV + "; as vllm:kv_cache_usage_perc", _kv_usage),
}
COUNTERS: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    names.PROMPT_TOKENS: (names.HELP[names.PROMPT_TOKENS], lambda s: s.num_prompt_tokens),
    names.GENERATION_TOKENS: (names.HELP[names.GENERATION_TOKENS],
                              lambda s: s.num_generation_tokens),
    "vllm:num_preemptions": ("Requests preempted", lambda s: s.num_preemptions),
    "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                  lambda s: s.prefix_cache_queries),
    "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache",
                               lambda s: s.prefix_cache_hits),
}


class VllmMetrics(VllmRequestMetrics):
    """Registers itself (for the snapshot's families) and its histograms in `registry`."""

    def __init__(self, registry: CollectorRegistry, stats: Callable[[], EngineStats],
                 model_name: str):
        self._stats, self.model = stats, model_name
        registry.register(self)
        super().__init__(registry)

    def collect(self):
        s = self._stats()
        for name, (help_text, read) in GAUGES.items():
            yield names.family(GaugeMetricFamily, name, help_text, self.model, read(s))
        for name, (help_text, read) in COUNTERS.items():
            yield names.family(CounterMetricFamily, name, help_text, self.model, read(s))

    def describe(self):
        return []  # collected fresh at each scrape

    def request(self) -> Callable[[RequestOutput], None]:
        """For a request arriving now: the function its outputs go through."""
        return _Request(self).output


class _Request:
    def __init__(self, metrics: VllmMetrics):
        self.m = metrics
        self.arrival = time.monotonic()
        self.last: float | None = None  # when its latest token came

    def output(self, out: RequestOutput) -> None:
        m, model = self.m, self.m.model
        now, n = time.monotonic(), len(out.new_token_ids)
        last = self.last
        if n and last is None:
            m.first_token(model, now - self.arrival, out.queue_time, out.prefill_time)
        elif n and last is not None:
            m.tokens(model, n, now - last)
        if n:
            self.last = now
        if out.finished and not out.engine_failed and out.finish_reason is not None:
            m.finished(model, out.finish_reason, now - self.arrival,
                       len(out.prompt_token_ids), len(out.token_ids))
