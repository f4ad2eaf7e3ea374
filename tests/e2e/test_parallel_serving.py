"""A server whose engine runs two tensor-parallel ranks (a worker process each): the official client
gets a single-rank engine's tokens; a rank killed mid-generation fails the request with a clear
error, and the server starts its engine again; and no process of the deployment outlives the server, whether it is
stopped with SIGTERM, SIGINT or SIGHUP (the server stops the engine, which stops its ranks) or killed
with SIGKILL (their parent-death signals stop them), read from /proc within a stated time."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from splitserve import LLM, SamplingParams
from tests.helpers.pd import wait_for
from tests.helpers.server import RemoteServer, alive, comm, stream_and_kill

pytestmark = pytest.mark.slow  # starts multi-rank servers

COMMON = ["--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--disable-log-requests"]
PROMPT = [11, 22, 33, 44, 55, 66, 77]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _rank_pids(server: RemoteServer) -> list[int]:
    """The ranks: the server's processes whose parent is another of its children (the engine), named
    splitserve-rN (forked from the engine or spawned, as the engine decides)."""
    children = set(server.child_pids())
    return sorted(p for p in children if _parent(p) in children and comm(p).startswith("splitserve-r"))


def _wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def test_two_ranks_serve_a_single_ranks_tokens(tiny_models):
    path = tiny_models["qwen3"]
    expected = (
        LLM(path, dtype="float32", max_model_len=256, use_tqdm_on_load=False)
        .generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    with RemoteServer(path, *COMMON, "--tensor-parallel-size", "2") as s:
        assert len(_rank_pids(s)) == 2
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(
            model="default",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert out.choices[0].model_extra["token_ids"] == expected


def test_a_rank_killed_mid_generation_fails_the_request_clearly_and_the_engine_restarts(tiny_models):
    """kill -9 of rank 1 mid-stream: the stream ends with an error naming the rank; the server starts
    its engine (both ranks) again and answers greedy requests as before."""
    with RemoteServer(tiny_models["llama"], *COMMON, "--tensor-parallel-size", "2") as s:
        ranks = _rank_pids(s)
        greedy = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        before = httpx.post(f"{s.url}/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
        body = {"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True}
        events = stream_and_kill(s.url, body, lambda: ranks[1], after=3)
        assert events[-1] == "[DONE]" and "rank 1" in events[-2] and '"code":503' in events[-2].replace(" ", "")
        assert len(events) < 240
        r = httpx.post(f"{s.url}/v1/completions", json=greedy, timeout=30)
        if r.status_code != 200:  # still restarting: the answer says why
            assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"], r.text
        wait_for(lambda: httpx.get(f"{s.url}/health", timeout=10).status_code == 200, 120, "the engine's restart")
        new_ranks = _rank_pids(s)
        assert len(new_ranks) == 2 and not set(new_ranks) & set(ranks)
        after = httpx.post(f"{s.url}/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
        assert after == before


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL])
def test_no_rank_outlives_the_server(tiny_models, sig):
    """A signal to the server process alone: it exits within 30 s. After SIGTERM, SIGINT or SIGHUP it
    has stopped the engine, which has stopped its ranks, before it exits; after SIGKILL the engine and
    then the ranks get their parent-death signals. Either way every process of the deployment (the
    ranks, the engine, multiprocessing's resource trackers) is gone 20 s later at the latest."""
    with RemoteServer(tiny_models["llama"], *COMMON, "--tensor-parallel-size", "2") as s:
        everything = s.child_pids()
        ranks = _rank_pids(s)
        assert len(ranks) == 2
        os.kill(s.proc.pid, sig)
        s.proc.wait(timeout=30)
        if sig != signal.SIGKILL:
            assert not [p for p in ranks if alive(p)], "the ranks outlived the server's own shutdown"
        assert not _wait_gone(everything, timeout=20.0)
