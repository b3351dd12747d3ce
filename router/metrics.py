"""The router's Prometheus metrics. Names and meanings follow vLLM's (`vllm:` becomes
`baton:`), so dashboards and autoscalers written for vLLM carry over; what only a
disaggregated system has (retries, migrations, KV transfer) is added beside them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from baton.services.rpc.metrics import (
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    TRANSFER_BUCKETS,
    TTFT_BUCKETS,
)


class RouterMetrics:
    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None):
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
                                      "Prompts a decode worker computed itself "
                                      "(conditional disaggregation, or no prefill worker)",
                                      label, registry=r)
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

    def labels(self, metric, **kw):
        return metric.labels(model_name=self.model, **kw)
