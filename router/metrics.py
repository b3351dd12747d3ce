"""The router's Prometheus metrics. Names and meanings follow vLLM's (`vllm:` becomes
`baton:`), so dashboards and autoscalers written for vLLM carry over; what only a
disaggregated system has (retries, migrations, KV transfer) is added beside them.

In front of a disaggregated cluster the router also exports vLLM's own names (`vllm:`,
services/rpc/vllm_metrics.py) for the whole request, from its arrival at the front door
to its end, wherever it was prefilled and decoded: what a dashboard or an endpoint picker
pointed at the front door reads, as at `vllm serve`. Colocated, the engine's own `vllm:`
set is the whole request, and the router adds none (`vllm=False`)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from baton.services.common.finish import FinishReason
from baton.services.rpc import vllm_metrics as vllm_names
from baton.services.rpc.convert import finish_reason_of
from baton.services.rpc.metrics import (
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    TRANSFER_BUCKETS,
    TTFT_BUCKETS,
)
from baton.services.rpc.vllm_metrics import VllmRequestMetrics
from baton.v1 import generation_pb2 as gen


class RouterMetrics:
    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None,
                 vllm: bool = True):
        self.registry = registry or CollectorRegistry()
        r, label = self.registry, ["model_name"]
        self.model = model_name
        self.success = Counter("baton:request_success", "Requests that finished, by reason",
                               label + ["finished_reason"], registry=r)
        self.failure = Counter("baton:request_failure",
                               "Requests that ended with an error, by gRPC status code",
                               label + ["code"], registry=r)
        self.ttft = Histogram("baton:time_to_first_token_seconds", "Time to first token",
                              label, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("baton:inter_token_latency_seconds", "Time between tokens",
                             label, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("baton:e2e_request_latency_seconds", "Request latency",
                             label, buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("baton:request_queue_time_seconds",
                               "Time waiting in the first worker's queue", label,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.transfer = Histogram("baton:kv_transfer_seconds",
                                  "Decode worker's pull of the prompt KV", label,
                                  buckets=TRANSFER_BUCKETS, registry=r)
        self.inflight = Gauge("baton:num_requests_in_flight", "Requests in the router",
                              label, registry=r)
        self.refused = Counter("baton:admission_refusals",
                               "Requests refused at once (RESOURCE_EXHAUSTED)", label,
                               registry=r)
        self.retries = Counter("baton:prefill_retries",
                               "Prompts moved to another prefill worker", label, registry=r)
        self.migrations = Counter("baton:decode_migrations",
                                  "Streams moved to another decode worker", label,
                                  registry=r)
        self.local_prefills = Counter("baton:local_prefills",
                                      "Prompts a decode worker computed itself, by reason "
                                      "(router/fallback.py)", label + ["reason"], registry=r)
        self.expected_cached = Counter("baton:routed_expected_cached_blocks",
                                       "Prompt blocks the router expected the chosen worker "
                                       "to hold (compare the workers' prefix cache hits)",
                                       label, registry=r)
        self.workers = Gauge("baton:workers", "Workers known, by role and state", label
                             + ["role", "state"], registry=r)
        # Per request (the workers count the tokens they compute, as counters).
        self.prompt_tokens = Histogram("baton:request_prompt_tokens", "Prompt length",
                                       label, buckets=TOKEN_BUCKETS, registry=r)
        self.generation_tokens = Histogram("baton:request_generation_tokens",
                                           "Tokens streamed to the client", label,
                                           buckets=TOKEN_BUCKETS, registry=r)
        # SLOs (--slo-ttft-ms, --slo-itl-ms): finished requests judged, and those that
        # missed each (slo "ttft", "itl") or any.
        self.slo_ttft_s = self.slo_itl_s = 0.0
        self.slo_requests = Counter("baton:slo_requests", "Finished requests judged "
                                    "against the SLOs", label, registry=r)
        self.slo_misses = Counter("baton:slo_misses", "Finished requests past an SLO: "
                                  "TTFT, mean time per output token after the first "
                                  "(itl), or any", label + ["slo"], registry=r)
        # Requests in flight past their first token, and before it; tokens so far.
        self.running = self.waiting = self.prompt_total = self.generated_total = 0
        self.vllm = _VllmFigures(self) if vllm else None

    def set_slos(self, ttft_ms: float, itl_ms: float) -> None:
        self.slo_ttft_s, self.slo_itl_s = ttft_ms / 1000, itl_ms / 1000

    def watch_roles(self, registry) -> None:
        """Per role, at each scrape: the queue and the prompt tokens queued on its
        workers that are up, as last polled (what a planner or autoscaler reads)."""
        self.registry.register(_RoleFigures(self, registry))

    def labels(self, metric, **kw):
        return metric.labels(model_name=self.model, **kw)

    def request(self, t0: float) -> RequestSeen:
        """The figures of a request that arrived at `t0` (monotonic)."""
        return RequestSeen(self, t0)


class _VllmFigures(VllmRequestMetrics):
    """vLLM's names for the router's requests: histograms as they pass, gauges and token
    counters read at scrape time."""

    def __init__(self, m: RouterMetrics):
        self.m = m
        m.registry.register(self)
        super().__init__(m.registry)

    def collect(self):
        m, names = self.m, vllm_names
        yield names.family(GaugeMetricFamily, names.RUNNING, names.HELP[names.RUNNING],
                           m.model, m.running)
        yield names.family(GaugeMetricFamily, names.WAITING, names.HELP[names.WAITING],
                           m.model, m.waiting)
        yield names.family(CounterMetricFamily, names.PROMPT_TOKENS,
                           names.HELP[names.PROMPT_TOKENS], m.model, m.prompt_total)
        yield names.family(CounterMetricFamily, names.GENERATION_TOKENS,
                           names.HELP[names.GENERATION_TOKENS], m.model, m.generated_total)

    def describe(self):
        return []  # collected fresh at each scrape


class _RoleFigures:
    def __init__(self, m: RouterMetrics, registry):
        self.m, self.workers = m, registry

    def collect(self):
        label = ["model_name", "role"]
        queue = GaugeMetricFamily("baton:role_queue_depth", "Requests waiting on the "
                                  "workers of a role (their KV loading included)", labels=label)
        tokens = GaugeMetricFamily("baton:role_queued_prefill_tokens", "Prompt tokens the "
                                   "workers of a role have yet to compute", labels=label)
        for role, workers in (("prefill", self.workers.prefill),
                              ("decode", self.workers.decode)):
            up = [w for w in workers if w.state == "up" and w.stats is not None]
            queue.add_metric([self.m.model, role], sum(w.stats.num_waiting
                                                       + w.stats.num_loading for w in up))
            tokens.add_metric([self.m.model, role], sum(w.queued_prefill_tokens for w in up))
        yield queue
        yield tokens

    def describe(self):
        return []  # collected fresh at each scrape


class RequestSeen:
    """One request's figures, from its replies as they pass the router: Baton's names
    and vLLM's, timed from its arrival at the front door. `end` exactly once."""

    def __init__(self, m: RouterMetrics, t0: float):
        self.m, self.t0, self.last = m, t0, None  # last: when its latest token came
        self.first = 0.0  # when its first token came
        self.prompt_tokens = self.generated = 0
        self.outcome: FinishReason | None = None  # its finish reason, once streamed
        m.waiting += 1

    def prompt(self, n: int) -> None:
        self.prompt_tokens = n
        self.m.labels(self.m.prompt_tokens).observe(n)

    def reply(self, reply: gen.GenerateResponse) -> None:
        m, v = self.m, self.m.vllm
        now, n, t = time.monotonic(), len(reply.delta.token_ids), reply.timings
        if n and self.last is None:  # the first token
            self.first = now
            m.labels(m.ttft).observe(now - self.t0)
            m.labels(m.queue).observe(t.queue_s)
            m.labels(m.expected_cached).inc(t.expected_cached_blocks)
            m.waiting, m.running = m.waiting - 1, m.running + 1
            m.prompt_total += self.prompt_tokens
            if v is not None:
                v.first_token(m.model, now - self.t0, t.queue_s, t.prefill_s)
        elif n and self.last is not None:
            since = now - self.last
            itl, gap = m.labels(m.itl), since / n
            for _ in range(n):
                itl.observe(gap)
            if v is not None:
                v.tokens(m.model, n, since)
        if n:
            self.last = now
            self.generated += n
            m.generated_total += n
        if t.kv_transfer_s:
            m.labels(m.transfer).observe(t.kv_transfer_s)
        if reply.delta.finish_reason:
            self.outcome = finish_reason_of(reply.delta.finish_reason)

    def end(self, error: str | None) -> None:
        """The request is over: finished (its finish reason streamed), else failed with
        `error` (a gRPC status name; None: the caller left)."""
        m, v, e2e = self.m, self.m.vllm, time.monotonic() - self.t0
        if self.last is None:
            m.waiting -= 1
        else:
            m.running -= 1
        if error is None and self.outcome is not None:
            m.labels(m.success, finished_reason=self.outcome).inc()
            m.labels(m.e2e).observe(e2e)
            m.labels(m.generation_tokens).observe(self.generated)
            if v is not None:
                v.finished(m.model, self.outcome, e2e, self.prompt_tokens, self.generated)
            self._judge()
        else:  # an error, or the caller left (CANCELLED)
            m.labels(m.failure, code=error or "CANCELLED").inc()

    def _judge(self) -> None:
        """A finished request against the SLOs, where the router was given any."""
        m = self.m
        if not (m.slo_ttft_s or m.slo_itl_s) or self.last is None:
            return
        tpot = (self.last - self.first) / (self.generated - 1) if self.generated > 1 else 0.0
        missed = [slo for slo, took, limit in (("ttft", self.first - self.t0, m.slo_ttft_s),
                                               ("itl", tpot, m.slo_itl_s))
                  if limit and took > limit]
        m.labels(m.slo_requests).inc()
        for slo in missed + (["any"] if missed else []):
            m.labels(m.slo_misses, slo=slo).inc()
