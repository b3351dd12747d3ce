"""Traces (OpenTelemetry), optional: with `--otlp-traces-endpoint` (or OTel's own
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT) a service exports its
spans there (OTLP over gRPC, over TLS unless `--otlp-insecure`, an http:// endpoint or
OTEL_EXPORTER_OTLP_[TRACES_]INSECURE=true says otherwise); without one every call here
costs next to nothing (the API's no-op tracer). What the flags do not say, OTel's
exporter reads from its OTEL_* variables (certificates, headers, timeout), and
OTEL_SERVICE_NAME names the service. The W3C `traceparent` travels in gRPC metadata
and HTTP headers, so one request is one trace across the router, its prefill worker and
its decode worker:

    router    generate ─┬─ prefill call ──> prefill worker: queue, prefill
                        └─ decode call  ──> decode worker:  kv pull, decode

Workers record their spans after the fact, from the engine's own timestamps.
"""

from __future__ import annotations

import os
import time

from opentelemetry import propagate, trace
from opentelemetry.context import Context

from .config import ServiceConfig

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_provider = None


def exporter_options(config: ServiceConfig, environ=os.environ) -> dict | None:
    """The OTLP exporter's arguments, or None: no traces. Only what the flags say goes
    in; OTel's exporter reads everything else from the environment itself."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint = config.otlp_traces_endpoint
    if not endpoint and not any(environ.get(v) for v in ENDPOINT_VARIABLES):
        return None
    options: dict = {"endpoint": endpoint} if endpoint else {}
    if config.otlp_insecure:
        options["insecure"] = True
    return options


def resource(service: str):
    """This process's OTel resource: OTEL_SERVICE_NAME (or service.name in
    OTEL_RESOURCE_ATTRIBUTES) when set, else `service` as its name."""
    from opentelemetry.sdk.resources import Resource

    detected = Resource.create()
    if str(detected.attributes.get("service.name", "")).startswith("unknown_service"):
        return detected.merge(Resource({"service.name": service}))
    return detected


def setup(service: str, config: ServiceConfig) -> None:
    """Export this process's spans as the service's config and OTEL_* variables say."""
    global _provider
    options = exporter_options(config)
    if options is None:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    _provider = TracerProvider(resource=resource(service))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(**options)))
    trace.set_tracer_provider(_provider)


def shutdown() -> None:
    """Send what is buffered (on stop)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer("baton")


def extract(metadata) -> Context:
    """The trace context a caller sent: gRPC metadata (pairs) or HTTP headers (a map)."""
    carrier = dict(metadata.items()) if hasattr(metadata, "items") else dict(metadata or ())
    return propagate.extract(carrier)


def inject(context: Context | None = None) -> tuple[tuple[str, str], ...]:
    """A trace context (default: the current one) as gRPC metadata, for a call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return tuple(carrier.items())


def child(name: str, parent: Context | None, kind=trace.SpanKind.INTERNAL, **attributes
          ) -> tuple[trace.Span, Context]:
    """A span under `parent`, and the context that makes it the parent of others. Not
    made current: it may live across the yields of a stream. End it yourself."""
    span = tracer().start_span(name, context=parent, kind=kind, attributes=attributes)
    return span, trace.set_span_in_context(span, parent)


def record(name: str, parent: Context, start_s: float, end_s: float, **attributes) -> None:
    """A span that already happened, from monotonic times (the engine's clock)."""
    offset = time.time_ns() - time.monotonic_ns()
    span = tracer().start_span(name, context=parent, attributes=attributes,
                               start_time=int(start_s * 1e9) + offset)
    span.end(end_time=int(end_s * 1e9) + offset)
