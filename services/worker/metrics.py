"""A worker's Prometheus metrics, vLLM's names with Baton's prefix (`vllm:` becomes
`baton:`), and vLLM's own names beside them (vllm_metrics.py). The gauges and counters
are read at scrape time from the engine thread's stats snapshot (never from the live
engine); the histograms are observed as requests end."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..common.kv_events import TIERS
from ..engine.kv_offload.store import REJECTED
from ..rpc.config import ServiceConfig
from ..rpc.metrics import LATENCY_BUCKETS, TRANSFER_BUCKETS, serve_metrics
from .vllm_metrics import VllmMetrics

GAUGES = {  # name: (help, from the stats snapshot)
    "baton:num_requests_running": ("Requests in the running batch",
                                   lambda s, _: s.num_running),
    "baton:num_requests_waiting": ("Requests waiting to be scheduled",
                                   lambda s, _: s.num_waiting),
    "baton:num_requests_loading": ("Decode: requests whose KV is being pulled",
                                   lambda s, _: s.num_loading),
    "baton:num_queued_prefill_tokens": (
        "Prompt tokens of waiting and running requests not computed yet",
        lambda s, _: s.num_queued_prefill_tokens),
    "baton:kv_cache_usage_perc": ("KV cache usage (1 = full)",
                                  lambda s, _: 1 - s.num_free_blocks / max(1, s.num_blocks)),
    "baton:kv_leases": ("Prefill: requests whose KV is held for a decode worker",
                        lambda s, _: s.num_leases),
}
COUNTERS = {
    "baton:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                   lambda s, _: s.prefix_cache_queries),
    "baton:prefix_cache_hits": ("Prompt tokens found in the prefix cache",
                                lambda s, _: s.prefix_cache_hits),
    "baton:num_preemptions": ("Requests preempted (recomputed later)",
                              lambda s, _: s.num_preemptions),
    "baton:prompt_tokens": ("Prompt tokens computed", lambda s, _: s.num_prompt_tokens),
    "baton:generation_tokens": ("Tokens sampled", lambda s, _: s.num_generation_tokens),
    "baton:kv_leases_expired": ("Prefill: leases freed because nobody pulled them",
                                lambda s, _: s.num_leases_expired),
    "baton:kv_pulled_bytes": ("Decode: KV bytes pulled from prefill workers",
                              lambda s, block_bytes: s.num_blocks_pulled * block_bytes),
    "baton:kv_load_failures": ("Decode: pulls that failed (then recomputed or failed)",
                               lambda s, _: s.num_load_failures),
    "baton:spec_decode_num_drafts": ("Speculative decoding: request-steps with drafts",
                                     lambda s, _: s.num_spec_drafts),
    "baton:spec_decode_num_draft_tokens": ("Speculative decoding: draft tokens proposed",
                                           lambda s, _: s.num_spec_draft_tokens),
    "baton:spec_decode_num_accepted_tokens": ("Speculative decoding: draft tokens accepted",
                                              lambda s, _: s.num_spec_accepted_tokens),
}

TIER_COUNTERS = {  # baton:kv_offload_<what>{medium}: the offload tiers' counters
    "hits": "Blocks loaded from an offload tier instead of recomputed",
    "load_bytes": "Bytes loaded from an offload tier",
    "saves": "Blocks written to an offload tier",
    "save_bytes": "Bytes written to an offload tier",
    "evictions": "Blocks this worker evicted from an offload tier",
}


def tier_families(model: str, counts: dict[str, int]):
    """The tiers' counters, labelled by medium (host, disk); none without tiers."""
    media = sorted({k.split("_", 1)[0] for k in counts} & set(TIERS))
    if not media:
        return
    for what, help_text in TIER_COUNTERS.items():
        family = CounterMetricFamily(f"baton:kv_offload_{what}", help_text,
                                     labels=["model_name", "medium"])
        for medium in media:
            family.add_metric([model, medium], counts.get(f"{medium}_{what}", 0))
        yield family
    family = CounterMetricFamily(
        "baton:kv_offload_rejected", "Block files of an offload tier that were a miss for "
        "what they held: corrupt, forged (MAC), foreign (not this user's regular file)",
        labels=["model_name", "medium", "reason"])
    for medium in media:
        for why in REJECTED:
            family.add_metric([model, medium, why], counts.get(f"{medium}_{why}", 0))
    yield family


class WorkerMetrics:
    def __init__(self, stats, model_name: str, block_bytes: int,
                 served_model_name: str | None = None):
        """`stats()` returns the latest EngineStats snapshot. The `vllm:` families beside
        these are labelled with `served_model_name` (default: `model_name`), as vLLM's."""
        self.registry = CollectorRegistry()
        self._stats, self.model, self.block_bytes = stats, model_name, block_bytes
        self.registry.register(self)
        self.vllm = VllmMetrics(self.registry, stats, served_model_name or model_name)
        label = ["model_name"]
        self.pull = Histogram("baton:kv_pull_seconds", "Decode: one pull of a prompt's KV",
                              label, buckets=TRANSFER_BUCKETS, registry=self.registry)
        self.queue = Histogram("baton:engine_queue_time_seconds",
                               "Arrival to first scheduled, on this engine", label,
                               buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prefill = Histogram("baton:request_prefill_time_seconds",
                                 "First scheduled to first token", label,
                                 buckets=LATENCY_BUCKETS, registry=self.registry)

    def collect(self):
        s = self._stats()
        for families, cls in ((GAUGES, GaugeMetricFamily), (COUNTERS, CounterMetricFamily)):
            for name, (help_text, read) in families.items():
                family = cls(name, help_text, labels=["model_name"])
                family.add_metric([self.model], read(s, self.block_bytes))
                yield family
        yield from tier_families(self.model, dict(s.kv_offload))

    def describe(self):
        return []  # collected fresh at each scrape

    def observe(self, out) -> None:
        """One request's times, from its first output on this worker."""
        if out.transfer_time:
            self.pull.labels(self.model).observe(out.transfer_time)
        if out.queue_time is not None and out.prefill_time is not None:
            self.queue.labels(self.model).observe(out.queue_time)
            self.prefill.labels(self.model).observe(out.prefill_time)

    def watch(self, aengine) -> None:
        """Every request `aengine` runs goes through the `vllm:` request metrics."""
        aengine.observer = self.vllm.request

    def serve(self, service: ServiceConfig) -> None:
        serve_metrics(service, [self.registry])
