"""A minimal OTLP/HTTP trace collector for tests: it listens on loopback, decodes each export (an
ExportTraceServiceRequest in protobuf, as OpenTelemetry's OTLP/HTTP exporter sends it) and keeps
the spans, so that a test can check the spans that real server processes exported."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

# What the servers' exporters need to reach this collector promptly (OpenTelemetry's own variables).
EXPORTER_ENV = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "200"}


@dataclass
class CollectedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a trace's root
    start_ns: int
    end_ns: int
    attributes: dict


class OtlpCollector:
    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                collector._add(ExportTraceServiceRequest.FromString(data))
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            service = attrs.get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    collected = CollectedSpan(
                        service,
                        span.name,
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                        {a.key: _value(a.value) for a in span.attributes},
                    )
                    with self._lock:
                        self.spans.append(collected)

    def wait_for_trace(self, request_id: str, count: int, timeout: float = 20.0) -> list[CollectedSpan]:
        """The spans of the trace whose root span has splitserve.request_id `request_id`, once it has
        `count` spans (fewer after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                roots = [
                    s
                    for s in self.spans
                    if s.attributes.get("splitserve.request_id") == request_id and not s.parent_span_id
                ]
                trace = [s for s in self.spans if roots and s.trace_id == roots[-1].trace_id]
            if len(trace) >= count or time.monotonic() > deadline:
                return trace
            time.sleep(0.1)

    def __enter__(self) -> OtlpCollector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(value):
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None
