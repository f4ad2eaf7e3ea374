"""OpenTelemetry tracing (`--otlp-traces-endpoint`, vLLM's flag): spans for each request, in one
trace across the PD router, the prefill instance and the decode instance.

- The router opens a server span per completion/chat/generate request and a client span per call to
  an instance ("prefill", "decode"), and sends the call's W3C trace context (the `traceparent` and
  `tracestate` headers) to the instance.
- Every API server records one "llm_request" span per engine request, a child of the caller's trace
  context when the request carried one, with its phases as child spans from the engine's own times:
  "queue" (arrival to first scheduled), then "prefill" (to the first token), or "kv_transfer" on a
  decode instance that pulls the prompt's KV from a prefill instance, then "decode" (to the last token).

Off by default and free when off: OpenTelemetry is not imported, no middleware is installed, and
the hooks test one attribute against None. When on, spans go out in batches from a background
thread (OpenTelemetry's BatchSpanProcessor; its OTEL_BSP_* variables apply) over OTLP/gRPC (the
default, as vLLM) or OTLP/HTTP, as OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says (`grpc` or `http/protobuf`).
OpenTelemetry is an optional dependency: `pip install 'splitserve[otel]'`.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger("splitserve.tracing")

TRACE_HEADERS = ("traceparent", "tracestate")  # the W3C trace context a caller passes on
_INSTALL_HINT = "pip install 'splitserve[otel]' (opentelemetry-sdk and opentelemetry-exporter-otlp)"


@dataclass
class RequestTrace:
    """What an API server knows of the trace of the HTTP request it is handling: the caller's trace
    context (None when it sent none: the request's span is then a trace's root), and whether the
    request's prompt KV comes from a prefill instance (its first phase is then a transfer)."""

    context: Any = None
    remote_prefill: bool = False
    attributes: dict[str, Any] = field(default_factory=dict)


# Set by TraceContextMiddleware for the request being handled; None when tracing is off.
REQUEST_TRACE: ContextVar[RequestTrace | None] = ContextVar("request_trace", default=None)


def epoch_ns(monotonic_time: float, now_monotonic: float | None = None, now_ns: int | None = None) -> int:
    """A time.monotonic() reading (the engine's clock; one clock for every process of a host) as
    nanoseconds since the epoch, as spans need them."""
    now_monotonic = time.monotonic() if now_monotonic is None else now_monotonic
    now_ns = time.time_ns() if now_ns is None else now_ns
    return now_ns - int((now_monotonic - monotonic_time) * 1e9)


class Tracing:
    """One process's tracer: its spans, exported to `endpoint` (or to `exporter`, for tests)."""

    def __init__(self, service_name: str, endpoint: str | None = None, exporter=None):
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise RuntimeError(f"--otlp-traces-endpoint needs OpenTelemetry ({exc}): {_INSTALL_HINT}.") from None
        service_name = os.environ.get("OTEL_SERVICE_NAME") or service_name
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is None:
            self.provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(endpoint)))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("splitserve")
        self.propagator = TraceContextTextMapPropagator()
        logger.info("Tracing on: %s spans go to %s", service_name, endpoint or type(exporter).__name__)

    # --- trace context ------------------------------------------------------------------------
    def extract(self, headers: Mapping[str, str]):
        """The trace context of an incoming request's headers (an empty context when it has none)."""
        return self.propagator.extract(carrier={k: v for k, v in headers.items() if k.lower() in TRACE_HEADERS})

    def headers_for(self, span) -> dict[str, str]:
        """The headers that make a downstream request's spans children of `span`."""
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=set_span_in_context(span))
        return carrier

    # --- spans --------------------------------------------------------------------------------
    def start_span(self, name: str, parent=None, kind: str = "internal", start_ns: int | None = None, **attributes):
        """A span under `parent` (a span, a context from extract(), or None for a new trace)."""
        from opentelemetry.trace import Span, SpanKind, set_span_in_context

        context = set_span_in_context(parent) if isinstance(parent, Span) else parent
        return self.tracer.start_span(
            name,
            context=context,
            kind=getattr(SpanKind, kind.upper()),
            attributes={k: v for k, v in attributes.items() if v is not None},
            start_time=start_ns,
        )

    @staticmethod
    def end_span(span, error: str | None = None, end_ns: int | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    def record_request(self, output, trace: RequestTrace | None, pd_role: str | None = None) -> None:
        """An API server's span of one finished engine request (a RequestOutput with its metrics),
        with its phases as children, under the caller's trace context."""
        m = output.metrics
        if m is None or m.finished_time is None:
            return
        now, now_ns = time.monotonic(), time.time_ns()

        def ns(t: float) -> int:
            return epoch_ns(t, now, now_ns)

        trace = trace or RequestTrace()
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        attributes = {
            "gen_ai.request.id": output.request_id,
            "gen_ai.usage.prompt_tokens": len(output.prompt_token_ids),
            "gen_ai.usage.completion_tokens": completion_tokens,
            "gen_ai.response.finish_reasons": [c.finish_reason for c in output.outputs if c.finish_reason],
            "gen_ai.latency.e2e": m.finished_time - m.arrival_time,
            "splitserve.num_cached_tokens": output.num_cached_tokens,
            "splitserve.pd_role": pd_role,
            **trace.attributes,
        }
        if m.first_token_time is not None:
            attributes["gen_ai.latency.time_to_first_token"] = m.first_token_time - m.arrival_time
        if m.first_scheduled_time is not None:
            attributes["gen_ai.latency.time_in_queue"] = max(m.first_scheduled_time - m.arrival_time, 0.0)
        root = self.start_span("llm_request", trace.context, "server", ns(m.arrival_time), **attributes)
        for name, start, end in request_phases(m, trace.remote_prefill):
            self.end_span(self.start_span(name, root, start_ns=ns(start)), end_ns=ns(end))
        self.end_span(root, end_ns=ns(m.finished_time))

    def flush(self, timeout_s: float = 5.0) -> None:
        """Send the spans still queued (a server that stops calls this; the tracer stays usable)."""
        self.provider.force_flush(int(timeout_s * 1000))


def request_phases(m, remote_prefill: bool) -> list[tuple[str, float, float]]:
    """(name, start, end) of a finished request's phases, from its RequestMetrics: queue, then
    prefill (kv_transfer when the prompt's KV came from a prefill instance), then decode; a phase
    the request never reached is left out."""
    phases = []
    scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else m.finished_time
    scheduled = min(max(scheduled, m.arrival_time), m.finished_time)
    phases.append(("queue", m.arrival_time, scheduled))
    first_token = m.first_token_time
    if first_token is not None:
        phases.append(("kv_transfer" if remote_prefill else "prefill", scheduled, max(first_token, scheduled)))
        if m.finished_time > first_token:
            phases.append(("decode", first_token, m.finished_time))
    return phases


def _otlp_exporter(endpoint: str | None):
    if not endpoint:
        raise ValueError("Tracing needs an endpoint (--otlp-traces-endpoint).")
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        if urlsplit(endpoint).path in ("", "/"):  # a collector's base address: its traces path
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf, got {protocol!r}.")


@functools.cache
def tracing_for(endpoint: str | None, service_name: str) -> Tracing | None:
    """This process's Tracing for `endpoint` (one per process, however many handlers ask); None when
    tracing is off (no endpoint)."""
    if not endpoint:
        return None
    return Tracing(service_name, endpoint)


def check_endpoint(endpoint: str | None) -> None:
    """Refuse a tracing flag that cannot work, at start-up rather than at the first request."""
    if not endpoint:
        return
    try:
        import opentelemetry.exporter.otlp  # noqa: F401
        import opentelemetry.sdk  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry ({exc}): {_INSTALL_HINT}.") from None
    parts = urlsplit(endpoint if "://" in endpoint else f"grpc://{endpoint}")
    if not parts.hostname:
        raise ValueError(f"--otlp-traces-endpoint must be a collector's address (http://host:4317), got {endpoint!r}.")


class TraceContextMiddleware:
    """Keeps each HTTP request's trace context in REQUEST_TRACE while it is handled (pure ASGI, as
    the other middlewares). Installed only when tracing is on."""

    def __init__(self, app, tracing: Tracing):
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or []}
        token = REQUEST_TRACE.set(RequestTrace(self.tracing.extract(headers)))
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_TRACE.reset(token)
