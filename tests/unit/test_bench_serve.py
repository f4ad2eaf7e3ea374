"""`splitserve bench serve` against a fake OpenAI-compatible server on loopback (aiohttp.web in a thread):
its delays are known, so the measured TTFT and ITL can be checked, and it records the request bodies and the
peak number of requests in flight. The arrival-gap generator, the SSE splitter, the percentile arithmetic and
the tokenizer-made prompts are checked on their own."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
import sys
import threading

import numpy as np
import pytest
from aiohttp import web

from splitserve.benchmarks import serve, serve_client, serve_report, serve_workload
from splitserve.entrypoints.cli import build_parser

FIRST_DELAY = 0.06  # seconds before the first chunk with text
CHUNK_SLEEP = 0.02  # seconds between chunks
TOKENS_PER_CHUNK = 2  # so that usage (tokens) and the chunk count differ


class FakeServer:
    """Streams ceil(max_tokens / 2) chunks (the second with empty text; a chat stream's after a role
    chunk), then usage and [DONE]. Routes:
    /v1/... normal; /nousage/v1/... without the usage chunk; /flaky/v1/... answers its k-th request with
    HTTP 500, HTTP 400, a mid-stream error event, or a normal stream, for k % 4 = 0, 1, 2, 3."""

    def __init__(self) -> None:
        self.active = self.peak = self.arrivals = 0
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        app = web.Application()
        for prefix in ("", "/nousage", "/flaky"):
            app.add_routes(
                [
                    web.get(f"{prefix}/v1/models", self.models),
                    web.post(f"{prefix}/v1/completions", self.generate),
                    web.post(f"{prefix}/v1/chat/completions", self.generate),
                ]
            )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.SockSite(self.runner, sock).start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def reset(self) -> None:
        self.active = self.peak = self.arrivals = 0
        self.bodies.clear()
        self.auth.clear()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        kind = self.arrivals % 4 if request.path.startswith("/flaky") else 3
        self.arrivals += 1
        if kind == 0:
            return web.Response(status=500, text="boom")
        if kind == 1:
            return web.json_response({"object": "error", "message": "bad max_tokens"}, status=400)
        self.active += 1
        self.peak = max(self.peak, self.active)
        chat = request.path.endswith("chat/completions")
        max_tokens = body.get("max_completion_tokens") if chat else body.get("max_tokens")
        chunks = math.ceil(max_tokens / TOKENS_PER_CHUNK)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(event: dict | str) -> None:
            await response.write(f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode())

        def chunk(text: str) -> dict:
            return {"choices": [{"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}]}

        if chat:  # the opening chunk of a chat stream (vLLM's, splitserve's): the role, no token, no TTFT yet
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(chunks):
            await asyncio.sleep(FIRST_DELAY if i == 0 else CHUNK_SLEEP)
            # The second chunk's token decodes to no text (an id past the tokenizer's vocabulary): it counts.
            await send(chunk("" if i == 1 else "ab"))
            if kind == 2:
                self.active -= 1
                await send({"error": {"message": "engine died", "code": 500}})
                return response
        if body.get("stream_options", {}).get("include_usage") and not request.path.startswith("/nousage"):
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            await send(
                {
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": max_tokens,
                        "total_tokens": prompt_tokens + max_tokens,
                    },
                }
            )
        self.active -= 1  # before [DONE], so that a client reusing the slot never looks like an overlap
        await send("[DONE]")
        return response


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    yield fake
    fake.close()


@pytest.fixture
def fake(server):
    server.reset()
    return server


def _bench(*args: str) -> dict:
    ns = build_parser().parse_args(["bench", "serve", "--disable-tqdm", *args])
    return ns.func(ns)


def _small(url: str, *args: str) -> dict:
    return _bench("--base-url", url, "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "6", *args)


def test_completions_counts_and_timings(fake, capsys):
    result = _small(fake.url)
    assert (result["completed"], result["failed"], result["model_id"]) == (4, 0, "fake-model")
    assert result["output_lens"] == [6] * 4 and result["total_output_tokens"] == 24  # usage, not the 3 chunks
    assert result["input_lens"] == [8] * 4 and result["total_input_tokens"] == 32
    assert min(result["ttfts"]) >= FIRST_DELAY  # the empty first chunk did not count
    gaps = [g for itl in result["itls"] for g in itl]
    assert len(gaps) == 4 * 2 and 0.75 * CHUNK_SLEEP <= statistics.median(gaps) <= 2.5 * CHUNK_SLEEP
    e2el, ttft = result["e2els"][0], result["ttfts"][0]
    assert e2el >= ttft + 2 * CHUNK_SLEEP
    assert result["mean_tpot_ms"] == pytest.approx(
        np.mean([(e - t) / 5 * 1000 for e, t in zip(result["e2els"], result["ttfts"])])
    )
    assert result["output_throughput"] == pytest.approx(24 / result["duration"])
    body = fake.bodies[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert body["max_tokens"] == 6 and len(body["prompt"].split()) == 8 and body["model"] == "fake-model"
    report = capsys.readouterr().out
    for line in (
        "Successful requests:",
        "Failed requests:",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Output token throughput (tok/s):",
        "Max concurrency reached:",
        "Median TTFT (ms):",
        "P99 TPOT (ms):",
        "P50 ITL (ms):",
        "Mean E2EL (ms):",
    ):
        assert line in report


def test_without_usage_chunks_are_counted(fake):
    result = _small(fake.url + "/nousage")
    assert result["completed"] == 4 and result["output_lens"] == [3] * 4  # ceil(6 / 2) chunks
    assert result["input_lens"] == [8] * 4  # the dataset's word count


def test_failures_are_counted_not_raised(fake, capsys):
    result = _bench(
        "--base-url",
        fake.url + "/flaky",
        "--model",
        "m",
        "--num-prompts",
        "8",
        "--random-input-len",
        "4",
        "--random-output-len",
        "4",
    )
    assert (result["completed"], result["failed"]) == (2, 6)
    errors = [e for e in result["errors"] if e]
    assert sum(e.startswith("HTTP 500") for e in errors) == 2
    assert sum(e.startswith("HTTP 400") and "bad max_tokens" in e for e in errors) == 2
    assert sum(e == "error event: engine died" for e in errors) == 2
    assert result["total_output_tokens"] == 8 and "6 failed requests" in capsys.readouterr().out


def test_unreachable_server(fake):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    result = _small(url, "--model", "m")
    assert (result["completed"], result["failed"]) == (0, 4) and all(result["errors"])
    assert result["mean_ttft_ms"] == 0.0
    with pytest.raises(ValueError, match="--model"):
        _small(url)


def test_max_concurrency_is_respected(fake):
    result = _bench(
        "--base-url",
        fake.url,
        "--num-prompts",
        "8",
        "--random-input-len",
        "4",
        "--random-output-len",
        "2",
        "--max-concurrency",
        "3",
    )
    assert result["completed"] == 8 and fake.peak <= 3 and result["max_concurrent_requests"] == 3
    fake.reset()
    _bench("--base-url", fake.url, "--num-prompts", "8", "--random-input-len", "4", "--random-output-len", "2")
    assert fake.peak > 3  # without the cap, the same load does overlap more


def test_chat_endpoint(fake):
    result = _small(fake.url, "--endpoint", "/v1/chat/completions", "--backend", "openai-chat")
    assert (result["completed"], result["failed"]) == (4, 0) and result["output_lens"] == [6] * 4
    assert min(result["ttfts"]) >= FIRST_DELAY
    body = fake.bodies[0]
    assert body["max_completion_tokens"] == 6 and "prompt" not in body
    assert body["messages"][0]["role"] == "user" and len(body["messages"][0]["content"].split()) == 8


def test_save_result_extra_body_and_api_key(fake, tmp_path):
    result = _small(
        fake.url,
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "run.json",
        "--extra-body",
        '{"top_p": 0.5}',
        "--no-ignore-eos",
        "--api-key",
        "secret-key",
        "--metric-percentiles",
        "90,99.9",
        "--random-prefix-len",
        "3",
    )
    text = (tmp_path / "run.json").read_text()
    saved = json.loads(text)
    assert saved["completed"] == 4 and saved["request_rate"] == "inf"
    for key in (
        "duration",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "max_concurrent_requests",
        "mean_ttft_ms",
        "median_tpot_ms",
        "p90_itl_ms",
        "p99.9_e2el_ms",
        "std_e2el_ms",
        "ttfts",
        "itls",
        "e2els",
        "input_lens",
        "output_lens",
        "errors",
        "args",
    ):
        assert saved[key] == result[key], key
    assert saved["input_lens"] == [11] * 4  # 3 prefix + 8 words
    assert "secret-key" not in text and set(fake.auth) == {"Bearer secret-key"}
    assert all(b["top_p"] == 0.5 and "ignore_eos" not in b for b in fake.bodies)
    prompts = [b["prompt"].split() for b in fake.bodies]
    assert len({tuple(p[:3]) for p in prompts}) == 1  # the shared prefix


def test_plot(fake, tmp_path):
    pytest.importorskip("matplotlib")
    _small(fake.url, "--plot", str(tmp_path / "latencies.png"))
    assert (tmp_path / "latencies.png").stat().st_size > 10_000


def test_arrival_gaps():
    rate, n = 10.0, 20000
    poisson = np.array(serve_workload.arrival_gaps(n, rate, 1.0, seed=1))
    assert poisson.mean() == pytest.approx(1 / rate, rel=0.03)
    assert poisson.var() == pytest.approx(1 / rate**2, rel=0.1)  # exponential: variance = mean^2
    assert serve_workload.arrival_gaps(50, rate, 1.0, seed=1) == serve_workload.arrival_gaps(50, rate, 1.0, seed=1)
    assert serve_workload.arrival_gaps(50, rate, 1.0, seed=1) != serve_workload.arrival_gaps(50, rate, 1.0, seed=2)
    bursty, even = (np.array(serve_workload.arrival_gaps(n, rate, b, seed=1)) for b in (0.25, 4.0))
    assert bursty.mean() == pytest.approx(1 / rate, rel=0.05) and even.mean() == pytest.approx(1 / rate, rel=0.03)
    assert bursty.var() > 3 * poisson.var() > 9 * even.var()  # variance 1 / (rate^2 * burstiness)
    assert serve_workload.arrival_gaps(3, math.inf, 1.0, seed=0) == [0.0] * 3


def test_summarize_percentiles():
    stats = serve_report.summarize([1.0, 2.0, 3.0, 4.0], [50, 99, 99.9])
    assert stats["mean"] == stats["median"] == stats["p50"] == 2500.0
    assert stats["p99"] == pytest.approx(3970.0) and stats["p99.9"] == pytest.approx(3997.0)
    assert stats["std"] == pytest.approx(1118.034, abs=1e-3)
    assert serve_report.summarize([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_sse_buffer_joins_split_events():
    buffer = serve_client.SSEBuffer()
    stream = b'data: {"a": 1}\r\n\r\n: keep-alive\n\ndata:{"b": "\xc3\xa9"}\n\ndata: [DONE]\n\n'
    payloads = [p for i in range(0, len(stream), 5) for p in buffer.feed(stream[i : i + 5])]
    assert payloads == ['{"a": 1}', '{"b": "\u00e9"}', "[DONE]"]


def test_argument_checks(monkeypatch):
    ns = build_parser().parse_args(["bench", "serve", "--dataset-name", "sharegpt"])
    assert not hasattr(ns, "max_model_len")  # a client: no engine arguments
    with pytest.raises(ValueError, match="choose from random, multi-turn"):
        serve.check_arguments(ns)
    for bad in (
        ["--percentile-metrics", "ttft,foo"],
        ["--random-range-ratio", "1.5"],
        ["--backend", "openai-chat"],
        ["--metric-percentiles", "50,x"],
    ):
        with pytest.raises(ValueError):
            serve.check_arguments(build_parser().parse_args(["bench", "serve", *bad]))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(ValueError, match="pip install matplotlib"):
        serve.check_arguments(build_parser().parse_args(["bench", "serve", "--plot", "x.png"]))


def test_tokenizer_prompts(smollm_tokenizer):
    args = [
        "bench",
        "serve",
        "--num-prompts",
        "6",
        "--random-input-len",
        "40",
        "--random-prefix-len",
        "5",
        "--random-range-ratio",
        "0.5",
    ]
    ns = build_parser().parse_args(args)
    special = set(smollm_tokenizer.all_special_ids)
    requests = serve_workload.make_requests(ns, smollm_tokenizer, chat=False)
    assert len({r.output_len for r in requests}) > 1 and all(64 <= r.output_len <= 192 for r in requests)
    for r in requests:
        assert isinstance(r.prompt, list) and r.prompt_len == len(r.prompt) and 25 <= len(r.prompt) <= 65
        assert r.prompt[:5] == requests[0].prompt[:5] and not special & set(r.prompt)
    chat = serve_workload.make_requests(ns, smollm_tokenizer, chat=True)
    for r, ids in zip(chat, requests):
        assert len(smollm_tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert abs(r.prompt_len - len(ids.prompt)) <= 2
    outcome = serve_client.Outcome(success=True, text=" hello world, again", chunks=1)
    serve._fill_token_counts([outcome], requests[:1], smollm_tokenizer)
    assert outcome.output_tokens == len(smollm_tokenizer.encode(" hello world, again", add_special_tokens=False))
    assert outcome.prompt_tokens == requests[0].prompt_len


def test_guided_json_is_sent_with_every_request(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for value in (json.dumps(schema), f"@{path}"):
        ns = build_parser().parse_args(["bench", "serve", "--guided-json", value])
        body = serve_workload.request_body(serve_client.Request("hi", 2, 8), ns, "m", chat=False)
        assert body["guided_json"] == schema and body["prompt"] == "hi"


def test_lora_modules_spread_requests_over_adapters(fake):
    result = _small(fake.url, "--num-prompts", "24", "--lora-modules", "a", "b", "c", "--seed", "3")
    assert result["completed"] == 24
    models = [body["model"] for body in fake.bodies]
    assert set(models) == {"a", "b", "c"} and all(models.count(m) >= 3 for m in "abc")
    fake.reset()
    _small(fake.url, "--num-prompts", "24", "--lora-modules", "a", "b", "c", "--seed", "3")
    assert sorted(body["model"] for body in fake.bodies) == sorted(models)  # the same draw again


def test_priority_fraction_marks_an_even_share_and_reports_it_apart(fake, capsys):
    result = _small(fake.url, "--num-prompts", "8", "--priority-fraction", "0.25")
    priorities = [b.get("priority", 0) for b in fake.bodies]
    assert sorted(priorities) == [-1, -1, 0, 0, 0, 0, 0, 0]
    assert set(result["by_priority"]) == {"-1", "0"} and result["by_priority"]["-1"]["requests"] == 2
    assert result["by_priority"]["-1"]["p99_ttft_ms"] > 0
    assert "priority -1 (2 requests)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--priority-fraction"):
        _small(fake.url, "--priority-fraction", "1.5")


def test_multi_turn_sends_each_turn_with_its_history(fake, capsys):
    args = ["--dataset-name", "multi-turn", "--num-conversations", "3", "--num-turns", "4", "--max-concurrency", "2"]
    args += ["--random-prefix-len", "5", "--random-input-len", "7", "--turn-input-len", "3", "--random-output-len", "4"]
    result = _bench("--base-url", fake.url, *args)
    assert result["completed"] == 12 and result["failed"] == 0 and fake.peak <= 2
    lengths = sorted(len(body["messages"]) for body in fake.bodies)
    assert lengths == sorted([2, 4, 6, 8] * 3)  # system + (question, answer) per earlier turn + the question
    last = max(fake.bodies, key=lambda body: len(body["messages"]))["messages"]
    assert [m["role"] for m in last] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert last[2]["content"] == "ab"  # the answer streamed back, as the client saw it (its 2nd chunk is empty)
    assert result["prefix_hit_rate"] == 0.0 and set(result["median_ttft_ms_by_turn"]) == {0, 1, 2, 3}
    assert "median TTFT by turn" in capsys.readouterr().out


def test_multi_turn_hit_rate_is_the_servers_cached_share():
    from splitserve.benchmarks.multi_turn import summarize
    from splitserve.benchmarks.serve_client import Outcome

    done = [
        Outcome(success=True, ttft=0.1 * (i + 1), prompt_tokens=100, cached_tokens=c, output_tokens=5)
        for i, c in enumerate((0, 80, 96))
    ]
    result = summarize([(0, done[0]), (1, done[1]), (2, done[2]), (3, Outcome(error="HTTP 500"))], duration=2.0)
    assert (
        result["prefix_hit_rate"] == pytest.approx(176 / 300)
        and result["failed"] == 1
        and result["errors"] == ["HTTP 500"]
    )
    assert result["median_ttft_ms"] == pytest.approx(200.0) and result["output_throughput"] == pytest.approx(7.5)
