"""The router in front of plain replicas (`splitserve router --mixed URL --mixed URL`): each request runs
whole on one replica; `cache_aware` sends a prompt to the replica whose KV cache events say it holds
the prompt's prefix, `round_robin` alternates; answers are the replicas' own, streamed or not."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.helpers.pd import COMMON, wait_for
from tests.helpers.server import RemoteServer, free_port, metric

pytestmark = pytest.mark.slow  # starts servers


@pytest.fixture(scope="module")
def replicas(tiny_chat_model):
    servers = []
    try:
        for _ in range(2):
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{free_port()}"}
            servers.append(RemoteServer(tiny_chat_model, *COMMON, "--kv-events-config", json.dumps(events)))
        yield servers
    finally:
        for server in servers:
            server.close()


def _router(replicas, policy: str, *extra: str) -> RemoteServer:
    urls = [arg for r in replicas for arg in ("--mixed", r.url)]
    router = RemoteServer(None, "router", *urls, "--policy", policy, "--health-interval", "0.5", *extra)
    wait_for(lambda: httpx.get(f"{router.url}/health", timeout=5).status_code == 200, what="the router")
    return router


def _hits_after(replicas, router, body: dict, times: int) -> list[float]:
    before = [metric(r, "splitserve:prefix_cache_hits_total") for r in replicas]
    for _ in range(times):
        assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=120).status_code == 200
        time.sleep(0.3)  # the replica's BlockStored reaches the router
    return [metric(r, "splitserve:prefix_cache_hits_total") - b for r, b in zip(replicas, before)]


def test_cache_aware_keeps_a_prefix_on_its_replica_round_robin_alternates(replicas, tiny_chat_model):
    prompt = list(range(10, 10 + 80))  # five full blocks of 16
    direct = httpx.post(
        f"{replicas[0].url}/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=120
    ).json()["choices"][0]["text"]
    with _router(replicas, "cache_aware", "--tokenizer", tiny_chat_model) as router:
        time.sleep(1.0)  # the router subscribes to the events at its first health checks
        body = {"prompt": list(range(300, 380)), "max_tokens": 2, "temperature": 0}
        _hits_after(replicas, router, body, 1)
        assert sorted(_hits_after(replicas, router, body, 4)) == [0, 4 * 64]  # all on the replica holding it
        streamed = httpx.post(
            f"{router.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True},
            timeout=120,
        ).text
        assert (
            "".join(
                json.loads(line[6:])["choices"][0]["text"]
                for line in streamed.splitlines()
                if line.startswith("data: {")
            )
            == direct
        )
        assert httpx.get(f"{router.url}/health", timeout=5).json() == {"status": "ok", "mixed": 2}
        # A chat tokenized by the router itself (--tokenizer) goes to the replica holding its prefix too.
        chat = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon " * 6}], "max_tokens": 2}
        hits = [metric(r, "splitserve:prefix_cache_hits_total") for r in replicas]
        for _ in range(3):
            assert httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=120).status_code == 200
            time.sleep(0.3)
        gained = [metric(r, "splitserve:prefix_cache_hits_total") - h for r, h in zip(replicas, hits)]
        assert min(gained) == 0 and max(gained) >= 2 * 16, gained
    with _router(replicas, "round_robin") as router:
        body = {"prompt": list(range(500, 580)), "max_tokens": 2, "temperature": 0}
        assert _hits_after(replicas, router, body, 4) == [64, 64]  # a miss on each replica, then a hit on each


def test_the_routers_tokenizer_renders_chats_as_the_replicas_do(replicas, tiny_chat_model):
    from splitserve.entrypoints.router.local_tokenizer import RouterTokenizer

    tokenizer = RouterTokenizer(tiny_chat_model)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for body in (
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]},
        {"messages": [{"role": "user", "content": "call f"}], "tools": tools},
        {"prompt": "Once upon a time"},
    ):
        served = httpx.post(f"{replicas[0].url}/tokenize", json=body, timeout=30).json()["tokens"]
        assert tokenizer.prompt_ids(body) == served
