"""The prefill/decode (PD) disaggregation router: one OpenAI-compatible HTTP front for a pool of
prefill instances and a pool of decode instances (ordinary splitserve OpenAI servers started with a
PD role).

A completion or chat request goes through two instances:

1. a prefill instance gets the request with `max_tokens: 1`, `stream: false` and
   `kv_transfer_params: {"do_remote_decode": true}`; it computes the prompt's KV, keeps it under a
   lease, and answers a normal completion JSON plus a top-level `kv_transfer_params` (where the KV
   waits; opaque to the router);
2. a decode instance gets the client's original body plus those `kv_transfer_params` and
   `do_remote_prefill: true`; it pulls the KV and generates. Its answer (JSON or SSE stream) goes
   back to the client byte for byte.

Failures: a prefill instance that cannot be reached, times out, answers 5xx, or forgets the
`kv_transfer_params` is marked down and the next one is tried (--max-retries); when none succeeds
the request is decoded without remote prefill (a "fallback": the decode instance computes the
prompt itself, slower but correct). A 4xx from prefill means the request is invalid: it is returned
as is. A decode failure before the first byte reached the client is retried on another decode
instance; after that, the stream ends with an error event and `[DONE]`. A client that goes away
closes the upstream connection at once, so that the instance aborts the request and frees its KV.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve import __version__
from splitserve.entrypoints.http import (ApiKeyMiddleware, error_response, install_error_handlers, read_body,
                                                read_json_body)
from splitserve.entrypoints.http import error_body

logger = logging.getLogger("splitserve.router")

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
POLICIES = ("round_robin", "least_load", "prefix_aware")
PREFIX_CHARS = 512  # how much of the prompt prefix_aware hashes
_DISCONNECT_POLL_S = 0.5
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
_LOAD_METRICS = {"splitserve:num_requests_running": "running", "splitserve:num_requests_waiting": "waiting",
                 "splitserve:kv_cache_usage_perc": "kv"}
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                    160.0, 640.0, 2560.0)
_DONE_EVENT = b"data: [DONE]\n\n"


# --- configuration -----------------------------------------------------------------------------
@dataclass
class RouterConfig:
    """What `splitserve router` is started with. Instance URLs are the base URLs of OpenAI servers
    (http://host:port, without /v1)."""

    prefill_urls: list[str]
    decode_urls: list[str]
    policy: str = "round_robin"
    api_key: str | None = None            # what clients must send (Authorization: Bearer ...)
    instance_api_key: str | None = None   # what the router sends to the instances
    max_retries: int = 2                  # further instances tried after a failure, per role
    health_interval: float = 2.0          # seconds between health checks
    request_timeout: float = 3600.0       # seconds for a whole upstream request, stream included
    health_timeout: float = 10.0          # seconds for one /health (and one /metrics) check: busy CPUs answer late
    connect_timeout: float = 10.0         # seconds to open a connection, so a dead host fails fast

    def __post_init__(self) -> None:
        self.prefill_urls = _check_urls(self.prefill_urls, "--prefill")
        self.decode_urls = _check_urls(self.decode_urls, "--decode")
        if self.policy not in POLICIES:
            raise ValueError(f"Unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}.")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.max_retries}.")
        for name in ("health_interval", "request_timeout", "health_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}.")


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


# --- instances and their load ------------------------------------------------------------------
@dataclass(frozen=True)
class InstanceLoad:
    """What an instance reported in its /metrics at the last health check."""

    num_requests: float       # running + waiting
    kv_cache_usage: float     # 0..1

    @property
    def key(self) -> tuple[float, float]:
        return self.num_requests, self.kv_cache_usage


@dataclass(eq=False)
class Instance:
    """One prefill or decode server, as the router sees it."""

    url: str
    role: str
    healthy: bool = True
    down_reason: str | None = None
    in_flight: int = 0                   # requests this router has open on it right now
    load: InstanceLoad | None = None     # its own report, when its /metrics could be read


def parse_instance_load(text: str) -> InstanceLoad | None:
    """The load of an instance from its Prometheus text (summed over label sets, e.g. several served
    models); None when it does not export the request gauges, so that least_load does not mistake
    "unknown" for "idle"."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = _LOAD_METRICS.get(sample.name)
                if key is not None:
                    sums[key] = sums.get(key, 0.0) + sample.value
    except ValueError:
        return None
    if "running" not in sums and "waiting" not in sums:
        return None
    return InstanceLoad(sums.get("running", 0.0) + sums.get("waiting", 0.0), sums.get("kv", 0.0))


# --- routing policies --------------------------------------------------------------------------
class Policy(ABC):
    """Chooses one instance among the healthy ones of a role (never given an empty list)."""

    name = ""

    @abstractmethod
    def choose(self, instances: Sequence[Instance], request_body: dict) -> Instance:
        ...


class RoundRobinPolicy(Policy):
    """Each instance in turn: even spread when requests are alike, with no state to go stale."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, instances: Sequence[Instance], request_body: dict) -> Instance:
        return instances[next(self._counter) % len(instances)]


class LeastLoadPolicy(Policy):
    """The instance with the fewest requests in flight from this router (exact and current); ties go
    to the one reporting the least work of its own (running + waiting, then KV-cache use; it also
    sees other routers' and direct clients' requests, but only as of the last health check), then
    round robin, so that an idle pool is still spread evenly."""

    name = "least_load"

    def __init__(self) -> None:
        self._rr = RoundRobinPolicy()

    def choose(self, instances: Sequence[Instance], request_body: dict) -> Instance:
        fewest = min(i.in_flight for i in instances)
        ties = [i for i in instances if i.in_flight == fewest]
        if len(ties) > 1 and all(i.load is not None for i in ties):
            best = min(i.load.key for i in ties)
            ties = [i for i in ties if i.load.key == best]
        return ties[0] if len(ties) == 1 else self._rr.choose(ties, request_body)


def prompt_prefix(request_body: dict) -> str:
    """The first PREFIX_CHARS characters of the prompt (text, or JSON of token ids) or of the JSON
    of the chat messages: requests that share it most likely share prefix-cache blocks."""
    if "prompt" in request_body:
        prompt = request_body["prompt"]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))
    elif "messages" in request_body:
        text = json.dumps(request_body["messages"], separators=(",", ":"))
    else:
        text = ""
    return text[:PREFIX_CHARS]


def _rendezvous_weight(url: str, key: str) -> int:
    """A stable (process-independent, unlike hash()) pseudo-random weight of an (instance, prefix)."""
    digest = hashlib.blake2b(f"{url}\n{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PrefixAwarePolicy(Policy):
    """Rendezvous (highest-random-weight) hashing of the prompt prefix: the same prefix always lands
    on the same instance, where its KV blocks are likely cached, and an instance that goes away only
    moves its own share. When the chosen one has more than `skew_factor` times the in-flight
    requests of the least loaded one (counting at least 1 there, so that one open request on an
    idle pool is no skew), the least loaded one takes the request: a hot prefix must not pile up."""

    name = "prefix_aware"

    def __init__(self, skew_factor: float = 2.0) -> None:
        self.skew_factor = skew_factor
        self._least = LeastLoadPolicy()

    def choose(self, instances: Sequence[Instance], request_body: dict) -> Instance:
        key = prompt_prefix(request_body)
        chosen = max(instances, key=lambda i: (_rendezvous_weight(i.url, key), i.url))
        fewest = min(i.in_flight for i in instances)
        if chosen.in_flight > self.skew_factor * max(fewest, 1):
            return self._least.choose(instances, request_body)
        return chosen


_POLICY_CLASSES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobinPolicy, LeastLoadPolicy, PrefixAwarePolicy)}


def make_policy(name: str) -> Policy:
    return _POLICY_CLASSES[name]()


# --- request bodies ----------------------------------------------------------------------------
def prefill_request_body(body: dict) -> dict:
    """The prefill instance's copy: one token, no streaming, and the ask to keep the KV for a remote
    decode. min_tokens goes (also as metadata.min_tokens), and so does max_completion_tokens, since
    both would contradict max_tokens=1 and turn a good request into a 400."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "max_completion_tokens")}
    metadata = out.get("metadata")
    if isinstance(metadata, dict) and "min_tokens" in metadata:
        out["metadata"] = {k: v for k, v in metadata.items() if k != "min_tokens"}
    out["max_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_request_body(body: dict, prefill_kv: dict) -> dict:
    """The client's body plus where the prefill instance keeps the KV."""
    return {**body, "kv_transfer_params": {**prefill_kv, "do_remote_prefill": True}}


def fallback_request_body(body: dict) -> dict:
    """The client's body without any kv_transfer_params: the decode instance computes the prompt."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


# --- errors and small helpers ------------------------------------------------------------------
class ClientGone(Exception):
    """The client closed its connection while the router waited on an instance."""


def sse_error_event(message: str) -> bytes:
    body = error_body(message, "service_unavailable", None, 503)
    return f"data: {json.dumps(body)}\n\n".encode()


def describe_error(exc: BaseException, timeout: float | None = None) -> str:
    """An upstream failure in words an operator understands."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's timeouts derive from it
        return f"no answer within {timeout:g} s" if timeout else "timed out"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "it closed the connection"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the connection closed before the answer was complete"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _status_reason(status: int, data: bytes) -> str:
    """'answered HTTP 500 (the instance's own message)'."""
    try:
        message = json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = data[:200].decode("utf-8", "replace").strip()
    return f"answered HTTP {status}" + (f" ({message})" if message else "")


def _is_batch(body: dict) -> bool:
    """A completion request holding several prompts (a list of texts or of token-id lists)."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


def _kv_params(data: bytes) -> dict | None:
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    kv = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return kv if isinstance(kv, dict) else None


async def until_disconnected(request: Request, awaitable: Awaitable):
    """Await `awaitable` while checking every half second whether the client went away (as
    serving.py's _collect does); if it did, cancel the wait (closing the upstream request) and raise
    ClientGone. Without this, a non-streamed request whose client gave up would keep an instance
    busy, and its KV blocks taken, until the answer was complete."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    except BaseException:
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None and isinstance(task.result(), aiohttp.ClientResponse):
            task.result().close()
        raise


class _Upstream:
    """One request open on an instance: counted in its in-flight number, and its connection given
    back (answer read to the end) or closed (anything else: the instance then sees a disconnect and
    aborts) exactly once, however the request ends."""

    def __init__(self, instance: Instance):
        self.instance = instance
        self.resp: aiohttp.ClientResponse | None = None
        self.on_release: Callable[[], None] | None = None  # called once, after the release
        self._released = False
        instance.in_flight += 1

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.instance.in_flight -= 1
        if self.resp is not None:
            if self.resp.content.at_eof():
                self.resp.release()
            else:
                self.resp.close()
        if self.on_release is not None:
            self.on_release()


class _RelayResponse(StreamingResponse):
    """A StreamingResponse that releases its upstream even when its body is never iterated (the
    client left between the headers and the first chunk), where a generator's `finally` never runs."""

    def __init__(self, content: AsyncIterator[bytes], upstream: _Upstream, **kwargs):
        super().__init__(content, **kwargs)
        self._upstream = upstream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._upstream.release()


@dataclass
class _Trace:
    """What happened to one request, for its one log line."""

    request_id: str
    path: str
    started: float = field(default_factory=time.monotonic)
    prefill: str | None = None
    prefill_s: float | None = None
    decode: str | None = None
    retries: int = 0
    fallback: str | None = None
    notes: list[str] = field(default_factory=list)

    def line(self, status: int) -> str:
        parts = [f"{self.path} {self.request_id}: HTTP {status} in {time.monotonic() - self.started:.3f} s"]
        if self.prefill:
            parts.append(f"prefill {self.prefill}" + (f" ({self.prefill_s:.3f} s)" if self.prefill_s is not None
                                                      else ""))
        if self.fallback:
            parts.append(f"FALLBACK to decode-only ({self.fallback})")
        if self.decode:
            parts.append(f"decode {self.decode}")
        if self.retries:
            parts.append(f"{self.retries} retr{'y' if self.retries == 1 else 'ies'}")
        return ", ".join(parts + self.notes)


# --- metrics -----------------------------------------------------------------------------------
class RouterMetrics:
    """The router's own Prometheus metrics, in a private registry so that several routers (tests)
    can live in one process and an instance's metrics are never mixed in."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("splitserve_router:requests", "Requests sent to an instance (each attempt).",
                                ["instance", "role"], registry=r)
        self.retries = Counter("splitserve_router:retries", "Attempts on a further instance after a failure.",
                               ["role"], registry=r)
        self.failures = Counter("splitserve_router:failures", "Failed attempts: connection error, timeout, 5xx, "
                                "a prefill answer without kv_transfer_params, a stream that broke off.",
                                ["role"], registry=r)
        self.fallbacks = Counter("splitserve_router:fallbacks", "Requests decoded without remote prefill.",
                                 registry=r)
        self.instance_healthy = Gauge("splitserve_router:instance_healthy", "1 if the instance is up, else 0.",
                                      ["instance", "role"], registry=r)
        self.latency = Histogram("splitserve_router:request_latency_seconds", "Completion requests, arrival to "
                                 "the last byte.", buckets=_LATENCY_BUCKETS, registry=r)
        for role in ROLES:
            self.retries.labels(role=role)
            self.failures.labels(role=role)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# --- the router --------------------------------------------------------------------------------
class Router:
    """The instances, their health, the policies, and the request flow (independent of the routes)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.instances: dict[str, list[Instance]] = {
            PREFILL: [Instance(u, PREFILL) for u in config.prefill_urls],
            DECODE: [Instance(u, DECODE) for u in config.decode_urls]}
        self.policies: dict[str, Policy] = {role: make_policy(config.policy) for role in ROLES}
        self.metrics = RouterMetrics()
        for inst in self.all_instances():
            self.metrics.instance_healthy.labels(instance=inst.url, role=inst.role).set(1)
        self.session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None

    def all_instances(self) -> list[Instance]:
        return self.instances[PREFILL] + self.instances[DECODE]

    def healthy(self, role: str) -> list[Instance]:
        return [i for i in self.instances[role] if i.healthy]

    def pick(self, role: str, request_body: dict, exclude: Sequence[Instance] = ()) -> Instance | None:
        """The policy's choice among the up instances not tried yet for this request. With no decode
        instance up, the down ones are tried anyway: a health mark is a hint (a busy instance can miss
        a check), and a failed attempt costs less than refusing the request; prefill has its fallback."""
        candidates = [i for i in self.instances[role] if i.healthy and i not in exclude]
        if not candidates and role == DECODE:
            candidates = [i for i in self.instances[role] if i not in exclude]
        return self.policies[role].choose(candidates, request_body) if candidates else None

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """One shared session (connection reuse to every instance; no limit on connections, since
        each open stream holds one), a first health check so that the router starts with the real
        state, then the periodic checks."""
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout, sock_connect=self.config.connect_timeout)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                                             timeout=timeout)
        await self.check_all()
        for role in ROLES:
            logger.info("Router: %d of %d %s instance(s) up: %s", len(self.healthy(role)), len(self.instances[role]),
                        role, ", ".join(i.url for i in self.healthy(role)) or "none")
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    # --- health ------------------------------------------------------------------------------
    def _headers(self, request_id: str | None = None, content_type: str | None = None) -> dict[str, str]:
        headers = {}
        if self.config.instance_api_key:
            headers["Authorization"] = f"Bearer {self.config.instance_api_key}"
        if request_id:
            headers["X-Request-Id"] = request_id
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def mark_down(self, inst: Instance, reason: str) -> None:
        inst.down_reason = reason
        self.metrics.instance_healthy.labels(instance=inst.url, role=inst.role).set(0)
        if inst.healthy:
            inst.healthy = False
            logger.warning("%s instance %s is down: %s", inst.role, inst.url, reason)

    def mark_up(self, inst: Instance) -> None:
        inst.down_reason = None
        self.metrics.instance_healthy.labels(instance=inst.url, role=inst.role).set(1)
        if not inst.healthy:
            inst.healthy = True
            logger.info("%s instance %s is up again", inst.role, inst.url)

    def _failed(self, inst: Instance, reason: str) -> None:
        """A request failed on `inst`: count it, and send nothing more there until a health check passes."""
        self.metrics.failures.labels(role=inst.role).inc()
        self.mark_down(inst, reason)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check_instance(i) for i in self.all_instances()))

    async def check_instance(self, inst: Instance) -> None:
        """GET /health (up: a 200 in time), then /metrics for the instance's load."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout)
        try:
            async with self.session.get(inst.url + "/health", headers=self._headers(), timeout=timeout) as resp:
                data = await resp.read()
                status = resp.status
        except _UPSTREAM_ERRORS as exc:
            self.mark_down(inst, describe_error(exc, self.config.health_timeout))
            return
        if status != 200:
            self.mark_down(inst, "/health " + _status_reason(status, data))
            return
        self.mark_up(inst)
        inst.load = await self._fetch_load(inst, timeout)

    async def _fetch_load(self, inst: Instance, timeout: aiohttp.ClientTimeout) -> InstanceLoad | None:
        """None when the metrics cannot be had (a separate --metrics-port, a metrics key): the
        instance is still up, least_load then goes by this router's own in-flight counts."""
        try:
            async with self.session.get(inst.url + "/metrics", headers=self._headers(), timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        except _UPSTREAM_ERRORS:
            return None
        return parse_instance_load(text)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop the checks for good
                logger.exception("Health check round failed")

    # --- one upstream exchange ---------------------------------------------------------------
    async def _open(self, request: Request, upstream: _Upstream, method: str, path: str, *, json_body=None,
                    data: bytes | None = None, request_id: str | None = None,
                    content_type: str | None = None) -> aiohttp.ClientResponse:
        """Send the request and wait for the answer's headers (the client may leave meanwhile)."""
        inst = upstream.instance
        self.metrics.requests.labels(instance=inst.url, role=inst.role).inc()

        async def send() -> aiohttp.ClientResponse:
            return await self.session.request(method, inst.url + path, json=json_body, data=data,
                                              headers=self._headers(request_id, content_type))

        upstream.resp = await until_disconnected(request, send())
        return upstream.resp

    async def _exchange(self, request: Request, inst: Instance, method: str, path: str,
                        **kwargs) -> tuple[int, bytes, str | None]:
        """A whole non-streamed request: (status, body, content type)."""
        upstream = _Upstream(inst)
        try:
            resp = await self._open(request, upstream, method, path, **kwargs)
            data = await until_disconnected(request, resp.read())
            return resp.status, data, resp.headers.get("Content-Type")
        finally:
            upstream.release()

    # --- completions and chat ----------------------------------------------------------------
    async def handle_generation(self, request: Request, path: str) -> Response:
        body = await read_json_body(request)
        trace = _Trace(request.headers.get("x-request-id") or uuid.uuid4().hex, path)
        try:
            if _is_batch(body):  # PD moves one prompt's KV; a batch of prompts is decoded in one place
                trace.fallback = "a batch of prompts is decoded without remote prefill"
                prefilled = None
            else:
                prefilled = await self._prefill(request, path, body, trace)
            if isinstance(prefilled, Response):
                return self._finish(trace, prefilled)
            if prefilled is None:
                self.metrics.fallbacks.inc()
                decode_body = fallback_request_body(body)
            else:
                decode_body = decode_request_body(body, prefilled)
            return await self._decode(request, path, decode_body, trace)
        except ClientGone:
            trace.notes.append("the client disconnected (upstream request closed)")
            return self._finish(trace, Response(status_code=499))

    def _finish(self, trace: _Trace, response: Response) -> Response:
        self._log_request(trace, response.status_code)
        return response

    def _log_request(self, trace: _Trace, status: int) -> None:
        self.metrics.latency.observe(time.monotonic() - trace.started)
        logger.info("%s", trace.line(status))

    def _attempts(self, role: str, body: dict, trace: _Trace | None = None) -> Iterator[Instance]:
        """The instances to try for one request, in the policy's order: at most 1 + max_retries,
        each tried once; for completions (with a trace) every attempt after the first counts as a retry."""
        tried: list[Instance] = []
        for attempt in range(self.config.max_retries + 1):
            inst = self.pick(role, body, exclude=tried)
            if inst is None:
                return
            if attempt and trace is not None:
                self.metrics.retries.labels(role=role).inc()
                trace.retries += 1
            tried.append(inst)
            yield inst

    async def _prefill(self, request: Request, path: str, body: dict, trace: _Trace) -> dict | Response | None:
        """The prefill's kv_transfer_params; or the instance's 4xx answer to pass on; or None when no
        prefill instance could do it (then the request is decoded without remote prefill)."""
        prefill_body = prefill_request_body(body)
        reasons: list[str] = []
        for inst in self._attempts(PREFILL, body, trace):
            started = time.monotonic()
            try:
                status, data, content_type = await self._exchange(request, inst, "POST", path, json_body=prefill_body,
                                                                  request_id=trace.request_id)
            except _UPSTREAM_ERRORS as exc:
                reason = describe_error(exc, self.config.request_timeout)
            else:
                if status == 429:  # this instance is full, not the request invalid: try another one
                    reasons.append(f"{inst.url}: busy (429)")
                    continue
                if 400 <= status < 500:
                    trace.prefill = inst.url
                    trace.notes.append("the prefill instance refused the request")
                    return Response(data, status_code=status, media_type=content_type)
                kv = _kv_params(data) if status < 300 else None
                if kv is not None:
                    trace.prefill, trace.prefill_s = inst.url, time.monotonic() - started
                    return kv
                if status < 300:
                    reason = "answered without kv_transfer_params (is it running as a prefill instance?)"
                    logger.warning("prefill instance %s %s", inst.url, reason)
                else:
                    reason = _status_reason(status, data)
            self._failed(inst, reason)
            reasons.append(f"{inst.url}: {reason}")
        trace.fallback = "; ".join(reasons) if reasons else "no prefill instance is up"
        return None

    async def _decode(self, request: Request, path: str, body: dict, trace: _Trace) -> Response:
        """The decode instance's answer: passed through as it comes. Failures before the first byte
        reached the client are retried on another decode instance; a 503 when none is left."""
        reasons: list[str] = []
        for inst in self._attempts(DECODE, body, trace):
            trace.decode = inst.url
            upstream = _Upstream(inst)
            handed_over = False
            try:
                resp = await self._open(request, upstream, "POST", path, json_body=body, request_id=trace.request_id)
                if resp.status >= 500:
                    reason = _status_reason(resp.status, await until_disconnected(request, resp.read()))
                elif resp.status == 200 and resp.content_type == "text/event-stream":
                    first = await until_disconnected(request, _first_chunk(resp))
                    upstream.on_release = lambda: self._log_request(trace, 200)
                    handed_over = True
                    return _RelayResponse(self._relay(upstream, first, trace), upstream,
                                          media_type="text/event-stream")
                else:
                    data = await until_disconnected(request, resp.read())
                    return self._finish(trace, Response(data, status_code=resp.status,
                                                        media_type=resp.headers.get("Content-Type")))
            except _UPSTREAM_ERRORS as exc:
                reason = describe_error(exc, self.config.request_timeout)
            finally:
                if not handed_over:
                    upstream.release()
            self._failed(inst, reason)
            reasons.append(f"{inst.url}: {reason}")
        if not reasons:
            reasons = [f"{i.url}: {i.down_reason or 'down'}" for i in self.instances[DECODE]]
            message = "No decode instance is up (" + "; ".join(reasons) + ")."
        else:
            message = "No decode instance could serve the request: " + "; ".join(reasons) + "."
        trace.notes.append(message)
        return self._finish(trace, error_response(message, 503, "service_unavailable"))

    async def _relay(self, upstream: _Upstream, first: bytes, trace: _Trace) -> AsyncIterator[bytes]:
        """The decode instance's SSE bytes as they arrive. If the stream breaks, the client gets an
        error event and [DONE] (its own SDK then raises instead of waiting). If the client leaves,
        Starlette cancels this generator and `finally` closes the upstream connection."""
        ended = False
        try:
            if first:
                yield first
            async for chunk in upstream.resp.content.iter_any():
                yield chunk
            ended = True
        except _UPSTREAM_ERRORS as exc:
            ended = True
            reason = f"the stream broke off ({describe_error(exc, self.config.request_timeout)})"
            self._failed(upstream.instance, reason)
            trace.notes.append(f"decode {reason}")
            yield sse_error_event(f"The decode instance failed mid-stream: {reason}.")
            yield _DONE_EVENT
        finally:
            if not ended:
                trace.notes.append("the client disconnected mid-stream (upstream request closed)")
            upstream.release()

    # --- other routes ------------------------------------------------------------------------
    async def forward(self, request: Request, method: str, path: str) -> Response:
        """/v1/models, /tokenize, /detokenize, /version: any up decode instance answers them (all
        serve the same model); retried on another one on a connection error or 5xx."""
        data = await read_body(request) if method == "POST" else None
        content_type = request.headers.get("content-type") if method == "POST" else None
        reasons: list[str] = []
        for inst in self._attempts(DECODE, {}):
            try:
                status, body, ctype = await self._exchange(request, inst, method, path, data=data,
                                                           content_type=content_type)
            except ClientGone:
                return Response(status_code=499)
            except _UPSTREAM_ERRORS as exc:
                reason = describe_error(exc, self.config.request_timeout)
            else:
                if status < 500:
                    return Response(body, status_code=status, media_type=ctype)
                reason = _status_reason(status, body)
            self._failed(inst, reason)
            reasons.append(f"{inst.url}: {reason}")
        detail = "; ".join(reasons) or "none is up"
        return error_response(f"No decode instance could answer {path}: {detail}.", 503, "service_unavailable")

    def health(self) -> Response:
        """200 when both roles have an up instance; otherwise a 503 saying which role has none and why."""
        missing = [role for role in ROLES if not self.healthy(role)]
        if missing:
            why = "; ".join(f"{i.url}: {i.down_reason or 'down'}" for role in missing for i in self.instances[role])
            return error_response(f"No {' and no '.join(missing)} instance is up ({why}).", 503,
                                  "service_unavailable")
        return JSONResponse({"status": "ok", **{role: len(self.healthy(role)) for role in ROLES}})


async def _first_chunk(resp: aiohttp.ClientResponse) -> bytes:
    """The first bytes of a stream (b"" if it ends at once). Read before the response starts, so that
    a decode instance failing that early can still be replaced by another."""
    async for chunk in resp.content.iter_any():
        if chunk:
            return chunk
    return b""


# --- the application ---------------------------------------------------------------------------
def build_router_app(config: RouterConfig) -> FastAPI:
    """The router's FastAPI app; its lifespan opens the shared HTTP session and runs the health
    checks. `app.state.router` is the Router (instances, metrics), for tests and embedding."""
    router = Router(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="splitserve router", version=__version__, lifespan=lifespan)
    app.state.router = router

    install_error_handlers(app, "router")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle_generation(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.handle_generation(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        return await router.forward(request, "GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await router.forward(request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await router.forward(request, "POST", "/detokenize")

    @app.get("/version")
    async def version(request: Request):
        return await router.forward(request, "GET", "/version")

    @app.get("/health")
    async def health():
        return router.health()

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if config.api_key:  # load balancers and Prometheus need no key
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=("/health", "/metrics"))
    return app


def run_router(config: RouterConfig, host: str = "0.0.0.0", port: int = 9000) -> None:
    """Serve the router with uvicorn until interrupted (no access log: the router logs one line per
    completion request itself)."""
    import uvicorn

    uvicorn.run(build_router_app(config), host=host, port=port, access_log=False, log_level="info")


# --- command line ------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="base URL of a prefill instance, e.g. http://10.0.0.1:8000 (repeatable)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="base URL of a decode instance (repeatable)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--policy", choices=POLICIES, default="round_robin",
                        help="how an instance is chosen within a role (default: round_robin)")
    parser.add_argument("--api-key", default=None, help="key clients must send as 'Authorization: Bearer KEY'")
    parser.add_argument("--instance-api-key", default=None, help="key sent to the instances (their --api-key)")
    parser.add_argument("--max-retries", type=int, default=2,
                        help="further instances tried after a failed one, per role (default: 2)")
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    parser.add_argument("--request-timeout", type=float, default=3600.0,
                        help="seconds an upstream request (stream included) may take (default: 3600)")


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    return RouterConfig(prefill_urls=ns.prefill, decode_urls=ns.decode, policy=ns.policy, api_key=ns.api_key,
                        instance_api_key=ns.instance_api_key, max_retries=ns.max_retries,
                        health_interval=ns.health_interval, request_timeout=ns.request_timeout)


def main(ns: argparse.Namespace) -> None:
    run_router(config_from_args(ns), ns.host, ns.port)
