"""PD roles switched while serving, end to end: a prefill and a decode instance and a router on
loopback; the roles move prefill -> decode -> mixed and back with a request in flight, the router
follows, every answer is the one the first deployment gave, and no KV block or lease is left behind."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.helpers.pd import COMMON, idle, wait_for
from tests.helpers.server import RemoteServer, metric, read_stream

pytestmark = pytest.mark.slow  # starts a PD deployment (prefill, decode, router)

PROMPT = "The capital of France is"
FRESH_PROMPT = "A long prompt that no instance has seen before, so that its KV blocks must travel. " * 3


@pytest.fixture(scope="module")
def deployment(tiny_chat_model):
    prefill = RemoteServer(tiny_chat_model, *COMMON, "--pd-role", "prefill", "--kv-lease-seconds", "5")
    decode = RemoteServer(tiny_chat_model, *COMMON, "--pd-role", "decode")
    router = RemoteServer(None, "router", "--prefill", prefill.url, "--decode", decode.url, "--health-interval", "0.5")
    try:
        yield prefill, decode, router
    finally:
        for server in (router, decode, prefill):
            server.close()


def _answer(router, prompt: str = PROMPT) -> str:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _switch(router, inst, role: str) -> int:
    r = httpx.post(f"{router.url}/router/pd_role", json={"url": inst.url, "pd_role": role}, timeout=30)
    assert r.status_code == 200 and r.json()["pd_role"] == role, r.text
    return r.json()["epoch"]


def _listed(router) -> dict[str, str]:
    """Each instance's role as the router lists it."""
    rows = httpx.get(f"{router.url}/router/instances", timeout=10).json()["instances"]
    return {row["url"]: row["role"] for row in rows}


def test_roles_switch_live_and_the_router_follows(deployment):
    prefill, decode, router = deployment
    expected = _answer(router)
    # A long request in flight on the decode instance while the prefill instance becomes a decode one.
    run: dict = {}
    body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
    started = threading.Event()
    reader = threading.Thread(target=read_stream, args=(router.url, body, {}, run, lambda n: started.set()))
    reader.start()
    assert started.wait(60)
    assert _switch(router, prefill, "decode") == 1
    assert _listed(router)[prefill.url] == "decode"  # followed at once
    reader.join(120)
    # The request in flight lost nothing (its first chunk may carry the prefill's token with the next).
    assert run["finish"] == "length" and run["chunks"] >= 299
    assert _answer(router) == expected  # no prefill instance: decoded whole, on either instance

    # Reversed roles: the KV now moves from the former decode instance to the former prefill one (a
    # prompt neither has cached, so that its blocks are pulled rather than found in the prefix cache).
    received = metric(prefill, "splitserve:kv_transfer_blocks_received_total")
    assert _switch(router, decode, "prefill") == 1
    assert _answer(router) == expected
    _answer(router, FRESH_PROMPT)
    wait_for(
        lambda: metric(prefill, "splitserve:kv_transfer_blocks_received_total") > received,
        what="the former prefill instance to pull KV blocks from the former decode one",
    )
    assert metric(decode, "splitserve:kv_transfer_blocks_sent_total") > 0

    # Mixed: the instance takes both phases of PD requests, and whole ones.
    assert _switch(router, prefill, "mixed") == 2
    assert _listed(router) == {prefill.url: "mixed", decode.url: "prefill"}
    assert _answer(router) == expected

    # A request meant for the role an instance left: a 409 that names its role now.
    kv = {"do_remote_decode": True}
    r = httpx.post(f"{prefill.url}/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": kv}, timeout=30)
    assert r.status_code == 200  # mixed takes a prefill request
    _switch(router, prefill, "decode")
    r = httpx.post(f"{prefill.url}/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": kv}, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["type"] == "pd_role_changed", r.text
    assert "now a decode instance (PD role epoch 3)" in r.json()["error"]["message"]

    # Back where they started; nothing is left running or leased (the stray prefill's lease expires).
    _switch(router, prefill, "prefill")
    _switch(router, decode, "decode")
    assert _listed(router) == {prefill.url: "prefill", decode.url: "decode"}
    assert _answer(router) == expected
    assert httpx.get(f"{prefill.url}/pd_role", timeout=10).json()["epoch"] == 4
    for server in (prefill, decode):
        wait_for(lambda url=server.url: idle(url), what=f"{server.url} to free its blocks")


def test_an_instance_started_mixed_refuses_a_pd_role(tiny_chat_model):
    with RemoteServer(tiny_chat_model, *COMMON) as server:
        r = httpx.post(f"{server.url}/pd_role", json={"pd_role": "prefill"}, timeout=30)
        assert r.status_code == 400 and "started with --pd-role mixed" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/pd_role", json={"pd_role": "leader"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "pd_role"
        assert httpx.get(f"{server.url}/pd_role", timeout=10).json() == {
            "pd_role": "mixed",
            "epoch": 0,
            "block_size": 16,
        }
