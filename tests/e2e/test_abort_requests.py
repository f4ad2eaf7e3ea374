"""/abort_requests: requests aborted by the ids their clients gave them (the X-Request-Id header or
the body's request_id), from any API worker of a server with two: the streams end with
finish_reason "abort" long before their max_tokens, the KV is freed, other requests run on; the
header comes back on answers; bad bodies get 400s. (Through a PD router: tests/e2e/test_pd.py.)"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.helpers.pd import idle, wait_for
from tests.helpers.server import RemoteServer, read_stream

pytestmark = pytest.mark.slow  # starts a server

LONG = {"prompt": "Count from one to a thousand:", "max_tokens": 2000, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    args = ["--workers", "2", "--dtype", "float32", "--max-model-len", "4096", "--disable-log-requests"]
    with RemoteServer(tiny_chat_model, *args, "--hf-overrides", '{"max_position_embeddings": 4096}') as s:
        yield s


def test_abort_by_header_and_by_body_id_from_any_worker(server):
    runs = {"hdr": {}, "body": {}}
    threads = [
        threading.Thread(target=read_stream, args=(server.url, LONG, {"X-Request-Id": "job-hdr"}, runs["hdr"])),
        threading.Thread(target=read_stream, args=(server.url, {**LONG, "request_id": "job-body"}, {}, runs["body"])),
    ]
    for t in threads:
        t.start()
    wait_for(lambda: all(r.get("chunks", 0) >= 5 for r in runs.values()), what="both streams to start")
    started = time.monotonic()
    for rid in ("job-hdr", "job-body", "no-such-id"):  # one call each: either worker may take it
        answer = httpx.post(server.url + "/abort_requests", json={"request_ids": [rid]}).json()
        assert answer == {"object": "abort", "request_ids": [rid]}
    for t in threads:
        t.join(60)
    assert time.monotonic() - started < 10
    for run in runs.values():
        assert run["finish"] == "abort" and 5 <= run["chunks"] < 2000
    assert runs["hdr"]["headers"]["x-request-id"] == "job-hdr"
    wait_for(lambda: idle(server.url), what="the KV to be freed")
    # The server serves on, and an id can be reused.
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, headers={"X-Request-Id": "job-hdr"}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body", [{}, {"request_ids": []}, {"request_ids": "job"}, {"request_ids": [1]}])
def test_bad_bodies_are_400s(server, body):
    r = httpx.post(server.url + "/abort_requests", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_ids"
