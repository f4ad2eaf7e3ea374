"""`splitserve serve --data-parallel-size 2` (with two API workers): two engine replicas, one core
each, behind one port; greedy answers equal the offline engine's, both replicas compute, /metrics
adds their stats up, sleep mode reaches both, and a replica that dies is restarted by itself."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

from splitserve.process_utils import free_port
from tests.helpers.server import RemoteServer, comm, metric

pytestmark = pytest.mark.slow  # starts a server with two engine processes

PROMPTS = [f"Count with me: {i}, {i + 1}," for i in range(8)]


def _engines(server: RemoteServer) -> list[int]:
    return sorted(p for p in server.child_pids() if comm(p) == "splitserve-eng")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _complete(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_replicas_behind_one_server(tiny_chat_model):
    from splitserve import LLM, SamplingParams

    llm = LLM(tiny_chat_model, dtype="float32", max_model_len=256, use_tqdm_on_load=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.llm_engine.shutdown()

    flags = ("--data-parallel-size", "2", "--api-server-count", "2", "--dtype", "float32", "--max-model-len", "256")
    port = free_port()
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"})
    with RemoteServer(tiny_chat_model, *flags, "--kv-events-config", events, "--disable-log-requests") as server:
        # Each replica publishes its KV events on its own port (the endpoint's + its rank), both reported.
        endpoints = httpx.get(f"{server.url}/pd_role", timeout=30).json()["kv_events_endpoint"]
        assert endpoints == [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
        engines = _engines(server)
        assert len(engines) == 2
        before = [_cpu_seconds(p) for p in engines]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: _complete(server.url, p), PROMPTS * 2))
        assert answers == expected * 2
        used = [_cpu_seconds(p) - b for p, b in zip(engines, before)]
        assert min(used) > 0.05, used  # both replicas computed
        assert metric(server, "splitserve:generation_tokens_total") == 24 * 16

        # Sleep mode reaches every replica: asleep, requests are refused; awake, answers are as before.
        assert httpx.post(f"{server.url}/sleep", params={"level": 1}, timeout=60).status_code == 200
        assert httpx.get(f"{server.url}/is_sleeping", timeout=60).json()["is_sleeping"] is True
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            body = {"prompt": "Hi", "max_tokens": 2}
            refused = list(
                pool.map(lambda _: httpx.post(f"{server.url}/v1/completions", json=body, timeout=60), range(4))
            )
        assert {r.status_code for r in refused} == {503}
        assert httpx.post(f"{server.url}/wake_up", timeout=60).json()["is_sleeping"] is False
        assert [_complete(server.url, p) for p in PROMPTS[:2]] == expected[:2]

        # One replica dies: its supervisor starts it again; the other serves meanwhile.
        os.kill(engines[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while metric(server, "splitserve:engine_restarts_total") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert len(_engines(server)) == 2
        assert [_complete(server.url, p) for p in PROMPTS[:4]] == expected[:4]
