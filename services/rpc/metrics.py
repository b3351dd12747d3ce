"""What every service's Prometheus metrics share: vLLM's histogram buckets (seconds), so
the same dashboards read both, and the /metrics port."""

from prometheus_client import CollectorRegistry, start_http_server

from .config import ServiceConfig

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0)


class _Union:
    """Several registries read as one (a colocated process: the router's and its engine's
    metrics on one port)."""

    def __init__(self, registries):
        self.registries = registries

    def collect(self):
        for registry in self.registries:
            yield from registry.collect()

    def describe(self):
        return []


def union(registries) -> CollectorRegistry:
    merged = CollectorRegistry()
    merged.register(_Union(list(registries)))
    return merged


def serve_metrics(service: ServiceConfig, registries):
    """Prometheus /metrics on the service's --metrics-port (0: none), in a thread of
    prometheus_client's: on --metrics-host, else the service's own host; over TLS with
    the service's certificate when it has one (no client certificate asked). Returns
    the HTTP server (None without a port)."""
    if not service.metrics_port:
        return None
    server, _ = start_http_server(service.metrics_port, service.metrics_bind,
                                  registry=union(registries), certfile=service.tls_cert,
                                  keyfile=service.tls_key)
    return server
