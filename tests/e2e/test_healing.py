"""Faults that heal: a server whose engine process dies starts a new one and serves again by itself;
a crash loop ends the server with a non-zero exit; a PD deployment's dead engine or instance comes
back and the router admits it again, while the surviving prefill instance frees the KV it leased for
requests that will not be decoded at once. (A rank of a tp=2 engine: test_parallel_serving.py.)"""

from __future__ import annotations

import os
import shutil
import signal

import httpx
import pytest

from tests.helpers.pd import COMMON, idle, wait_for
from tests.helpers.server import RemoteServer, engine_pid, metric, stream_and_kill

pytestmark = pytest.mark.slow  # starts servers and kills their processes

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _greedy(url: str) -> list[str]:
    answers = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["text"])
    return answers


def _health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_killed_engine_is_restarted_and_serves_as_before(tiny_chat_model, tmp_path):
    """With two API workers: the parent restarts the engine and both workers reconnect (a single
    worker restarting its own engine: the PD instances below)."""
    workers = 2
    log = tmp_path / "server.log"
    with RemoteServer(tiny_chat_model, *COMMON, "--workers", str(workers), log_path=str(log)) as s:
        before = _greedy(s.url)
        old = engine_pid(s)
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True}
        events = stream_and_kill(s.url, body, lambda: old, after=2)
        # The request in flight fails with a 503 that names the cause; the server does not hang.
        assert events[-1] == "[DONE]" and '"code":503' in events[-2].replace(" ", ""), events[-2:]
        assert "engine" in events[-2]
        wait_for(lambda: _health(s.url) == 200, 60, "the restarted engine")
        assert engine_pid(s) != old
        # Every API worker has reconnected: as many requests as it takes to reach each one.
        for _ in range(workers):
            assert _greedy(s.url) == before
        assert metric(s.url, "splitserve:engine_restarts_total") == 1
    text = log.read_text(errors="replace")
    assert "The engine process died (killed by signal 9 (SIGKILL)" in text
    assert "its last log lines:" in text and "The engine is serving again" in text


def test_a_crash_loop_ends_with_a_nonzero_exit(tiny_chat_model, tmp_path):
    """The model's files disappear while the server runs (an unmounted volume): each new engine dies
    at start; after --max-engine-restarts failed restarts the server exits non-zero, saying why."""
    model = tmp_path / "model"
    shutil.copytree(tiny_chat_model, model)
    log = tmp_path / "server.log"
    with RemoteServer(str(model), *COMMON, "--max-engine-restarts", "2", log_path=str(log)) as s:
        assert _greedy(s.url)
        shutil.rmtree(model)
        os.kill(engine_pid(s), signal.SIGKILL)
        assert s.proc.wait(timeout=120) == 1
    text = log.read_text(errors="replace")
    assert text.count("The new engine failed to start") == 2
    assert "Not restarting the engine again: the engine died 3 times" in text


def _router(prefill: RemoteServer, decode: RemoteServer) -> RemoteServer:
    return RemoteServer(None, "router", "--prefill", prefill.url, "--decode", decode.url, "--health-interval", "0.5")


def test_pd_engines_killed_come_back_and_leases_are_freed_at_once(tiny_chat_model):
    """A PD instance's engine killed: the instance restarts it and the router admits the instance
    again. The decode engine killed while requests wait on it: each fails (or is decoded by the
    restarted engine), and the prefill instance frees its lease at once, long before the lease
    (60 s) would expire."""
    prefill = RemoteServer(tiny_chat_model, *COMMON, "--pd-role", "prefill", "--kv-lease-seconds", "60")
    decode = RemoteServer(tiny_chat_model, *COMMON, "--pd-role", "decode")
    router = _router(prefill, decode)
    try:
        before = _greedy(router.url)
        for victim in (decode, prefill):
            os.kill(engine_pid(victim), signal.SIGKILL)
            body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert "restarting" in r.json()["error"]["message"] or "engine" in r.json()["error"]["message"]
            wait_for(lambda: idle(prefill.url), 20, "the prefill instance to free its lease")
            wait_for(lambda v=victim: _health(v.url) == 200, 60, "the restarted engine")
            wait_for(lambda: _health(router.url) == 200, 20, "the router to admit the instance again")
            assert _greedy(router.url) == before
        for server in (prefill, decode):
            assert metric(server.url, "splitserve:engine_restarts_total") == 1
            wait_for(lambda u=server.url: idle(u), 20, f"{server.url} to be idle")
    finally:
        for server in (router, decode, prefill):
            server.close()


def test_pd_launcher_restarts_an_instance_whose_process_died(tiny_chat_model):
    """`serve --pd 1p1d`: kill -9 of the decode instance's server process (its engine follows by its
    parent-death signal); the launcher starts the instance again on its port, the router admits it
    again, and when the launcher stops no process of either start is left."""
    with RemoteServer(tiny_chat_model, *COMMON, "--pd", "1p1d") as router:
        before = _greedy(router.url)
        old = _decode_instance(router)
        assert old is not None
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: _decode_instance(router) not in (None, old), 30, "the launcher to start it again")
        wait_for(lambda: _greedy_or_none(router.url) == before, 120, "the router to serve through the new instance")
        everything = router.child_pids()
    wait_for(lambda: not [p for p in everything if os.path.exists(f"/proc/{p}")], 20, "every process to exit")


def _greedy_or_none(url: str) -> list[str] | None:
    try:
        return _greedy(url)
    except (AssertionError, httpx.HTTPError):
        return None


def _decode_instance(router: RemoteServer) -> int | None:
    """The decode instance's server process: the launcher's child started with --pd-role decode."""
    for pid in router.child_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if parent == router.proc.pid and b"decode" in cmd and b"--pd-role" in cmd:
            return pid
    return None
