"""The signals a gateway picks an instance by (docs/gateway.md), through HTTP: the ORCA
`endpoint-load-metrics` header in both of vLLM's formats, SGLang's /v1/loads agreeing with
/metrics, llama.cpp's per-request `timings` (streamed and not), the metrics the Gateway API
Inference Extension's endpoint picker reads under vLLM's names and labels, and the same signals at
a router in front of the server. One server (two API workers, a LoRA adapter) and one router."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.helpers.models import make_peft_adapter
from tests.helpers.server import RemoteServer, metric

pytestmark = pytest.mark.slow  # starts a server and a router

BLOCKS = 128
COMMON = ["--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", str(BLOCKS)]
PROMPT = "The capital of France is"
TEXT_HEADER = re.compile(
    r"^TEXT named_metrics\.num_requests_waiting=(\d+\.\d+), named_metrics\.kv_cache_usage_perc=(\d+(\.\d+)?(e-?\d+)?)$"
)


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    adapter = make_peft_adapter(tiny_chat_model, str(tmp_path_factory.mktemp("gw_lora") / "sql"), ["q_proj"], r=4)
    lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"sql={adapter}"]
    flags = [*COMMON, *lora, "--workers", "2", "--metrics-prefix", "vllm", "--disable-log-requests"]
    with RemoteServer(tiny_chat_model, *flags) as s:
        yield s


@pytest.fixture(scope="module")
def router(server):
    with RemoteServer(None, "router", "--mixed", server.url, "--health-interval", "0.5") as r:
        yield r


def _post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    response = httpx.post(f"{url}{path}", json=body, headers=headers or {}, timeout=60)
    assert response.status_code == 200, response.text
    return response


def _events(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[httpx.Headers, list[dict]]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return r.headers, events


def _wait_idle(url: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if metric(url, "vllm:num_requests_running") == 0 and metric(url, "vllm:num_requests_waiting") == 0:
            return
        time.sleep(0.2)
    raise AssertionError("the server did not become idle")


def test_orca_header_in_vllm_formats(server, router):
    completion = {"model": "default", "prompt": PROMPT, "max_tokens": 4}
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    for url in (server.url, router.url):
        text = _post(url, "/v1/completions", completion, {"endpoint-load-metrics-format": "text"})
        match = TEXT_HEADER.match(text.headers["endpoint-load-metrics"])
        assert match, text.headers["endpoint-load-metrics"]
        assert float(match[1]) >= 0 and 0 <= float(match[2]) <= 1
        answer = _post(url, "/v1/chat/completions", chat, {"endpoint-load-metrics-format": "JSON"})
        kind, _, payload = answer.headers["endpoint-load-metrics"].partition(" ")
        named = json.loads(payload)["named_metrics"]
        assert kind == "JSON" and list(named) == ["num_requests_waiting", "kv_cache_usage_perc"]
        assert all(isinstance(v, float) for v in named.values())
        headers, _ = _events(url, "/v1/completions", completion, {"endpoint-load-metrics-format": "text"})
        assert TEXT_HEADER.match(headers["endpoint-load-metrics"])  # streamed: the load as the stream starts
        assert "endpoint-load-metrics" not in _post(url, "/v1/completions", completion).headers
        unknown = _post(url, "/v1/completions", completion, {"endpoint-load-metrics-format": "bin"})
        assert "endpoint-load-metrics" not in unknown.headers  # as vLLM: no header for a format it lacks


def test_loads_agree_with_metrics(server):
    for _ in range(2):  # the second finds the first's prompt in the prefix cache
        _post(server.url, "/v1/completions", {"prompt": PROMPT * 8, "max_tokens": 48, "ignore_eos": True})
    _wait_idle(server.url)
    time.sleep(1.2)  # the stats after the last step reach both workers (every 0.5 s when idle)
    body = httpx.get(f"{server.url}/v1/loads", timeout=10).json()
    assert body["dp_rank_count"] == 1 and body["version"] and body["timestamp"]
    (load,) = body["loads"]
    assert load["num_running_reqs"] == metric(server, "vllm:num_requests_running") == 0
    assert load["num_waiting_reqs"] == metric(server, "vllm:num_requests_waiting") == 0
    assert load["token_usage"] == pytest.approx(metric(server, "vllm:kv_cache_usage_perc"), abs=1e-4)
    hits, queries = metric(server, "vllm:prefix_cache_hits_total"), metric(server, "vllm:prefix_cache_queries_total")
    assert hits > 0 and load["cache_hit_rate"] == pytest.approx(hits / queries, abs=1e-4)
    assert load["max_total_num_tokens"] == BLOCKS * 16 and load["max_running_requests"] == 256
    assert load["gen_throughput"] > 0  # the last seconds' decode
    assert load["lora"]["slots_total"] == 2 and load["lora"]["running_lora_adapters"] == {}
    assert load["disaggregation"] == {"mode": "null"}
    assert body["aggregate"]["total_reqs"] == 0 and body["aggregate"]["avg_throughput"] == load["gen_throughput"]
    core = httpx.get(f"{server.url}/v1/loads", params={"include": "core"}, timeout=10).json()["loads"][0]
    assert "lora" not in core and "disaggregation" not in core and core["num_total_reqs"] == 0
    for params in ({"include": "nonsense"}, {"dp_rank": "1"}, {"format": "prometheus"}):
        assert httpx.get(f"{server.url}/v1/loads", params=params, timeout=10).status_code == 400


def _check_timings(timings: dict, usage: dict) -> None:
    assert timings["predicted_n"] == usage["completion_tokens"]
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0 and timings["queue_ms"] >= 0
    assert timings["ttft_ms"] <= timings["total_ms"]
    assert timings["queue_ms"] + timings["prompt_ms"] == pytest.approx(timings["ttft_ms"], abs=1e-6)
    assert timings["ttft_ms"] + timings["predicted_ms"] == pytest.approx(timings["total_ms"], abs=1e-6)
    assert timings["predicted_per_second"] == pytest.approx(1e3 * timings["predicted_n"] / timings["predicted_ms"])
    assert timings["prompt_per_token_ms"] == pytest.approx(timings["prompt_ms"] / timings["prompt_n"])


def test_timings_when_asked(server):
    completion = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "ignore_eos": True}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        answer = _post(server.url, path, {**body, "return_timings": True}).json()
        _check_timings(answer["timings"], answer["usage"])
        assert "timings" not in _post(server.url, path, body).json()
        llama = _post(server.url, path, {**body, "timings_per_token": True}).json()  # llama.cpp's field
        _check_timings(llama["timings"], llama["usage"])
        # Streamed: in the last chunk only (the usage chunk when one is asked for).
        _, events = _events(
            server.url, path, {**body, "return_timings": True, "stream_options": {"include_usage": True}}
        )
        assert "timings" in events[-1] and not any("timings" in e for e in events[:-1])
        _check_timings(events[-1]["timings"], events[-1]["usage"])
        _, events = _events(server.url, path, {**body, "return_timings": True})
        assert "timings" in events[-1] and not any("timings" in e for e in events[:-1])
        assert events[-1]["timings"]["predicted_n"] == 12


def test_endpoint_picker_metrics_under_vllm_names(server):
    # A long LoRA request: while it runs, vllm:lora_requests_info names its adapter as running.
    _post(server.url, "/v1/completions", {"model": "sql", "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "gpu_cache_usage_perc"):
        assert re.search(rf'^vllm:{name}{{model_name="[^"]+"}} ', text, re.M), name
    info = re.search(r"^vllm:cache_config_info\{(.*)\} 1\.0$", text, re.M)
    assert info and 'block_size="16"' in info[1] and f'num_gpu_blocks="{BLOCKS}"' in info[1]
    lora = re.findall(r"^vllm:lora_requests_info\{(.*)\} (\S+)$", text, re.M)
    assert lora and all('max_lora="2"' in labels for labels, _ in lora)
    newest = max(float(value) for _, value in lora)
    assert abs(newest - time.time()) < 60  # the value is when it was set: the picker reads the newest
    assert any('running_lora_adapters="sql"' in labels for labels, _ in lora)
    assert "model_name=" not in lora[0][0]  # as vLLM's: no model_name label


def test_router_loads_per_instance(server, router):
    _wait_idle(server.url)
    body = httpx.get(f"{router.url}/v1/loads", timeout=10).json()
    (instance,) = body["instances"]
    assert instance["url"] == server.url and instance["role"] == "mixed" and instance["healthy"]
    assert instance["aggregate"]["total_reqs"] == 0
    (load,) = body["loads"]
    assert load["instance"] == server.url and load["max_total_num_tokens"] == BLOCKS * 16
    assert body["aggregate"]["total_reqs"] == 0 and body["dp_rank_count"] == 1
    core = httpx.get(f"{router.url}/v1/loads", params={"include": "core"}, timeout=10).json()
    assert "lora" not in core["loads"][0]  # the query reaches the instances
