"""FastDeploy's LocalScheduler flags on its own entry point: --scheduler-ttl (a request that waited
longer without running gets a 503 that says so, and the engine goes on) and --scheduler-max-size
(429s once that many requests wait). The global scheduler: tests/e2e/test_global_scheduler.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import httpx
import pytest

from splitserve.loader.resolve import default_model_path
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts a server

FLAGS = ("--max-model-len", "512", "--max-num-seqs", "1", "--scheduler-ttl", "0.5", "--scheduler-max-size", "1")


def _streamed(url: str, body: dict, started: threading.Event) -> int:
    """A streamed request: `started` is set at its first event (it runs), the status at its end."""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
        return r.status_code


def test_queue_ttl_and_size():
    # The embedded model: its 400 tokens take well over a second on any CPU, past the 0.5 s TTL.
    with RemoteServer(default_model_path(), *FLAGS, "--disable-log-requests", entry_point="api_server") as server:
        url = f"{server.url}/v1/completions"
        long = {"prompt": "Once upon a time", "max_tokens": 400, "min_tokens": 400, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = threading.Event()
            first = pool.submit(_streamed, url, long, started)
            assert started.wait(60)  # it runs, on the only seat
            expired = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
            assert first.result() == 200
        assert expired.status_code == 503 and "--scheduler-ttl" in expired.json()["error"]["message"]

        async def fire():
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True}
                return await asyncio.gather(*(http.post(url, json=body) for _ in range(12)))

        codes = [r.status_code for r in asyncio.run(fire())]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429, 503}, codes
