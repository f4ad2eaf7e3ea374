"""The load signals' pieces on their own (docs/gateway.md; tests/e2e/test_load_signals.py runs them
through a server): the ORCA header's formats and its middleware, SGLang's /v1/loads entries and
aggregate, the decode rate, the gateway metrics' labels, the engine's LoRA counts, the router's
pool load and bench serve's --header (llama.cpp's timings: test_request_timings.py)."""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from splitserve.benchmarks.serve_client import parse_header, request_headers
from splitserve.config import CacheConfig, LoRAConfig
from splitserve.disagg.policies import InstanceLoad, Upstream, parse_instance_load
from splitserve.engine.dp_async_llm import merge_stats
from splitserve.engine.lora_registry import _by_adapter
from splitserve.engine.messages import SchedulerStats, SpecDecodingStats
from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.gateway_metrics import cache_config_labels, lora_labels
from splitserve.entrypoints.openai.loads import (
    DecodeRates,
    aggregate,
    check_dp_rank,
    parse_include,
    replica_load,
)
from splitserve.entrypoints.orca import OrcaLoadMiddleware, named_load_metrics, orca_header_value
from splitserve.entrypoints.router.loads import pool_load


def _stats(**fields) -> SchedulerStats:
    base = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=0)
    base.update(prefix_cache_queries=0, prefix_cache_hits=0)
    base.update(fields)
    return SchedulerStats(**base)


def _config(max_num_seqs: int = 256, max_loras: int | None = None):
    """The parts of an EngineConfig the load report reads."""
    return SimpleNamespace(
        cache_config=CacheConfig(num_gpu_blocks=100),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        lora_config=None if max_loras is None else LoRAConfig(max_loras=max_loras),
    )


# --- ORCA ----------------------------------------------------------------------------------------
def test_orca_header_formats_are_vllms():
    named = named_load_metrics(3, 0.4)
    assert orca_header_value("text", named) == (
        "TEXT named_metrics.num_requests_waiting=3.0, named_metrics.kv_cache_usage_perc=0.4"
    )
    assert orca_header_value("TEXT", named_load_metrics(0, 0)).endswith("kv_cache_usage_perc=0.0")
    value = orca_header_value("Json", named)
    assert value == 'JSON {"named_metrics": {"num_requests_waiting": 3.0, "kv_cache_usage_perc": 0.4}}'
    assert json.loads(value[5:]) == {"named_metrics": {"num_requests_waiting": 3.0, "kv_cache_usage_perc": 0.4}}
    assert orca_header_value("bin", named) is None and orca_header_value("", named) is None


def test_orca_middleware_adds_the_header_only_when_asked():
    app = FastAPI()
    load = {"waiting": 0}

    @app.post("/v1/completions")
    async def completions():
        load["waiting"] = 5  # the load when the answer starts, not when the request came
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat():
        return StreamingResponse(iter([b"data: 1\n\n", b"data: [DONE]\n\n"]), media_type="text/event-stream")

    @app.post("/tokenize")
    async def tokenize():
        return {"tokens": []}

    paths = ("/v1/completions", "/v1/chat/completions")
    app.add_middleware(OrcaLoadMiddleware, load=lambda: named_load_metrics(load["waiting"], 0.25), paths=paths)
    client = TestClient(app)
    ask = {"endpoint-load-metrics-format": "text"}
    answer = client.post("/v1/completions", headers=ask)
    assert answer.headers["endpoint-load-metrics"].startswith("TEXT named_metrics.num_requests_waiting=5.0, ")
    assert "endpoint-load-metrics" not in client.post("/v1/completions").headers
    streamed = client.post("/v1/chat/completions", headers={"endpoint-load-metrics-format": "json"})
    assert streamed.headers["endpoint-load-metrics"].startswith("JSON {") and streamed.text.endswith("[DONE]\n\n")
    assert "endpoint-load-metrics" not in client.post("/tokenize", headers=ask).headers
    assert "endpoint-load-metrics" not in client.post("/v1/completions", headers={ORCA_FORMAT: "xml"}).headers


ORCA_FORMAT = "endpoint-load-metrics-format"


# --- /v1/loads -------------------------------------------------------------------------------------
def test_replica_load_has_sglangs_fields():
    config = _config(max_num_seqs=8)
    stats = _stats(num_running=2, num_waiting=3, kv_cache_usage=0.5, prefix_cache_queries=200, prefix_cache_hits=50)
    load = replica_load(stats, 0, config, "mixed", 12.345, parse_include(None))
    assert load["num_running_reqs"] == 2 and load["num_waiting_reqs"] == 3 and load["num_total_reqs"] == 5
    capacity = 100 * config.cache_config.block_size
    assert load["max_total_num_tokens"] == capacity and load["num_used_tokens"] == capacity // 2
    assert load["token_usage"] == 0.5 and load["cache_hit_rate"] == 0.25 and load["gen_throughput"] == 12.35
    assert load["utilization"] == round(0.5 / 0.9, 4) and load["max_running_requests"] == 8
    assert load["disaggregation"] == {"mode": "null"} and "lora" not in load and "speculative" not in load
    assert replica_load(stats, 0, config, "prefill", 0.0, {"core"})["utilization"] == -1
    assert list(replica_load(None, 1, config, "decode", 0.0, {"core"}))[:3] == [
        "dp_rank",
        "num_running_reqs",
        "num_waiting_reqs",
    ]


def test_replica_load_sections():
    config = _config(max_loras=4)
    spec = SpecDecodingStats(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=15)
    stats = _stats(num_running=3, running_loras={"a": 2, "b": 1}, waiting_loras={"c": 1}, spec_decoding=spec)
    load = replica_load(stats, 0, config, "mixed", 0.0, parse_include("all"))
    assert load["lora"] == {
        "slots_used": 2,
        "slots_total": 4,
        "utilization": 0.5,
        "running_lora_adapters": {"a": 2, "b": 1},
        "waiting_lora_adapters": {"c": 1},
    }
    assert load["speculative"] == {"accept_length": 2.5, "accept_rate": 0.5}
    only_core = replica_load(stats, 0, config, "mixed", 0.0, parse_include("core"))
    assert "lora" not in only_core and "speculative" not in only_core and "disaggregation" not in only_core
    assert parse_include("lora, memory") == {"core", "lora", "memory"}
    with pytest.raises(APIError, match="Invalid include sections"):
        parse_include("core,nope")


def test_aggregate_and_dp_rank():
    loads = [
        {"num_running_reqs": 1, "num_waiting_reqs": 2, "num_used_tokens": 10, "token_usage": 0.2},
        {"num_running_reqs": 3, "num_waiting_reqs": 0, "num_used_tokens": 30, "token_usage": 0.4},
    ]
    for load, rate in zip(loads, (10.0, 20.0)):
        load.update(gen_throughput=rate, utilization=load["token_usage"] / 0.9)
    total = aggregate(loads)
    assert total["total_running_reqs"] == 4 and total["total_waiting_reqs"] == 2 and total["total_reqs"] == 6
    assert total["total_used_tokens"] == 40 and total["avg_token_usage"] == 0.3 and total["avg_throughput"] == 15.0
    assert aggregate([])["total_reqs"] == 0
    assert check_dp_rank(None, 2) is None and check_dp_rank("1", 2) == 1
    for bad in ("2", "-1", "x"):
        with pytest.raises(APIError):
            check_dp_rank(bad, 2)


def test_decode_rates(monkeypatch):
    clock = {"now": 100.0}
    monkeypatch.setattr(time, "monotonic", lambda: clock["now"])
    rates = DecodeRates()
    assert rates.rate(0) == 0.0
    for second in range(12):
        clock["now"] = 100.0 + second
        rates.observe([_stats(taken_at=1000.0 + second, generation_tokens=50 * second), None])
    assert rates.rate(0) == pytest.approx(50.0) and rates.rate(1) == 0.0 and rates.rate(5) == 0.0
    clock["now"] += 0.1  # sampled at most every half second
    rates.observe([_stats(taken_at=2000.0, generation_tokens=0)])
    assert rates.rate(0) == pytest.approx(50.0)
    for second in range(1, 8):  # idle: the rate falls to 0 as the window moves on
        clock["now"] += 1
        rates.observe([_stats(taken_at=1011.0 + second, generation_tokens=550)])
    assert rates.rate(0) == 0.0


# --- metrics and the engine's counts ---------------------------------------------------------------
def test_gateway_metric_labels():
    labels = cache_config_labels(_config(), engine=1)
    assert labels["block_size"] == "16" and labels["num_gpu_blocks"] == "100" and labels["engine"] == "1"
    stats = _stats(running_loras={"b": 2, "a": 1}, waiting_loras={"c": 3})
    assert lora_labels(stats, 4) == {"max_lora": "4", "waiting_lora_adapters": "c", "running_lora_adapters": "a,b"}
    assert lora_labels(_stats(), 4)["running_lora_adapters"] == ""


def test_lora_counts_and_their_merge():
    def request(name):
        return SimpleNamespace(lora_request=None if name is None else SimpleNamespace(lora_name=name))

    assert _by_adapter([request("a"), request(None), request("a"), request("b")]) == {"a": 2, "b": 1}
    one = _stats(generation_tokens=5, running_loras={"a": 1}, waiting_loras={})
    two = _stats(generation_tokens=7, running_loras={"a": 2, "b": 1}, waiting_loras={"c": 1})
    merged = merge_stats([one, two])
    assert merged.generation_tokens == 12 and merged.running_loras == {"a": 3, "b": 1}
    assert merged.waiting_loras == {"c": 1} and merge_stats([_stats(), _stats()]).running_loras is None


# --- the router --------------------------------------------------------------------------------------
def test_router_pool_load():
    text = 'vllm:num_requests_running{model_name="m"} 3.0\nvllm:num_requests_waiting{model_name="m"} 4.0\n'
    assert parse_instance_load(text).waiting == 4.0 and parse_instance_load(text) == InstanceLoad(7.0, 0.0)
    prefill = Upstream("http://p", "prefill", load=InstanceLoad(2, 0.9, waiting=2))
    decode = [
        Upstream(f"http://d{i}", "decode", load=InstanceLoad(3, usage, waiting=1)) for i, usage in enumerate((0.2, 0.4))
    ]
    down = Upstream("http://d9", "decode", healthy=False, load=InstanceLoad(9, 1.0, waiting=9))
    unknown = Upstream("http://d8", "decode")
    pool = SimpleNamespace(answer_role="decode", all_instances=lambda: [prefill, *decode, down, unknown])
    # waiting over the pool, KV over the up decode instances
    assert pool_load(pool) == named_load_metrics(4, (0.2 + 0.4) / 2)
    assert pool_load(SimpleNamespace(answer_role="mixed", all_instances=lambda: [])) == named_load_metrics(0, 0)


def test_bench_serve_header():
    assert parse_header("endpoint-load-metrics-format=text") == ("endpoint-load-metrics-format", "text")
    assert parse_header("x-a = b=c ") == ("x-a", "b=c")
    for bad in ("novalue", "=v"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_header(bad)
    ns = argparse.Namespace(api_key="k", header=[("x-a", "1")])
    assert request_headers(ns) == {"Authorization": "Bearer k", "x-a": "1"}
