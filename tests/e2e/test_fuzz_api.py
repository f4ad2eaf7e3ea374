"""schemathesis against a real server, from the OpenAPI document the server publishes (each route's
request and response models): no 5xx, no answer that breaks its documented schema, status code or
content type, in positive and negative modes; and most positive cases reach the engine (a 200).
Bounded: a fixed number of examples per operation and a time budget. The PD router publishes the
same document (checked here too)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts a server and fuzzes its API

KEY = "fuzz-key"
FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "1024"]
FLAGS += ["--api-key", KEY, "--disable-log-requests"]
CHECKS = "not_a_server_error,response_schema_conformance,status_code_conformance,content_type_conformance"


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with RemoteServer(tiny_chat_model, *FLAGS) as s:
        yield s


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _fuzz(server, mode: str, tmp_path) -> dict:
    """Run schemathesis; the statuses it got, per operation, from its ndjson event log."""
    events = tmp_path / f"{mode}.ndjson"
    cmd = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json"),
        *("--mode", mode, "--checks", CHECKS, "--max-examples", "10", "--seed", "7", "--max-time", "20"),
        *("-H", f"Authorization: Bearer {KEY}", "--request-timeout", "60", "--no-color"),
        # Routes that change the server's state for every later request (adapters, sleep mode) have
        # tests of their own: fuzzed, a /sleep would leave the rest of the run answering 503.
        *("--exclude-path", "/v1/load_lora_adapter", "--exclude-path", "/v1/unload_lora_adapter"),
        *("--exclude-path", "/sleep", "--exclude-path", "/wake_up", "--exclude-path", "/reset_prefix_cache"),
        *("--report", "ndjson", "--report-ndjson-path", str(events)),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    (tmp_path / f"{mode}.out").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    statuses: dict[str, list[int]] = {}
    for line in events.read_text().splitlines():
        finished = json.loads(line).get("ScenarioFinished")
        if not finished:
            continue
        for interaction in (finished["recorder"].get("interactions") or {}).values():
            response = interaction.get("response") or {}
            if response.get("status_code") is not None:
                statuses.setdefault(finished["recorder"]["label"], []).append(response["status_code"])
    return statuses


def test_published_schema_has_the_request_and_response_models(server):
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    assert "prompt" in schema["components"]["schemas"]["CompletionRequest"]["properties"]
    answers = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert answers["200"]["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionResponse")
    assert answers["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_failure(server, mode, tmp_path):
    before = _metric(server.url, "splitserve:request_success_total")
    statuses = _fuzz(server, mode, tmp_path)
    every = [s for codes in statuses.values() for s in codes]
    assert every and not [s for s in every if s >= 500], statuses
    generated = sum(len(v) for k, v in statuses.items() if "completions" in k or "generate" in k)
    print(f"schemathesis {mode}: {len(every)} requests over {len(statuses)} operations: {statuses}")
    if mode == "positive":
        ok = sum(1 for k, v in statuses.items() for s in v if s == 200 and ("completions" in k or "generate" in k))
        assert ok > generated / 2, statuses  # most schema-valid generation requests reach the engine
        assert _metric(server.url, "splitserve:request_success_total") > before
