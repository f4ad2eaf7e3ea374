"""ORCA load reports in a response header, as vLLM sends them: a request that carries
`endpoint-load-metrics-format: text` (or `json`) gets an `endpoint-load-metrics` header with the
instance's load when its answer starts, for gateways that balance on it (Envoy's ORCA support, the
Gateway API Inference Extension):

    endpoint-load-metrics: TEXT named_metrics.num_requests_waiting=3.0, named_metrics.kv_cache_usage_perc=0.4
    endpoint-load-metrics: JSON {"named_metrics": {"num_requests_waiting": 3.0, "kv_cache_usage_perc": 0.4}}

The names, the value formatting (Python floats), the ", " separator and the order (vLLM's Prometheus
registry order: the waiting gauge is registered before the KV-cache one) are vLLM's
(vllm/entrypoints/serve/utils/orca_metrics.py). An unknown format gets no header, as in vLLM. The
values are what the server already holds (the engine's last stats), so asking costs no scrape.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

ORCA_FORMAT_HEADER = "endpoint-load-metrics-format"
ORCA_HEADER = "endpoint-load-metrics"
_FORMAT_KEY = ORCA_FORMAT_HEADER.encode()
_HEADER_KEY = ORCA_HEADER.encode()

NamedMetrics = list[tuple[str, float]]


def named_load_metrics(num_requests_waiting: float, kv_cache_usage_perc: float) -> NamedMetrics:
    """vLLM's two named metrics (its Prometheus gauges vllm:num_requests_waiting and
    vllm:kv_cache_usage_perc, 0 to 1), as floats, in vLLM's order."""
    return [("num_requests_waiting", float(num_requests_waiting)), ("kv_cache_usage_perc", float(kv_cache_usage_perc))]


def orca_header_value(metrics_format: str, named_metrics: NamedMetrics) -> str | None:
    """The `endpoint-load-metrics` value for a requested format (`text` or `json`, any case); None
    for any other format."""
    kind = metrics_format.strip().lower()
    if kind == "text":
        return "TEXT " + ", ".join(f"named_metrics.{name}={value}" for name, value in named_metrics)
    if kind == "json":
        return "JSON " + json.dumps({"named_metrics": dict(named_metrics)})
    return None


class OrcaLoadMiddleware:
    """Adds the `endpoint-load-metrics` header to the answers of `paths` whose request asks for it
    (streamed answers too: the load when the stream starts). `load()` gives the named metrics.
    Pure ASGI: a request that does not ask costs one look through its headers."""

    def __init__(self, app, load: Callable[[], NamedMetrics], paths: Sequence[str]):
        self.app = app
        self.load = load
        self.paths = frozenset(paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        metrics_format = next((v for k, v in scope.get("headers") or () if k == _FORMAT_KEY), None)
        if metrics_format is None:
            return await self.app(scope, receive, send)

        async def send_with_load(message) -> None:
            if message["type"] == "http.response.start":
                value = orca_header_value(metrics_format.decode("latin-1"), self.load())
                if value is not None:
                    message["headers"] = [*message.get("headers", []), (_HEADER_KEY, value.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_load)
