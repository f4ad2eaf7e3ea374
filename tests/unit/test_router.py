"""The PD disaggregation router (splitserve/entrypoints/router/) against fake prefill and decode instances
on loopback: aiohttp.web apps on one background event loop that record the bodies they receive, answer
/health and /metrics, and fail on demand (not listening, HTTP 500/400, an answer without
kv_transfer_params, a stream that breaks after two chunks, a request held open). The router itself runs
under a real uvicorn server in a thread, so that streaming and client disconnects behave as in production.
The policies, body rewriting, load parsing and configuration checks are also tested on their own."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import uvicorn
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from splitserve.disagg.policies import (
    InstanceLoad,
    LeastLoadPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    Upstream,
    parse_instance_load,
    prompt_prefix,
)
from splitserve.entrypoints.cli import build_parser
from splitserve.entrypoints.router import RouterConfig, build_router_app
from splitserve.entrypoints.router.config import DECODE, PREFILL, config_from_args
from splitserve.entrypoints.router.relay import decode_request_body, prefill_request_body

CHUNKS = [
    b'data: {"id":"cmpl-s","choices":[{"index":0,"text":"Hel"}]}\n\n',
    b'data: {"id":"cmpl-s","choices":[{"index":0,"text":"lo"}]}\n\n',
    b'data: {"id":"cmpl-s","choices":[{"index":0,"text":"!","finish_reason":"length"}]}\n\n',
    b"data: [DONE]\n\n",
]
RESTARTING_EVENTS = [
    b'data: {"id":"chatcmpl-r","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"finish_reason":null}]}\n\n',
    b'data: {"error":{"message":"The engine is restarting after it failed (the engine process exited); '
    b'retry in a few seconds.","type":"service_unavailable","param":null,"code":503}}\n\n',
    b"data: [DONE]\n\n",
]
BAD_REQUEST = {
    "error": {"message": "The prompt is empty.", "type": "invalid_request_error", "param": "prompt", "code": 400}
}
HOLD = "HOLD"  # a prompt containing it is held open by a decode instance until released


# --- fakes ---------------------------------------------------------------------------------------------
class FakeLoop:
    """One event loop in a daemon thread that hosts every fake instance."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 5.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class FakeInstance:
    """A splitserve OpenAI server as the router sees it. `mode` sets how it answers completions:
    ok, 500, 400, no_kv (prefill answers without kv_transfer_params), break (decode stream dies after
    two chunks), restarting (a chat stream's opening event, then the 503 error event of an engine
    that died before the first token). A decode request whose prompt contains HOLD streams (or
    waits) until `release` is set or its client goes away (then `disconnected` is set)."""

    def __init__(self, fakes: FakeLoop, role: str, name: str, log: list) -> None:
        self.fakes, self.role, self.name, self.log = fakes, role, name, log
        self.mode = "ok"
        self.health_status = 200
        self.load = (0, 0, 0.0)  # running, waiting, kv usage per label set (two label sets are exported)
        self.bodies: list[tuple[str, dict]] = []
        self.auth: list[str | None] = []
        self.traceparents: list[str | None] = []  # the W3C trace context the router sent (tracing on)
        self.health_auth: list[str | None] = []
        self.sent: list[bytes] = []
        self.release = threading.Event()
        self.disconnected = threading.Event()
        self.count = 0
        self.pd_role: str | None = None  # what GET /pd_role answers (None: 404, as an older server)
        self.released: list[dict] = []  # the kv_transfer_params handed back to /kv_transfer/release
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/completions", self.generate),
                web.post("/v1/chat/completions", self.generate),
                web.post("/generate", self.generate),
                web.get("/health", self.health),
                web.get("/pd_role", self.answer_role),
                web.get("/metrics", self.metrics),
                web.get("/v1/models", self.models),
                web.post("/tokenize", self.tokenize),
                web.post("/kv_transfer/release", self.release_kv),
                *self.extra_routes(),
            ]
        )
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.runner = web.AppRunner(app, access_log=None)
        fakes.run(self._start())

    async def _start(self) -> None:
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock).start()

    def extra_routes(self) -> list:
        """Further routes of a subclass's (test_router_routes.py)."""
        return []

    def stop(self) -> None:
        """From now on: connection refused."""
        self.release.set()
        self.fakes.run(self.runner.cleanup())

    # --- handlers -----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        self.health_auth.append(request.headers.get("Authorization"))
        return web.Response(status=self.health_status)

    async def answer_role(self, request: web.Request) -> web.Response:
        if self.pd_role is None:
            return web.Response(status=404)
        return web.json_response({"pd_role": self.pd_role})

    async def metrics(self, request: web.Request) -> web.Response:
        running, waiting, kv = self.load
        lines = [
            "# TYPE splitserve:num_requests_running gauge",
            "# TYPE splitserve:num_requests_waiting gauge",
            "# TYPE splitserve:kv_cache_usage_perc gauge",
        ]
        for model in ("a", "b"):
            lines += [
                f'splitserve:num_requests_running{{model_name="{model}"}} {running}',
                f'splitserve:num_requests_waiting{{model_name="{model}"}} {waiting}',
                f'splitserve:kv_cache_usage_perc{{model_name="{model}"}} {kv}',
            ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def release_kv(self, request: web.Request) -> web.Response:
        self.released.append((await request.json())["kv_transfer_params"])
        return web.json_response({"released": self.released[-1]["remote_request_id"]})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "served_by": self.name}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"tokens": [1, 2, 3], "got": await request.json(), "served_by": self.name})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.count += 1
        self.bodies.append((request.path, body))
        self.auth.append(request.headers.get("Authorization"))
        self.traceparents.append(request.headers.get("traceparent"))
        self.log.append((self.role, self.name))
        if self.mode == "500":
            return web.json_response(
                {"error": {"message": "engine exploded", "type": "internal_error", "param": None, "code": 500}},
                status=500,
            )
        if self.mode == "400":
            return self._json(BAD_REQUEST, 400)
        if self.mode == "429":
            return self._json(
                {"error": {"message": "busy", "type": "rate_limit_exceeded", "param": None, "code": 429}}, 429
            )
        if self.role == PREFILL:
            answer = {
                "id": f"cmpl-{self.name}",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            }
            if self.mode != "no_kv":
                answer["kv_transfer_params"] = {
                    "remote_host": "10.0.0.7",
                    "remote_port": 5557,
                    "remote_request_id": f"{self.name}-{self.count}",
                    "remote_num_pulls": 1,
                    "prompt_token_ids": [5, 6, 7],
                }
            return self._json(answer)
        held = HOLD in json.dumps(body.get("prompt", body.get("messages")))
        if self.mode == "restarting":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in RESTARTING_EVENTS:
                await resp.write(event)
                await asyncio.sleep(0.01)
            await resp.write_eof()
            return resp
        if body.get("stream"):
            return await self._stream(request, held)
        if held:
            return await self._hold(request)
        return self._json(
            {
                "id": "cmpl-d",
                "object": "text_completion",
                "model": "fake",
                "choices": [{"index": 0, "text": f" served by {self.name}", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            }
        )

    def _json(self, obj: dict, status: int = 200) -> web.Response:
        data = json.dumps(obj).encode()
        self.sent.append(data)
        return web.Response(body=data, status=status, content_type="application/json")

    async def _stream(self, request: web.Request, held: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        completed = False
        try:
            if held:
                while not self.release.is_set():
                    await resp.write(CHUNKS[0])
                    await asyncio.sleep(0.05)
                await resp.write(CHUNKS[-1])
            else:
                for i, chunk in enumerate(CHUNKS):
                    if self.mode == "break" and i == 2:
                        request.transport.close()  # dies mid-stream: no terminating chunk
                        completed = True
                        return resp
                    await resp.write(chunk)
                    await asyncio.sleep(0.01)
            await resp.write_eof()
            completed = True
        except ConnectionError:  # the router closed the connection: expected, not worth a traceback
            pass
        finally:
            if not completed:
                self.disconnected.set()
        return resp

    async def _hold(self, request: web.Request) -> web.Response:
        while not self.release.is_set():
            if request.transport is None or request.transport.is_closing():
                self.disconnected.set()
                return web.Response(status=499)
            await asyncio.sleep(0.02)
        return self._json({"id": "cmpl-held", "choices": []})


class RouterServer:
    """build_router_app(config) under uvicorn on a free loopback port, in a thread."""

    def __init__(self, config: RouterConfig) -> None:
        self.app = build_router_app(config)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, what="the router to start")
        self.client = httpx.Client(base_url=self.url, timeout=10)

    @property
    def router(self):
        return self.app.state.router

    def metric(self, name: str, **labels) -> float | None:
        text = self.client.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return None

    def close(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(10)


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def dead_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def sse_events(data: bytes) -> list[str]:
    return [e[len("data: ") :] for e in data.decode().split("\n\n") if e]


@pytest.fixture(scope="module")
def fake_loop():
    loop = FakeLoop()
    yield loop
    loop.close()


@pytest.fixture
def cluster(fake_loop):
    """cluster(n_prefill, n_decode, fake=FakeInstance, **config) -> (router server, prefill fakes, decode
    fakes, call log)."""
    made: list = []

    def make(
        n_prefill: int = 1, n_decode: int = 1, *, prefill_urls=None, decode_urls=None, fake=FakeInstance, **config
    ):
        log: list = []
        prefills = [fake(fake_loop, PREFILL, f"p{i}", log) for i in range(n_prefill)]
        decodes = [fake(fake_loop, DECODE, f"d{i}", log) for i in range(n_decode)]
        made.extend(prefills + decodes)
        config.setdefault("health_interval", 60.0)  # no periodic check unless a test asks for one
        server = RouterServer(
            RouterConfig(prefill_urls or [p.url for p in prefills], decode_urls or [d.url for d in decodes], **config)
        )
        made.append(server)
        return server, prefills, decodes, log

    yield make
    for thing in reversed(made):
        if isinstance(thing, FakeInstance):
            thing.release.set()
    for thing in made:
        if isinstance(thing, RouterServer):
            thing.close()
    for thing in made:
        if isinstance(thing, FakeInstance):
            try:
                thing.stop()
            except Exception:
                pass


COMPLETION = {
    "model": "fake",
    "prompt": "The capital of France is",
    "max_tokens": 20,
    "temperature": 0.0,
    "min_tokens": 2,
    "n": 2,
}


# --- the request flow ----------------------------------------------------------------------------------
def test_non_streamed_completion_goes_prefill_then_decode(cluster):
    server, [p], [d], log = cluster(1, 1)
    r = server.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200
    assert r.content == d.sent[-1]  # the decode instance's answer, byte for byte
    assert log == [(PREFILL, "p0"), (DECODE, "d0")]
    path, prefill_body = p.bodies[0]
    assert path == "/v1/completions"
    assert prefill_body == {
        "model": "fake",
        "prompt": "The capital of France is",
        "max_tokens": 1,
        "min_tokens": 1,
        "temperature": 0.0,
        "n": 2,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    kv = json.loads(p.sent[0])["kv_transfer_params"]
    assert d.bodies[0] == ("/v1/completions", {**COMPLETION, "kv_transfer_params": {**kv, "do_remote_prefill": True}})


def test_streamed_completion_is_passed_through_unchanged(cluster):
    server, [p], [d], _ = cluster(1, 1)
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    with server.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        received = b"".join(r.iter_raw())
    assert received == b"".join(CHUNKS)
    assert sse_events(received)[-1] == "[DONE]"
    prefill_body = p.bodies[0][1]
    assert prefill_body["stream"] is False and prefill_body["max_tokens"] == 1
    assert "stream_options" not in prefill_body
    assert prefill_body["min_tokens"] == 1  # the first token is sampled under the client's min_tokens
    assert d.bodies[0][1]["stream"] is True and d.bodies[0][1]["stream_options"] == {"include_usage": True}
    assert d.bodies[0][1]["kv_transfer_params"]["do_remote_prefill"] is True


def test_native_api_only_when_use_openai_is_0(cluster):
    server, [p], [d], log = cluster(1, 1, openai_api=False)
    r = server.client.post("/generate", json={"prompt": "The capital of France is", "max_tokens": 4})
    assert r.status_code == 200 and log == [(PREFILL, "p0"), (DECODE, "d0")]
    assert [path for path, _ in p.bodies + d.bodies] == ["/generate", "/generate"]
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        r = server.client.request(method, path, json={"prompt": "x"} if method == "POST" else None)
        assert r.status_code == 404 and "USE_OPENAI=0" in r.json()["error"]["message"], (path, r.text)
    assert server.client.post("/tokenize", json={"prompt": "x"}).status_code == 404
    assert server.client.get("/health").status_code == 200
    assert len(log) == 2  # the refused routes reached no instance


def test_chat_completion_flow(cluster):
    server, [p], [d], _ = cluster(1, 1)
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 30,
        "stream": True,
        "stream_options": {"include_usage": True},
        "metadata": {"min_tokens": 3, "k": "v"},
    }
    with server.client.stream("POST", "/v1/chat/completions", json=body) as r:
        received = b"".join(r.iter_raw())
    assert received == b"".join(CHUNKS)
    path, prefill_body = p.bodies[0]
    assert path == "/v1/chat/completions"
    assert prefill_body == {
        "model": "fake",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "stream": False,
        "metadata": {"min_tokens": 1, "k": "v"},
        "kv_transfer_params": {"do_remote_decode": True},
    }
    kv = json.loads(p.sent[0])["kv_transfer_params"]
    assert d.bodies[0] == ("/v1/chat/completions", {**body, "kv_transfer_params": {**kv, "do_remote_prefill": True}})


def test_prefill_retry_on_second_instance_when_first_is_down(cluster):
    server, [p0, p1], [d], log = cluster(2, 1)
    p0.stop()  # up at the router's first check, refused now
    r = server.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200
    assert [name for role, name in log if role == PREFILL] == ["p1"]
    assert d.bodies[0][1]["kv_transfer_params"]["remote_request_id"] == "p1-1"  # p1's KV, not a fallback
    assert server.metric("splitserve_router:retries_total", role=PREFILL) == 1
    assert server.metric("splitserve_router:instance_healthy", instance=p0.url, role=PREFILL) == 0
    assert server.metric("splitserve_router:fallbacks_total") == 0
    server.client.post("/v1/completions", json=COMPLETION)  # p0 stays out until a health check passes
    assert server.metric("splitserve_router:retries_total", role=PREFILL) == 1
    assert p1.count == 2


@pytest.mark.parametrize("failure", ["500", "no_kv", "refused"])
def test_fallback_to_decode_only_when_every_prefill_fails(cluster, failure):
    if failure == "refused":
        server, _, [d], _ = cluster(0, 1, prefill_urls=[dead_url(), dead_url()])
    else:
        server, prefills, [d], _ = cluster(2, 1)
        for p in prefills:
            p.mode = failure
    r = server.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.content == d.sent[-1]
    assert d.bodies[0][1] == COMPLETION  # the original body, no kv_transfer_params
    assert server.metric("splitserve_router:fallbacks_total") == 1
    if failure != "refused":  # both were tried: one retry, two failures
        assert all(p.count == 1 for p in prefills)
        assert server.metric("splitserve_router:retries_total", role=PREFILL) == 1
        assert server.metric("splitserve_router:failures_total", role=PREFILL) == 2


def test_prefill_4xx_is_returned_as_is_and_decode_not_called(cluster):
    server, [p], [d], _ = cluster(1, 1)
    p.mode = "400"
    r = server.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 400
    assert r.content == p.sent[0] and r.json() == BAD_REQUEST
    assert d.bodies == []
    assert server.metric("splitserve_router:fallbacks_total") == 0
    assert server.router.instances[PREFILL][0].healthy  # the request was bad, not the instance


def test_prefill_429_tries_another_prefill_instance(cluster):
    server, [busy, free], [d], _ = cluster(2, 1, policy="round_robin")
    busy.mode = "429"
    for _ in range(2):  # whichever the policy picks first, the request ends prefilled by the free one
        assert server.client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert free.count == 2 and all("kv_transfer_params" in body for _, body in d.bodies)
    assert server.router.instances[PREFILL][0].healthy  # busy is not down


def test_batch_of_prompts_is_decoded_without_remote_prefill(cluster):
    server, [p], [d], _ = cluster(1, 1)
    body = {**COMPLETION, "prompt": ["one", "two"]}
    assert server.client.post("/v1/completions", json=body).status_code == 200
    assert p.bodies == [] and d.bodies[0][1] == body
    assert server.metric("splitserve_router:fallbacks_total") == 1


def test_decode_retry_on_another_instance(cluster):
    server, [p], [d0, d1], _ = cluster(1, 2)
    d0.mode = "500"
    with server.client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        assert r.status_code == 200
        assert b"".join(r.iter_raw()) == b"".join(CHUNKS)
    assert d0.count == 1 and d1.count == 1
    assert d0.bodies[0][1]["kv_transfer_params"] == d1.bodies[0][1]["kv_transfer_params"]
    assert server.metric("splitserve_router:retries_total", role=DECODE) == 1
    assert server.metric("splitserve_router:instance_healthy", instance=d0.url, role=DECODE) == 0


def test_a_stream_that_opens_with_an_engine_failure_is_retried_on_another_decode_instance(cluster):
    """Nothing was generated (the chat opening and a 503 event): the client never sees that stream."""
    server, [p], [d0, d1], _ = cluster(1, 2)
    d0.mode = "restarting"
    with server.client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        assert r.status_code == 200
        assert b"".join(r.iter_raw()) == b"".join(CHUNKS)
    assert d0.count == 1 and d1.count == 1
    assert server.metric("splitserve_router:retries_total", role=DECODE) == 1
    assert p.released == []  # d1 pulled the KV: nothing to hand back


def test_a_failed_decode_hands_the_prefill_lease_back(cluster):
    """No decode instance could decode: the prefill instance gets its kv_transfer_params back, so that
    it frees the blocks now rather than when the lease expires."""
    server, [p], [d], _ = cluster(1, 1)
    d.mode = "restarting"
    with server.client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        assert r.status_code == 503
        assert "restarting" in json.loads(r.read())["error"]["message"]
    assert [kv["remote_request_id"] for kv in p.released] == [f"{p.name}-1"]


def test_decode_503_when_every_decode_fails(cluster):
    server, _, decodes, _ = cluster(1, 2)
    for d in decodes:
        d.mode = "500"
    r = server.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["type"] == "service_unavailable" and error["code"] == 503
    assert all(d.url in error["message"] for d in decodes) and "HTTP 500" in error["message"]
    # Both are marked down now, yet still tried (a health mark is only a hint), and both fail again.
    r = server.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503 and all(d.count == 2 for d in decodes)


def test_health_503_when_no_decode_instance_is_up(cluster):
    server, _, _, _ = cluster(1, 0, decode_urls=[dead_url()])
    r = server.client.get("/health")
    assert r.status_code == 503
    assert "No decode instance is up" in r.json()["error"]["message"]
    assert "connection refused" in r.json()["error"]["message"]
    assert server.client.post("/v1/completions", json=COMPLETION).status_code == 503


def test_decode_stream_breaking_midway_ends_with_error_event_and_done(cluster):
    server, _, [d], _ = cluster(1, 1)
    d.mode = "break"
    with server.client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as r:
        assert r.status_code == 200
        received = b"".join(r.iter_raw())
    events = sse_events(received)
    assert received.startswith(CHUNKS[0] + CHUNKS[1])
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and error["code"] == 503 and error["param"] is None
    assert len(events) == 4  # two chunks, the error, [DONE]
    assert server.metric("splitserve_router:failures_total", role=DECODE) == 1


# --- client disconnects --------------------------------------------------------------------------------
def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_client_disconnect_mid_stream_closes_upstream(cluster):
    server, _, [d], _ = cluster(1, 1)
    sock = _raw_post(server.url, "/v1/completions", {**COMPLETION, "prompt": HOLD, "stream": True})
    received = b""
    while b"data:" not in received:
        received += sock.recv(4096)
    assert server.router.instances[DECODE][0].in_flight == 1
    sock.close()
    assert d.disconnected.wait(5), "the decode instance never saw the disconnect"
    wait_for(lambda: server.router.instances[DECODE][0].in_flight == 0, what="the upstream to be released")


def test_client_disconnect_non_streamed_closes_upstream(cluster):
    server, _, [d], _ = cluster(1, 1)
    sock = _raw_post(server.url, "/v1/completions", {**COMPLETION, "prompt": HOLD})
    wait_for(lambda: d.count == 1, what="the decode request")
    sock.close()
    assert d.disconnected.wait(5), "the decode instance never saw the disconnect"
    wait_for(lambda: server.router.instances[DECODE][0].in_flight == 0, what="the upstream to be released")


# --- policies over HTTP --------------------------------------------------------------------------------
def test_round_robin_alternates(cluster):
    server, _, _, log = cluster(2, 2, policy="round_robin")
    for _ in range(4):
        assert server.client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert [name for role, name in log if role == PREFILL] == ["p0", "p1", "p0", "p1"]
    assert [name for role, name in log if role == DECODE] == ["d0", "d1", "d0", "d1"]


def test_least_load_avoids_the_instance_with_a_request_in_flight(cluster):
    server, _, decodes, _ = cluster(1, 2, policy="least_load")
    with httpx.Client(base_url=server.url, timeout=10) as other:
        with other.stream("POST", "/v1/completions", json={**COMPLETION, "prompt": HOLD, "stream": True}) as held:
            assert held.status_code == 200
            busy = next(d for d in decodes if d.count == 1)
            for _ in range(3):
                assert server.client.post("/v1/completions", json=COMPLETION).status_code == 200
            idle = next(d for d in decodes if d is not busy)
            assert busy.count == 1 and idle.count == 3
            busy.release.set()
            assert sse_events(b"".join(held.iter_raw()))[-1] == "[DONE]"


def test_prefix_aware_same_prompt_same_instance_and_spread(cluster):
    server, _, decodes, _ = cluster(1, 2, policy="prefix_aware")
    for _ in range(3):
        server.client.post("/v1/completions", json={**COMPLETION, "prompt": "A fixed system prompt. Q1"})
    assert sorted(d.count for d in decodes) == [0, 3]
    # Instance URLs (free ports) change every run, and so does the hashing: with 40 prompts the
    # chance that either instance gets fewer than 3 is below 1e-9.
    for i in range(40):
        server.client.post("/v1/completions", json={**COMPLETION, "prompt": f"prompt number {i}"})
    assert all(d.count >= 3 for d in decodes), [d.count for d in decodes]  # spread over both


def test_prefix_aware_takes_the_least_loaded_when_skewed(cluster):
    server, _, decodes, _ = cluster(1, 2, policy="prefix_aware")
    prefix = "P" * 600  # beyond the 512 characters that are hashed
    server.client.post("/v1/completions", json={**COMPLETION, "prompt": prefix + "first"})
    home = next(d for d in decodes if d.count == 1)
    other = next(d for d in decodes if d is not home)
    clients = [httpx.Client(base_url=server.url, timeout=10) for _ in range(3)]
    streams = [
        c.stream("POST", "/v1/completions", json={**COMPLETION, "prompt": prefix + HOLD, "stream": True})
        for c in clients
    ]
    try:
        for s in streams:  # 1, 2, then 3 in flight on home: not more than twice max(0, 1) until the third
            s.__enter__()
        assert home.count == 4 and other.count == 0
        server.client.post("/v1/completions", json={**COMPLETION, "prompt": prefix + "later"})
        assert other.count == 1  # 3 > 2 x 1: the least loaded one takes it
    finally:
        home.release.set()
        for s, c in zip(streams, clients):
            s.__exit__(None, None, None)
            c.close()


# --- health, metrics, auth, other routes ---------------------------------------------------------------
def test_health_checks_mark_instances_down_and_up(cluster, caplog):
    caplog.set_level("INFO", logger="splitserve.router")
    server, _, [d0, d1], _ = cluster(1, 2, health_interval=0.05)
    assert server.client.get("/health").json() == {"status": "ok", "prefill": 1, "decode": 2}
    d1.stop()
    d0.health_status = 503
    wait_for(lambda: server.client.get("/health").status_code == 503, what="/health to turn 503")
    message = server.client.get("/health").json()["error"]["message"]
    assert "decode" in message and "prefill" not in message.split("(")[0]
    assert f"decode instance {d1.url} is down: connection refused" in caplog.text
    assert f"decode instance {d0.url} is down: /health answered HTTP 503" in caplog.text
    d0.health_status = 200
    wait_for(lambda: server.client.get("/health").status_code == 200, what="/health to turn 200")
    assert f"decode instance {d0.url} is up again" in caplog.text
    assert server.client.post("/v1/completions", json=COMPLETION).status_code == 200
    assert d0.count == 1 and d1.count == 0


def test_health_checks_read_the_instance_load(cluster):
    server, [p], [d], _ = cluster(1, 1, health_interval=0.05)
    d.load = (2, 1, 0.25)
    wait_for(lambda: server.router.instances[DECODE][0].load == InstanceLoad(6, 0.5), what="the decode load")
    assert server.router.instances[PREFILL][0].load == InstanceLoad(0, 0.0)


def test_metrics_count_requests_retries_fallbacks(cluster):
    server, [p0, p1], [d], _ = cluster(2, 1)
    server.client.post("/v1/completions", json=COMPLETION)
    p0.mode = p1.mode = "500"
    server.client.post("/v1/completions", json=COMPLETION)
    text = server.client.get("/metrics").text
    assert "splitserve_router:requests_total" in text
    # round robin: p0 (ok); then p1 (500) and the retry on p0 (500), then the fallback
    assert server.metric("splitserve_router:requests_total", instance=p0.url, role=PREFILL) == 2
    assert server.metric("splitserve_router:requests_total", instance=p1.url, role=PREFILL) == 1
    assert server.metric("splitserve_router:requests_total", instance=d.url, role=DECODE) == 2
    assert server.metric("splitserve_router:retries_total", role=PREFILL) == 1
    assert server.metric("splitserve_router:failures_total", role=PREFILL) == 2
    assert server.metric("splitserve_router:fallbacks_total") == 1
    assert server.metric("splitserve_router:instance_healthy", instance=d.url, role=DECODE) == 1
    assert server.metric("splitserve_router:instance_healthy", instance=p1.url, role=PREFILL) == 0
    assert server.metric("splitserve_router:request_latency_seconds_count") == 2


def test_api_keys(cluster):
    server, [p], [d], _ = cluster(1, 1, api_key="client-key", instance_api_key="inst-key")
    c = server.client
    assert c.post("/v1/completions", json=COMPLETION).status_code == 401
    r = c.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert c.get("/v1/models").status_code == 401
    assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401
    assert p.bodies == [] and d.bodies == []
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    ok = {"Authorization": "Bearer client-key"}
    assert c.post("/v1/completions", json=COMPLETION, headers=ok).status_code == 200
    assert c.get("/v1/models", headers=ok).status_code == 200
    assert p.auth == ["Bearer inst-key"] and d.auth == ["Bearer inst-key"]
    assert p.health_auth[0] == "Bearer inst-key"


def test_bad_bodies_are_refused_before_any_instance(cluster):
    server, [p], [d], _ = cluster(1, 1)
    r = server.client.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = server.client.post("/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = server.client.post("/v1/completions", content=b"x" * (8 * 1024 * 1024 + 1))
    assert r.status_code == 413
    # The server's limits, at the router too: a body nested 10,000 deep, one that is not UTF-8.
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"):
        r = server.client.post(path, content=b"[" * 10_000 + b"]" * 10_000)
        assert r.status_code == 400 and "deeper than 64" in r.json()["error"]["message"], (path, r.text)
        r = server.client.post(path, content=b'{"prompt": "\xff"}')
        assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"], (path, r.text)
    assert p.bodies == [] and d.bodies == []


def test_other_routes_go_to_a_decode_instance(cluster):
    server, [p], [d0, d1], _ = cluster(1, 2)
    d0.stop()  # refused: retried on d1
    r = server.client.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["served_by"] == "d1"
    r = server.client.post("/tokenize", json={"prompt": "hello"})
    assert r.json() == {"tokens": [1, 2, 3], "got": {"prompt": "hello"}, "served_by": "d1"}


# --- policies, bodies, parsing, configuration on their own ---------------------------------------------
def _instances(*in_flight: int) -> list[Upstream]:
    return [Upstream(f"http://10.0.0.{i}:8000", DECODE, in_flight=n) for i, n in enumerate(in_flight)]


def test_round_robin_policy_cycles():
    instances = _instances(0, 0, 0)
    policy = RoundRobinPolicy()
    assert [policy.choose(instances, {}) for _ in range(6)] == instances * 2


def test_least_load_policy_tie_breaks():
    a, b, c = _instances(2, 1, 1)
    policy = LeastLoadPolicy()
    assert policy.choose([a, b], {}) is b
    b.load, c.load = InstanceLoad(5, 0.1), InstanceLoad(1, 0.9)
    assert policy.choose([a, b, c], {}) is c  # same in-flight: the smaller reported load
    b.load = InstanceLoad(1, 0.2)
    assert policy.choose([a, b, c], {}) is b  # same requests: the lower KV-cache use
    b.load = c.load = None
    assert {policy.choose([b, c], {}).url for _ in range(4)} == {b.url, c.url}  # unknown: round robin


def test_prefix_aware_policy_is_rendezvous_hashing():
    instances = _instances(0, 0, 0)
    policy = PrefixAwarePolicy()
    prompts = [{"prompt": f"document {i} " * 10} for i in range(300)]
    before = {i: policy.choose(instances, p) for i, p in enumerate(prompts)}
    assert all(policy.choose(instances, p) is before[i] for i, p in enumerate(prompts))
    assert {inst.url for inst in before.values()} == {inst.url for inst in instances}
    removed = instances[1]
    after = {i: policy.choose([instances[0], instances[2]], p) for i, p in enumerate(prompts)}
    moved = [i for i in before if before[i] is not after[i]]
    assert moved and all(before[i] is removed for i in moved)  # only the removed instance's share moves
    home = before[0]
    home.in_flight = 3
    assert policy.choose(instances, prompts[0]) is not home  # 3 > 2 x max(0, 1): skewed
    home.in_flight = 2
    assert policy.choose(instances, prompts[0]) is home


def test_prompt_prefix_kinds():
    assert prompt_prefix({"prompt": "x" * 1000}) == "x" * 512
    assert prompt_prefix({"prompt": [1, 2, 3]}) == "[1,2,3]"
    assert prompt_prefix({"messages": [{"role": "user", "content": "hi"}]}) == '[{"role":"user","content":"hi"}]'
    assert prompt_prefix({}) == ""


def test_request_bodies():
    body = {
        "prompt": "p",
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 2,
        "max_completion_tokens": 9,
        "n": 3,
    }
    assert prefill_request_body(body) == {
        "prompt": "p",
        "max_tokens": 1,
        "min_tokens": 1,
        "stream": False,
        "n": 3,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["stream"] is True  # the client's body is not changed
    assert decode_request_body(body, {"remote_request_id": "r"}) == {
        **body,
        "kv_transfer_params": {"remote_request_id": "r", "do_remote_prefill": True},
    }


def test_parse_instance_load():
    text = (
        'splitserve:num_requests_running{model_name="m"} 3.0\n'
        'splitserve:num_requests_waiting{model_name="m"} 4.0\n'
        'splitserve:kv_cache_usage_perc{model_name="m"} 0.5\n'
        'splitserve:kv_cache_usage_perc{model_name="n"} 0.25\n'
    )
    assert parse_instance_load(text) == InstanceLoad(7.0, 0.75)
    assert parse_instance_load(text.replace("splitserve:", "vllm:")) == InstanceLoad(7.0, 0.75)  # --metrics-prefix
    assert parse_instance_load("other_metric 1.0\n") is None
    assert parse_instance_load("not { prometheus") is None


def test_config_checks_and_cli():
    with pytest.raises(ValueError, match="--decode"):
        RouterConfig(["http://a:1"], [])
    with pytest.raises(ValueError, match="base URL"):
        RouterConfig(["a:1"], ["http://b:2"])
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(["http://a:1"], ["http://b:2"], policy="random")
    ns = build_parser().parse_args(
        [
            "router",
            "--prefill",
            "http://p:1/",
            "--prefill",
            "http://p:2",
            "--decode",
            "http://d:1",
            "--policy",
            "prefix_aware",
            "--max-retries",
            "1",
            "--instance-api-key",
            "k",
        ]
    )
    config = config_from_args(ns)
    assert config.prefill_urls == ["http://p:1", "http://p:2"] and config.decode_urls == ["http://d:1"]
    assert (config.policy, config.max_retries, config.instance_api_key) == ("prefix_aware", 1, "k")
    assert (ns.host, ns.port, config.health_interval, config.request_timeout) == ("0.0.0.0", 9000, 2.0, 3600.0)


# --- NODE_PORTS order: each instance's own role --------------------------------------------------------
def test_instances_in_the_wrong_role_are_refused_at_start(fake_loop):
    """Ports swapped in NODE_PORTS (or --prefill/--decode): the router asks each instance its role
    at start-up and refuses to start, naming the rule."""
    from splitserve.entrypoints.router.pool import UpstreamPool

    log: list = []
    p, d = FakeInstance(fake_loop, PREFILL, "p", log), FakeInstance(fake_loop, DECODE, "d", log)
    p.pd_role, d.pd_role = "prefill", "decode"
    try:
        pool = UpstreamPool(RouterConfig([d.url], [p.url]))  # swapped
        with pytest.raises(RuntimeError, match="Rule NODE_PORTS order") as info:
            asyncio.run(pool.start())
        assert "answers as a decode instance but is listed among the prefill instances" in str(info.value)
        pool = UpstreamPool(RouterConfig([p.url], [d.url]))

        async def start_and_stop():
            await pool.start()  # the right order starts
            await pool.stop()

        asyncio.run(start_and_stop())
    finally:
        p.stop()
        d.stop()


def test_an_instance_that_changes_role_is_marked_down_and_requests_do_not_hang(cluster):
    server, [p], [d], _ = cluster(1, 1, health_interval=0.2)
    d.pd_role = "prefill"  # say a decode port now leads to a prefill instance
    wait_for(lambda: not server.router.instances[DECODE][0].healthy, what="the role check")
    assert "Rule NODE_PORTS order" in server.router.instances[DECODE][0].down_reason
    start = time.monotonic()
    r = server.client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 503 and time.monotonic() - start < 5  # never sent to the wrong-role instance
    assert "NODE_PORTS order" in r.json()["error"]["message"]
