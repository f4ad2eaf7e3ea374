"""The PD router's own Prometheus metrics (requests, retries, failures, fallbacks, instance health, latency)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.entrypoints.router.config import ROLES

_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)


class RouterMetrics:
    """The router's own Prometheus metrics, in a private registry so that several routers (tests)
    can live in one process and an instance's metrics are never mixed in."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "splitserve_router:requests",
            "Requests sent to an instance (each attempt).",
            ["instance", "role"],
            registry=r,
        )
        self.retries = Counter(
            "splitserve_router:retries", "Attempts on a further instance after a failure.", ["role"], registry=r
        )
        self.failures = Counter(
            "splitserve_router:failures",
            "Failed attempts: connection error, timeout, 5xx, "
            "a prefill answer without kv_transfer_params, a stream that broke off.",
            ["role"],
            registry=r,
        )
        self.fallbacks = Counter("splitserve_router:fallbacks", "Requests decoded without remote prefill.", registry=r)
        self.instance_healthy = Gauge(
            "splitserve_router:instance_healthy", "1 if the instance is up, else 0.", ["instance", "role"], registry=r
        )
        self.latency = Histogram(
            "splitserve_router:request_latency_seconds",
            "Completion requests, arrival to the last byte.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        for role in ROLES:
            self.retries.labels(role=role)
            self.failures.labels(role=role)

    def render(self) -> bytes:
        return generate_latest(self.registry)
