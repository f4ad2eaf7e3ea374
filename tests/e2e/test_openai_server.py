"""The OpenAI-compatible server end to end: real server processes on loopback, driven by the
official `openai` client and by raw HTTP for what the client hides (status codes, error bodies)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

from splitserve import LLM, SamplingParams
from tests.helpers.server import RemoteServer, engine_pid, metric, stream_and_kill

pytestmark = pytest.mark.slow  # starts servers

API_KEY = "test-key"
COMMON = [
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--block-size",
    "16",
    "--num-gpu-blocks-override",
    "256",
    "--disable-log-requests",
]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with RemoteServer(tiny_chat_model, *COMMON, "--api-key", API_KEY, "--served-model-name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_chat_model) -> LLM:
    return LLM(tiny_chat_model, dtype="float32", max_model_len=512, use_tqdm_on_load=False)


def _post(server, path: str, body, key: str | None = API_KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=60, **kw)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60, **kw)


# --- completions and chat -------------------------------------------------------------------------
def test_completion_matches_offline_greedy(client, offline):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    expected = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out.choices[0].text == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert out.object == "text_completion" and out.system_fingerprint


def test_model_may_be_default_or_omitted(server):
    for body in ({"model": "default"}, {}):
        r = _post(server, "/v1/completions", {**body, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_streamed_chat_equals_non_streamed(client):
    messages = [{"role": "user", "content": "Hello!"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.choices[0].model_extra["arrival_time"] >= 0 for c in chunks if c.choices)
    # FastDeploy's fields: each delta carries its token ids; usage details the completion tokens.
    streamed_ids = [i for c in chunks if c.choices for i in (c.choices[0].delta.model_extra.get("token_ids") or [])]
    assert len(streamed_ids) == full.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 0
    assert full.choices[0].model_extra["sentence_length"] == len(full.choices[0].message.content)


def test_streamed_completion_with_continuous_usage(client):
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6


def test_n_samples_and_seeds(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert out.usage.completion_tokens == 24


def test_batch_of_prompts(client):
    out = client.completions.create(model="tiny", prompt=[PROMPT, "Hello", "One two"], max_tokens=3, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    out = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]


def test_logprobs(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].logprob == max(t.logprob for t in content[0].top_logprobs)


def test_echo_and_stop(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text.startswith(PROMPT)
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = base[5:8]
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == base[: base.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_vllm_extensions(server):
    body = {
        "prompt": PROMPT,
        "max_tokens": 3,
        "temperature": 0,
        "top_k": -1,
        "min_tokens": 2,
        "ignore_eos": True,
        "repetition_penalty": 1.1,
        "return_token_ids": True,
        "prompt_logprobs": 1,
    }
    choice = _post(server, "/v1/completions", body).json()["choices"][0]
    assert len(choice["token_ids"]) == 3 and choice["prompt_token_ids"]
    assert choice["prompt_logprobs"][0] is None and choice["sentence_length"] == len(choice["text"])  # characters
    assert choice["cum_log_probs"] < 0  # AIAK's: on every choice, without asking for logprobs
    meta = _post(
        server,
        "/v1/completions",
        {
            **body,
            "min_tokens": None,
            "metadata": {"min_tokens": "3"},  # as the OpenAI client sends metadata: strings
            "max_tokens": 5,
            "ignore_eos": False,
            "stop_token_ids": [2],
        },
    )
    assert meta.status_code == 200 and len(meta.json()["choices"][0]["token_ids"]) >= 3


# --- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "use_beam_search": True}, 400, "best_of"),  # a beam width of 1
        ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
        ({"prompt": "x", "n": 129}, 400, "n"),
        ({"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
        ({"prompt": "x", "logit_bias": {"99999999": 1}}, 400, None),
        ({"prompt": "x " * 600}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
        ({"prompt": [99999999]}, 400, "prompt"),
    ],
)
def test_completion_errors(server, body, status, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status
    if param:
        assert error["param"] == param


@pytest.mark.parametrize(
    "data, status",
    [
        (b"[" * 10_000 + b"]" * 10_000, 400),
        (b'{"prompt": "' + b"[" * 100 + b'"}', 200),  # brackets inside a string are text
        (b'{"prompt": [' * 70 + b"1" + b"]}" * 70, 400),
        (b'{"prompt": "\xff\xfe"}', 400),
        (b'{"prompt": [' + b"1," * (1 << 20) + b"1]}", 413),
    ],
)
def test_json_body_limits(server, data, status):
    """docs/serving.md's body limits: hostile bodies get OpenAI's error body with a 4xx, never a 500."""
    if status == 200:
        data = data[:-1] + b', "max_tokens": 1}'
    r = _post(server, "/v1/completions", data)
    assert r.status_code == status, r.text[:300]
    if status != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", ["/v1/embeddings", "/score", "/rerank"])
def test_pooling_routes_need_the_pooling_runner(server, path):
    body = {"input": "x", "text_1": "x", "text_2": "y", "query": "x", "documents": ["y"]}
    r = _post(server, path, body)
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]


def test_chat_errors(server):
    tools = [{"type": "function", "function": {"name": "f"}}]
    # Without --enable-auto-tool-choice, tools default to tool_choice "none": plain text.
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": tools})
    assert r.status_code == 200 and r.json()["choices"][0]["message"].get("tool_calls") in (None, [])
    r = _post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "auto"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = _post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
    )
    assert r.status_code == 400 and "g" in r.json()["error"]["message"]
    r = _post(server, "/v1/chat/completions", {"messages": []})
    assert r.status_code == 400
    assert _post(server, "/v1/completions", b"{not json").status_code == 400
    big = _post(server, "/v1/completions", b'{"prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}')
    assert big.status_code == 413 and "error" in big.json()


def test_api_key(server):
    assert _post(server, "/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    r = _post(server, "/v1/completions", {"prompt": "x"}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    missing = httpx.get(f"{server.url}/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_server_survives_bad_requests(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert out.choices[0].finish_reason == "length"


# --- other routes -------------------------------------------------------------------------------
def test_models_tokenize_detokenize_version(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    tokens = _post(server, "/tokenize", {"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    assert _post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > tokens["count"] - 5
    version = httpx.get(f"{server.url}/version", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert version.json()["version"]
    role = httpx.get(f"{server.url}/pd_role", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert role.json() == {"pd_role": "mixed", "epoch": 0, "block_size": 16}  # what the PD router checks


def test_metrics_count_requests(server, client):
    before = metric(server, "splitserve:request_success_total")
    prompt_before = metric(server, "splitserve:prompt_tokens_total")
    generated_before = metric(server, "splitserve:generation_tokens_total")
    for _ in range(3):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    for _chunk in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True}, stream=True
    ):
        pass  # a streamed answer counts all its tokens, not its last chunk's
    assert metric(server, "splitserve:request_success_total") == before + 4
    assert metric(server, "splitserve:generation_tokens_total") == generated_before + 3 * 2 + 5
    assert metric(server, "splitserve:prompt_tokens_total") > prompt_before
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "inter_token_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "generation_tokens_total",
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
    ):
        assert f"splitserve:{name}" in text, name
    assert 'model_name="tiny"' in text


# --- load and disconnects -----------------------------------------------------------------------
def test_32_concurrent_streams(server):
    async def one(http: httpx.AsyncClient, i: int) -> tuple[str, str]:
        body = {"prompt": f"{PROMPT} {i}", "max_tokens": 12, "stream": True, "ignore_eos": True}
        text, finish = "", None
        async with http.stream(
            "POST", f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        return text, finish

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(32)))

    results = asyncio.run(run())
    assert all(finish == "length" and text for text, finish in results)


def _wait_idle(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            metric(server, "splitserve:num_requests_running") == 0
            and metric(server, "splitserve:kv_cache_usage_perc") == 0
        ):
            return
        time.sleep(0.2)
    raise AssertionError("the engine still holds requests or KV blocks")


def test_disconnect_mid_stream_frees_blocks(server):
    _wait_idle(server)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    _wait_idle(server)


def test_disconnect_of_non_streamed_request_frees_blocks(server):
    # 500 tokens take the tiny model well over the client's 0.1 s patience.
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions", json=body, timeout=0.1, headers={"Authorization": f"Bearer {API_KEY}"}
        )
    _wait_idle(server)


# --- several workers, queue limits, a dying engine ----------------------------------------------
def test_two_workers_share_the_engine_and_metrics(tiny_chat_model):
    """Two API workers, their metrics summed, under vLLM's names (--metrics-prefix vllm)."""
    with RemoteServer(tiny_chat_model, *COMMON, "--workers", "2", "--metrics-prefix", "vllm") as s:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        outs = [c.completions.create(model="default", prompt=PROMPT, max_tokens=4, temperature=0) for _ in range(8)]
        assert len({o.choices[0].text for o in outs}) == 1
        assert metric(s, "vllm:request_success_total") == 8 and metric(s, "vllm:generation_tokens_total") == 32
        text = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert "vllm:num_requests_running{" in text and "vllm:time_to_first_token_seconds_bucket{" in text
        assert "splitserve:" not in text
        assert len(s.child_pids()) >= 3  # the engine and two API workers (and spawn's tracker)


def test_max_queued_requests_gives_429(tiny_chat_model):
    with RemoteServer(tiny_chat_model, *COMMON, "--max-num-seqs", "1", "--max-queued-requests", "1") as s:

        async def fire():
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*(http.post(f"{s.url}/v1/completions", json=body) for _ in range(12)))

        codes = [r.status_code for r in asyncio.run(fire())]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}


def test_engine_death_with_no_restarts_left_ends_the_server(tiny_chat_model):
    """--max-engine-restarts 0: the engine's death fails its requests (503, never a hang) and the
    server exits non-zero, leaving the restart to an outer supervisor (systemd, Kubernetes)."""
    with RemoteServer(tiny_chat_model, *COMMON, "--max-engine-restarts", "0") as s:
        body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
        events = stream_and_kill(s.url, body, lambda: engine_pid(s), after=2)
        assert events[-1] == "[DONE]" and '"code":503' in events[-2].replace(" ", ""), events[-2:]
        assert s.proc.wait(timeout=30) == 1


def test_stuck_step_turns_health_to_503_and_is_logged(tiny_chat_model, tmp_path):
    """A step that stops making progress (simulated: the engine loop sleeps 8 s in its first busy
    step) turns /health to 503 within --health-timeout (plus the one-second ping), the engine's
    watchdog logs what it holds and where it is; once the step returns, all is well again."""
    from concurrent.futures import ThreadPoolExecutor

    log = tmp_path / "server.log"
    env = {"SPLITSERVE_FAULT_STEP_STALL_S": "8"}
    with RemoteServer(tiny_chat_model, *COMMON, "--health-timeout", "2", env=env, log_path=str(log)) as s:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"prompt": PROMPT, "max_tokens": 2}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{s.url}/v1/completions", json=body, headers=headers, timeout=60)
            time.sleep(0.5)  # the request reaches the engine, whose step then stalls
            start = time.monotonic()
            statuses = []
            while time.monotonic() - start < 5:
                statuses.append((time.monotonic() - start, httpx.get(f"{s.url}/health", timeout=10).status_code))
                if statuses[-1][1] == 503:
                    break
                time.sleep(0.2)
            assert statuses[-1][1] == 503 and statuses[-1][0] <= 2 + 1 + 1, statuses
            assert pending.result().status_code == 200  # the step returned: the request completes
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200
    text = log.read_text()
    assert "longer than the health timeout (2.0 s)" in text and "holds 1 request(s)" in text
    assert "finished after" in text and "making progress again" in text


@pytest.mark.parametrize(
    "sig, workers",
    [(signal.SIGTERM, 1), (signal.SIGKILL, 1), (signal.SIGTERM, 2), (signal.SIGINT, 2), (signal.SIGHUP, 2)]
    + [(signal.SIGKILL, 2)],
)
def test_children_do_not_outlive_the_server(tiny_chat_model, sig, workers):
    """A signal to the server process alone (not its group, as systemd or `kill PID` send it), with
    one or two API workers: SIGTERM, SIGINT and SIGHUP stop the engine and the workers through the
    server's own shutdown; after SIGKILL the kernel's parent-death signal stops them."""
    with RemoteServer(tiny_chat_model, *COMMON, "--workers", str(workers)) as s:
        children = s.child_pids()
        assert children
        os.kill(s.proc.pid, sig)
        s.proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and not _is_zombie(p) for p in children):
            time.sleep(0.1)  # a zombie has exited (an orphan's is reaped by init, whenever it gets to it)
        assert not [p for p in children if os.path.exists(f"/proc/{p}") and not _is_zombie(p)]


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_fastdeploy_style_flags(tiny_chat_model):
    """--metrics-port on its own port, the engine socket on --engine-worker-queue-port, an inline
    --chat-template and a --reasoning-parser, started through `python -m ...api_server`."""
    from tests.helpers.server import free_port

    metrics_port, queue_port = free_port(), free_port()
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    with RemoteServer(
        tiny_chat_model,
        *COMMON,
        "--metrics-port",
        str(metrics_port),
        "--engine-worker-queue-port",
        str(queue_port),
        "--chat-template",
        template,
        "--reasoning-parser",
        "deepseek_r1",
        entry_point="api_server",
    ) as s:
        tokens = httpx.post(f"{s.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert httpx.post(f"{s.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "<<hi>>"
        chat = httpx.post(
            f"{s.url}/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0},
        ).json()
        message = chat["choices"][0]["message"]
        # deepseek_r1: with no </think> in the output, all of it is reasoning.
        assert message["reasoning_content"] and not message["content"]
        assert chat["usage"]["completion_tokens_details"]["reasoning_tokens"] == chat["usage"]["completion_tokens"]
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert "splitserve:request_success_total" in metrics


# --- priority scheduling ---------------------------------------------------------------------------
def test_priority_needs_the_priority_policy(server):
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "priority": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    ok = _post(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "priority": 0})
    assert ok.status_code == 200


def test_a_high_priority_request_passes_the_waiting_ones(tiny_chat_model):
    """One seat (--max-num-seqs 1), four low-priority requests sent first, then a high-priority one:
    it runs as soon as the seat frees, before the three that were still waiting. Offline, the same
    policy orders LLM.generate's prompts by their priorities."""
    args = ("--max-num-seqs", "1", "--scheduling-policy", "priority")
    with RemoteServer(tiny_chat_model, *COMMON, *args) as s:

        async def fire():
            done = []
            async with httpx.AsyncClient(timeout=120) as http:

                async def one(name: str, priority: int, delay: float):
                    await asyncio.sleep(delay)
                    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "priority": priority}
                    r = await http.post(f"{s.url}/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    done.append(name)

                lows = [one(f"low{i}", 10, 0.05 * i) for i in range(4)]
                await asyncio.gather(*lows, one("high", -10, 0.3))
            return done

        order = asyncio.run(fire())
        assert order.index("high") <= 1, order  # after the low request that held the seat, if any
    llm = LLM(tiny_chat_model, dtype="float32", max_model_len=512, max_num_seqs=1, scheduling_policy="priority")
    prompts = [{"prompt_token_ids": [5, 6, 7 + i]} for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False, priority=[2, 0, 1])
    firsts = [o.metrics.first_token_time for o in outs]
    assert firsts[1] < firsts[2] < firsts[0]
