"""FastDeploy's LocalScheduler flags on its own entry point: --scheduler-max-size (a 429 when that
many requests wait) and --scheduler-ttl (a request that waited longer without running gets a 503
that says so, and the engine goes on); --scheduler-name global is refused at start-up."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts a server

LONG = {"prompt": [5, 6, 7], "max_tokens": 400, "min_tokens": 400, "temperature": 0}


def test_queue_ttl_and_size(tiny_chat_model):
    flags = ("--max-model-len", "512", "--max-num-seqs", "1", "--scheduler-ttl", "0.3", "--scheduler-max-size", "1")
    with RemoteServer(tiny_chat_model, *flags, "--disable-log-requests", entry_point="api_server") as server:
        url = f"{server.url}/v1/completions"
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(httpx.post, url, json=LONG, timeout=120)
            time.sleep(0.2)  # the first runs 400 steps on the only seat: the second waits, past the TTL
            second = pool.submit(httpx.post, url, json={**LONG, "max_tokens": 2, "min_tokens": 0}, timeout=120)
            time.sleep(0.1)
            third = httpx.post(url, json={**LONG, "max_tokens": 2, "min_tokens": 0}, timeout=120)
            assert first.result().status_code == 200
            expired = second.result()
        assert third.status_code == 429  # one request was already waiting (--scheduler-max-size 1)
        assert expired.status_code == 503 and "--scheduler-ttl" in expired.json()["error"]["message"]
        again = httpx.post(url, json={**LONG, "max_tokens": 2, "min_tokens": 0}, timeout=120)
        assert again.status_code == 200  # an idle engine serves at once


def test_the_global_scheduler_is_refused(tiny_chat_model):
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.entrypoints.openai.api_server", "--model", tiny_chat_model,
         "--scheduler-name", "global"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "Redis-backed scheduler" in done.stderr
