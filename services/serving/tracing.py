"""Traces (OpenTelemetry), optional: with `--otlp-traces-endpoint` a service exports its
spans there (OTLP over gRPC); without it every call here costs next to nothing (the API's
no-op tracer). The W3C `traceparent` travels in gRPC metadata and HTTP headers, so one
request is one trace across the router, its prefill worker and its decode worker:

    router    generate ─┬─ prefill call ──> prefill worker: queue, prefill
                        └─ decode call  ──> decode worker:  kv pull, decode

Workers record their spans after the fact, from the engine's own timestamps.
"""

from __future__ import annotations

import time

from opentelemetry import propagate, trace
from opentelemetry.context import Context

_provider = None


def setup(service: str, endpoint: str | None) -> None:
    """Export this process's spans to `endpoint` (host:port of an OTLP gRPC collector)."""
    global _provider
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    _provider = TracerProvider(resource=Resource.create({"service.name": service}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint,
                                                                     insecure=True)))
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
