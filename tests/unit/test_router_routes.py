"""The router's routes beyond completions and chat, against fake instances (test_router.py's): sleep
mode and weight updates broadcast to every instance, OpenAI's Responses API and Batch API served at
the router over its own prefill/decode flow."""
# ruff: noqa: F811 - the fixtures imported from test_router.py are the tests' arguments

from __future__ import annotations

import json
import time

from aiohttp import web

from splitserve.entrypoints.router.config import DECODE, PREFILL
from tests.unit.test_router import FakeInstance, cluster, dead_url, fake_loop  # noqa: F401 - fixtures

CHAT_CHUNKS = [
    {"delta": {"role": "assistant", "content": ""}},
    {"delta": {"content": "Hel"}},
    {"delta": {"content": "lo"}, "finish_reason": "stop"},
]


class ChatFake(FakeInstance):
    """A fake instance with chat answers (decode) and the control routes: sleep mode, weight updates.
    `control_error` = (status, message) makes them refuse."""

    def __init__(self, *args, **kwargs) -> None:
        self.level = 0
        self.control_error: tuple[int, str] | None = None
        self.control_calls: list[tuple[str, str, bytes]] = []
        super().__init__(*args, **kwargs)

    def extra_routes(self) -> list:
        return [
            web.post("/sleep", self.control),
            web.post("/wake_up", self.control),
            web.get("/is_sleeping", self.control),
            web.post("/reset_prefix_cache", self.control),
            web.post("/update_weights", self.control),
            web.post("/update_weights_from_disk", self.control),
        ]

    async def control(self, request: web.Request) -> web.Response:
        self.control_calls.append((request.path, request.query_string, await request.read()))
        if self.control_error is not None:
            status, message = self.control_error
            error = {"message": message, "type": "invalid_request_error", "param": "level", "code": status}
            return web.json_response({"error": error}, status=status)
        if request.path == "/sleep":
            self.level = int(request.query.get("level", "1"))
        elif request.path == "/wake_up":
            self.level = 0
        elif request.path.startswith("/update_weights"):
            path = (await request.json())["model_path"]
            return web.json_response({"success": True, "message": f"Weights loaded from {path}.", "model_path": path})
        return web.json_response({"is_sleeping": self.level > 0, "level": self.level})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if request.path != "/v1/chat/completions" or self.role == PREFILL or self.mode != "ok":
            return await super().generate(request)
        body = await request.json()
        self.bodies.append((request.path, body))
        self.log.append((self.role, self.name))
        base = {"id": "chatcmpl-1", "model": "fake", "created": 0}
        if not body.get("stream"):
            message = {"role": "assistant", "content": f"Hello from {self.name}"}
            usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            return self._json({**base, "object": "chat.completion", "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in CHAT_CHUNKS:
            event = {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, **chunk}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        await resp.write(f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def chat_cluster(cluster, n_prefill: int = 1, n_decode: int = 1, **config):
    return cluster(n_prefill, n_decode, fake=ChatFake, **config)


# --- sleep mode and weight updates -----------------------------------------------------------------
def test_sleep_wake_up_and_is_sleeping_act_on_every_instance(cluster):
    server, [p], [d], _ = chat_cluster(cluster)
    r = server.client.post("/sleep", params={"level": "2"})
    assert r.status_code == 200, r.text
    assert r.json() == {"is_sleeping": True, "level": 2}
    assert [(c[0], c[1]) for c in p.control_calls + d.control_calls] == [("/sleep", "level=2")] * 2
    r = server.client.get("/is_sleeping")
    assert r.json()["is_sleeping"] is True and r.json()["level"] == 2
    assert {(i["url"], i["role"]) for i in r.json()["instances"]} == {(p.url, PREFILL), (d.url, DECODE)}
    p.level = 0  # one instance awake: the deployment is not asleep
    assert server.client.get("/is_sleeping").json()["is_sleeping"] is False
    r = server.client.post("/wake_up")
    assert r.status_code == 200 and r.json() == {"is_sleeping": False, "level": 0}
    assert p.level == d.level == 0
    assert server.client.post("/reset_prefix_cache").status_code == 200


def test_a_refusal_or_an_unreachable_instance_is_named(cluster):
    server, [p], [d], _ = chat_cluster(cluster)
    d.control_error = (400, "Cannot sleep: 2 requests are running.")
    r = server.client.post("/sleep")
    assert r.status_code == 400
    error = r.json()["error"]
    assert d.url in error["message"] and "2 requests are running" in error["message"]
    assert f"took effect on {p.url}" in error["message"] and error["param"] == "level"
    server2, _, _, _ = chat_cluster(cluster, prefill_urls=[dead_url()])
    r = server2.client.post("/wake_up")
    assert r.status_code == 503 and "could not be reached" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "service_unavailable"


def test_update_weights_reaches_every_instance(cluster):
    server, [p], [d], _ = chat_cluster(cluster)
    for path in ("/update_weights", "/update_weights_from_disk"):
        r = server.client.post(path, json={"model_path": "/ckpt/step-2"})
        assert r.status_code == 200, r.text
        assert r.json()["model_path"] == "/ckpt/step-2"
    assert [json.loads(c[2]) for c in p.control_calls] == [{"model_path": "/ckpt/step-2"}] * 2
    assert len(d.control_calls) == 2
    r = server.client.post("/update_weights", content=b"[1, 2")
    assert r.status_code == 400 and len(p.control_calls) == 2  # refused before any instance


def test_a_broadcast_route_the_instance_lacks_is_named(cluster):
    server, _, [d], _ = cluster(1, 1)  # plain fakes: no /v1/load_lora_adapter
    r = server.client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
    assert r.status_code == 404 and "instance http://127.0.0.1" in r.json()["error"]["message"]


# --- /v1/responses -----------------------------------------------------------------------------------
def test_responses_through_prefill_and_decode_stored_and_continued(cluster):
    server, [p], [d], log = chat_cluster(cluster)
    r = server.client.post("/v1/responses", json={"input": "Hi", "instructions": "Be brief."})
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["status"] == "completed" and first["model"] == "fake"  # the served name, from /v1/models
    assert first["output"][0]["content"][0]["text"] == "Hello from d0"
    assert log == [(PREFILL, "p0"), (DECODE, "d0")]
    assert server.client.get(f"/v1/responses/{first['id']}").json()["id"] == first["id"]
    r = server.client.post("/v1/responses", json={"input": "Again", "previous_response_id": first["id"]})
    assert r.status_code == 200
    messages = d.bodies[-1][1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "Hello from d0"
    assert server.client.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
    r = server.client.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_responses_streamed(cluster):
    server, _, [d], _ = chat_cluster(cluster)
    r = server.client.post("/v1/responses", json={"input": "Hi", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e.split("data: ", 1)[1]) for e in r.text.split("\n\n") if e]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello"
    assert events[-1]["response"]["usage"]["output_tokens"] == 2
    assert all(i.in_flight == 0 for i in server.router.all_instances())


def test_responses_in_the_background(cluster):
    server, _, _, _ = chat_cluster(cluster)
    r = server.client.post("/v1/responses", json={"input": "Hi", "background": True})
    assert r.status_code == 200 and r.json()["status"] == "in_progress"
    response_id = r.json()["id"]
    deadline = time.monotonic() + 5
    while server.client.get(f"/v1/responses/{response_id}").json()["status"] == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    done = server.client.get(f"/v1/responses/{response_id}").json()
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hello from d0"


def test_responses_refused_under_the_native_api(cluster):
    server, _, _, _ = chat_cluster(cluster, openai_api=False)
    r = server.client.post("/v1/responses", json={"input": "Hi"})
    assert r.status_code == 404 and "USE_OPENAI" in r.json()["error"]["message"]


# --- /v1/files and /v1/batches ---------------------------------------------------------------------
def test_a_batch_runs_through_prefill_and_decode(cluster):
    server, _, [d], log = chat_cluster(cluster)
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"Q{i}"}]},
        }
        for i in range(3)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    r = server.client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", data)})
    assert r.status_code == 200, r.text
    r = server.client.post(
        "/v1/batches",
        json={"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert r.status_code == 200, r.text
    batch_id = r.json()["id"]
    deadline = time.monotonic() + 5
    while (batch := server.client.get(f"/v1/batches/{batch_id}").json())["status"] != "completed":
        assert time.monotonic() < deadline and batch["status"] in ("validating", "in_progress", "finalizing"), batch
        time.sleep(0.05)
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    output = server.client.get(f"/v1/files/{batch['output_file_id']}/content").text
    results = {json.loads(line)["custom_id"]: json.loads(line) for line in output.splitlines()}
    assert set(results) == {"q0", "q1", "q2"}
    assert results["q1"]["response"]["body"]["choices"][0]["message"]["content"] == "Hello from d0"
    assert sorted(log).count((PREFILL, "p0")) == 3 and sorted(log).count((DECODE, "d0")) == 3
    assert [b["messages"][0]["content"] for _, b in sorted(d.bodies, key=lambda b: b[1]["messages"][0]["content"])] == [
        "Q0",
        "Q1",
        "Q2",
    ]
