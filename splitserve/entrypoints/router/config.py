"""What the router is started with: RouterConfig, checked when it is made, and the `splitserve router`
command-line flags that fill it: a PD pool (prefill and decode instances) or plain replicas (mixed
instances, each serving whole requests)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from splitserve.disagg.policies import POLICIES
from splitserve.tracing import check_endpoint

PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"
ROLES = (PREFILL, DECODE, MIXED)


@dataclass
class RouterConfig:
    """What `splitserve router` is started with. Instance URLs are the base URLs of OpenAI servers
    (http://host:port, without /v1)."""

    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    mixed_urls: list[str] = field(default_factory=list)  # plain replicas: each request runs whole on one
    policy: str = "round_robin"
    api_key: str | None = None  # what clients must send (Authorization: Bearer ...)
    instance_api_key: str | None = None  # what the router sends to the instances
    metrics_api_key: str | None = None  # what /metrics requires (serve --pd's --metrics-api-key); None: open
    max_retries: int = 2  # further instances tried after a failure, per role
    health_interval: float = 2.0  # seconds between health checks
    request_timeout: float = 3600.0  # seconds for a whole upstream request, stream included
    health_timeout: float = 10.0  # seconds for one /health (and one /metrics) check: busy CPUs answer late
    connect_timeout: float = 10.0  # seconds to open a connection, so a dead host fails fast
    openai_api: bool = True  # False (USE_OPENAI=0): only vLLM's native /generate, no /v1 routes
    otlp_traces_endpoint: str | None = None  # an OTLP collector: spans of each request (splitserve/tracing.py)
    tokenizer: str | None = None  # the model's tokenizer, for cache_aware: prompts tokenized here
    auto_roles: bool = False  # move instances between prefill and decode by their loads (router/roles.py)
    auto_roles_interval: float = 30.0  # seconds between two such moves at most
    disable_ui: bool = False  # no chat page at / nor dashboard at /dashboard (splitserve/entrypoints/ui)

    @property
    def serving_roles(self) -> tuple[str, ...]:
        """The roles that serve requests: both PD roles, or the mixed replicas."""
        return (MIXED,) if self.mixed_urls else (PREFILL, DECODE)

    def __post_init__(self) -> None:
        if self.mixed_urls and (self.prefill_urls or self.decode_urls):
            raise ValueError("--mixed replicas and a --prefill/--decode pool cannot be routed by one router.")
        if self.auto_roles and self.mixed_urls:
            raise ValueError("--auto-roles moves instances between prefill and decode: it needs --prefill/--decode.")
        if self.auto_roles_interval <= 0:
            raise ValueError(f"--auto-roles-interval must be > 0, got {self.auto_roles_interval}.")
        if self.mixed_urls:
            self.mixed_urls = _check_urls(self.mixed_urls, "--mixed")
        else:
            self.prefill_urls = _check_urls(self.prefill_urls, "--prefill (or --mixed replicas)")
            self.decode_urls = _check_urls(self.decode_urls, "--decode (or --mixed replicas)")
        if self.policy not in POLICIES:
            raise ValueError(f"Unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}.")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.max_retries}.")
        for name in ("health_interval", "request_timeout", "health_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}.")
        check_endpoint(self.otlp_traces_endpoint)


def _check_urls(urls: Sequence[str], flag: str) -> list[str]:
    """Base URLs without a trailing slash, so that `url + path` is always right; refused early when
    they could never work (no scheme, duplicates) rather than at the first request."""
    if not urls:
        raise ValueError(f"At least one {flag} instance URL is needed.")
    out: list[str] = []
    for url in urls:
        url = url.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{flag} {url!r} is not a base URL like http://host:port.")
        if url in out:
            raise ValueError(f"{flag} {url} is given twice.")
        out.append(url)
    return out


# --- command line ------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="base URL of a prefill instance, e.g. http://10.0.0.1:8000 (repeatable)",
    )
    parser.add_argument(
        "--decode", action="append", default=[], metavar="URL", help="base URL of a decode instance (repeatable)"
    )
    parser.add_argument(
        "--mixed",
        "--worker-urls",
        action="append",
        default=[],
        metavar="URL",
        help="base URL of a plain (mixed) replica, instead of a PD pool: each request runs whole on one, chosen "
        "by --policy (repeatable)",
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument(
        "--policy",
        "--routing-policy",
        choices=POLICIES,
        default="round_robin",
        help="how an instance is chosen within a role (default: round_robin; cache_aware: where the prompt's "
        "prefix is cached, from the instances' KV cache events)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the model's tokenizer (HF directory, hub id or .gguf file), for --policy cache_aware: the router "
        "tokenizes prompts and chats itself instead of calling an instance's /tokenize for each request",
    )
    parser.add_argument("--api-key", default=None, help="key clients must send as 'Authorization: Bearer KEY'")
    parser.add_argument("--instance-api-key", default=None, help="key sent to the instances (their --api-key)")
    parser.add_argument(
        "--max-retries", type=int, default=2, help="further instances tried after a failed one, per role (default: 2)"
    )
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    parser.add_argument(
        "--auto-roles",
        action="store_true",
        help="switch a prefill instance to decode, or back, when one role carries far more waiting and running "
        "requests per instance than the other (at most one switch per --auto-roles-interval; docs/pd.md)",
    )
    parser.add_argument(
        "--auto-roles-interval", type=float, default=30.0, help="seconds between --auto-roles checks (default: 30)"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=3600.0,
        help="seconds an upstream request (stream included) may take (default: 3600)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send OpenTelemetry spans of each request (the router's, and its calls to the instances, whose own "
        "spans join the same trace) to this OTLP collector; needs splitserve[otel]",
    )
    parser.add_argument(
        "--disable-ui", action="store_true", help="serve no chat page at / nor dashboard at /dashboard (docs/ui.md)"
    )


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        prefill_urls=ns.prefill,
        decode_urls=ns.decode,
        mixed_urls=ns.mixed,
        policy=ns.policy,
        api_key=ns.api_key,
        instance_api_key=ns.instance_api_key,
        max_retries=ns.max_retries,
        health_interval=ns.health_interval,
        request_timeout=ns.request_timeout,
        otlp_traces_endpoint=ns.otlp_traces_endpoint,
        tokenizer=ns.tokenizer,
        auto_roles=ns.auto_roles,
        auto_roles_interval=ns.auto_roles_interval,
        disable_ui=ns.disable_ui,
    )
