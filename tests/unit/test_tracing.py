"""OpenTelemetry tracing (splitserve/tracing.py): an API server's span of one engine request and its
phases, the router's spans with the trace context it hands to the instances (against the fake
instances of test_router.py), all read back from OpenTelemetry's in-memory exporter. The whole PD
path, exported over OTLP from real processes, is tested in tests/e2e/test_pd.py."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from splitserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from splitserve.tracing import RequestTrace, Tracing, check_endpoint, epoch_ns, request_phases, tracing_for
from tests.unit.test_router import COMPLETION, cluster, fake_loop  # noqa: F401 (fixtures)


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    return Tracing("test", exporter=exporter), exporter


def _output(metrics: RequestMetrics, tokens: int = 3) -> RequestOutput:
    completion = CompletionOutput(0, "abc", list(range(tokens)), None, None, "length")
    return RequestOutput("cmpl-1-0", "hi", [1, 2, 3, 4], None, [completion], True, 2, metrics)


def test_off_without_an_endpoint():
    assert tracing_for(None, "splitserve") is None
    assert tracing_for("", "splitserve") is None


def test_bad_endpoint_refused_at_start():
    with pytest.raises(ValueError, match="collector"):
        check_endpoint("http://")


def test_epoch_ns_maps_the_monotonic_clock():
    assert epoch_ns(10.0, now_monotonic=12.5, now_ns=100_000_000_000) == 97_500_000_000


def test_phases_of_a_request():
    m = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0, finished_time=3.0)
    assert request_phases(m, False) == [("queue", 1.0, 1.5), ("prefill", 1.5, 2.0), ("decode", 2.0, 3.0)]
    assert request_phases(m, True)[1] == ("kv_transfer", 1.5, 2.0)
    one_token = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.2, first_token_time=2.0, finished_time=2.0)
    assert [p[0] for p in request_phases(one_token, False)] == ["queue", "prefill"]  # a prefill instance's
    refused = RequestMetrics(arrival_time=1.0, finished_time=1.1)  # aborted before it ran
    assert request_phases(refused, False) == [("queue", 1.0, 1.1)]


def test_request_span_under_the_callers_context(exported):
    tracing, exporter = exported
    parent = tracing.start_span("router", kind="client")
    context = tracing.extract(tracing.headers_for(parent))
    m = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.1, first_token_time=100.4, finished_time=101.0)
    tracing.record_request(_output(m), RequestTrace(context, remote_prefill=True), "decode")
    tracing.end_span(parent)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"router", "llm_request", "queue", "kv_transfer", "decode"}
    request = spans["llm_request"]
    assert request.parent.span_id == parent.get_span_context().span_id
    assert request.context.trace_id == parent.get_span_context().trace_id
    assert request.kind == SpanKind.SERVER
    for name in ("queue", "kv_transfer", "decode"):
        assert spans[name].parent.span_id == request.context.span_id
    assert request.attributes["gen_ai.usage.prompt_tokens"] == 4
    assert request.attributes["gen_ai.usage.completion_tokens"] == 3
    assert request.attributes["splitserve.pd_role"] == "decode"
    assert request.attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(0.4)
    assert (request.end_time - request.start_time) / 1e9 == pytest.approx(1.0, abs=1e-3)
    assert spans["queue"].end_time == spans["kv_transfer"].start_time
    assert spans["decode"].end_time == request.end_time


def test_a_request_without_trace_context_starts_a_trace(exported):
    tracing, exporter = exported
    m = RequestMetrics(arrival_time=5.0, first_scheduled_time=5.0, first_token_time=5.2, finished_time=5.2)
    tracing.record_request(_output(m, 1), None)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["llm_request"].parent is None
    assert set(spans) == {"llm_request", "queue", "prefill"}


def test_router_spans_and_the_context_it_sends(cluster, exported):  # noqa: F811
    tracing, exporter = exported
    server, [p], [d], _ = cluster(1, 1)
    server.router.tracing = tracing
    client_parent = tracing.start_span("client", kind="client")
    r = server.client.post("/v1/completions", json=COMPLETION, headers=tracing.headers_for(client_parent))
    assert r.status_code == 200
    tracing.end_span(client_parent)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["POST /v1/completions"]
    assert root.parent.span_id == client_parent.get_span_context().span_id
    assert root.attributes["http.response.status_code"] == 200
    for role, instance in (("prefill", p), ("decode", d)):
        call = spans[role]
        assert call.kind == SpanKind.CLIENT and call.parent.span_id == root.context.span_id
        assert call.attributes["splitserve.instance"] == instance.url
        # The instance got the call's own context: its spans will be the call's children.
        assert instance.traceparents[-1].startswith(f"00-{call.context.trace_id:032x}-{call.context.span_id:016x}-")


def test_router_marks_a_failed_call(cluster, exported):  # noqa: F811
    tracing, exporter = exported
    server, [p1, p2], [d], _ = cluster(2, 1, policy="round_robin")
    server.router.tracing = tracing
    p1.mode = "500"
    for _ in range(2):  # whichever prefill instance round robin picks first, one call fails
        exporter.clear()
        assert server.client.post("/v1/completions", json=COMPLETION).status_code == 200
        prefills = [s for s in exporter.get_finished_spans() if s.name == "prefill"]
        if len(prefills) == 2:
            break
    assert [s.status.status_code for s in prefills] == [StatusCode.ERROR, StatusCode.UNSET]
    assert all(s.parent is not None for s in prefills)
