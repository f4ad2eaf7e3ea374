"""The KV offloading tier through `splitserve serve`: the flags reach the engine process, prompts
evicted from a small KV cache come back from host memory (cached_tokens, /metrics), and a server
restarted on the same --kv-cache-dir reads them from disk."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.helpers.server import RemoteServer, metric

pytestmark = pytest.mark.slow  # starts servers

# Four 120-token prompts (7 full blocks of 16 before the last token each); 24 blocks hold three.
PROMPTS = [[(7 * i + 13 * j) % 900 + 5 for j in range(120)] for i in range(4)]
FLAGS = ("--max-model-len", "256", "--num-gpu-blocks-override", "24", "--max-num-seqs", "1")


def _ask(server, prompt: list[int]) -> tuple[str, int]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_served_prefixes_come_back_from_host_memory_and_after_a_restart_from_disk(tiny_chat_model, tmp_path):
    tier = ("--kv-offloading-size", "0.01", "--kv-offloading-backend", "native", "--kv-cache-dir", str(tmp_path))
    with RemoteServer(tiny_chat_model, *FLAGS, *tier) as server:
        first = [_ask(server, p) for p in PROMPTS]
        again = [_ask(server, p) for p in PROMPTS]
        assert [text for text, _ in again] == [text for text, _ in first]
        assert [cached for _, cached in again] == [112] * 4
        assert metric(server, "splitserve:kv_offload_host_hit_blocks_total") > 0
        assert metric(server, "splitserve:kv_offload_stored_blocks_total") > 0
    with RemoteServer(tiny_chat_model, *FLAGS, "--kv-cache-dir", str(tmp_path)) as server:
        restarted = [_ask(server, p) for p in PROMPTS]
        assert restarted == again
        assert metric(server, "splitserve:kv_offload_disk_hit_blocks_total") >= 7


def test_bad_offloading_flags_stop_the_server_with_the_reason(tiny_chat_model):
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.entrypoints.cli", "serve", tiny_chat_model, *FLAGS,
         "--kv-offloading-size", "1", "--kv-offloading-backend", "lmcache"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "LMCache is not integrated" in done.stderr


def test_a_pd_decode_instance_offloads_the_blocks_it_pulled(tiny_chat_model):
    """KV offloading on a PD decode instance: blocks pulled from the prefill instance and evicted from
    the decode instance's small cache are saved before a later pull overwrites them, and come back
    from host memory (the decode instance then pulls only what it lacks) with the same answers."""
    decode_flags = (*FLAGS, "--kv-offloading-size", "0.01")
    with (
        RemoteServer(tiny_chat_model, "--max-model-len", "256", "--pd-role", "prefill") as prefill,
        RemoteServer(tiny_chat_model, *decode_flags, "--pd-role", "decode") as decode,
        RemoteServer(None, "router", "--prefill", prefill.url, "--decode", decode.url) as router,
    ):
        first = [_ask(router, p)[0] for p in PROMPTS]
        received = metric(decode, "splitserve:kv_transfer_blocks_received_total")
        again = [_ask(router, p)[0] for p in PROMPTS]
        assert again == first
        assert metric(decode, "splitserve:kv_offload_stored_blocks_total") > 0
        assert metric(decode, "splitserve:kv_offload_host_hit_blocks_total") > 0
        # The second round's prefixes came from host memory: fewer blocks crossed the network.
        assert metric(decode, "splitserve:kv_transfer_blocks_received_total") - received < received
