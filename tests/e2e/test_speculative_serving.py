"""Speculative decoding through the server and a PD deployment: `--speculative-config` as vLLM takes
it, answers (streamed and not) identical to a server without speculation in batch-invariant
numerics, vLLM's spec-decode counters in /metrics, and bad configurations refused at start-up with
the reason."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.helpers.server import RemoteServer, metric

pytestmark = pytest.mark.slow  # default-model servers and a PD deployment

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 6})
FLAGS = ["--batch-invariant", "--max-model-len", "1024", "--disable-log-requests"]
TEXT = "The quick brown fox jumps over the lazy dog while the farmer sleeps under the old oak tree."
PROMPTS = [f"Repeat this sentence exactly twice: {TEXT}", "Count from one to twenty in words."]


def _completion(url: str, prompt: str, stream: bool = False) -> str:
    body = {"model": "default", "prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.fixture(scope="module")
def expected() -> list[str]:
    with RemoteServer(None, "serve", *FLAGS) as plain:
        return [_completion(plain.url, p) for p in PROMPTS]


def test_served_answers_match_a_server_without_speculation(expected):
    with RemoteServer(None, "serve", *FLAGS, "--speculative-config", NGRAM) as server:
        assert [_completion(server.url, p) for p in PROMPTS] == expected
        assert [_completion(server.url, p, stream=True) for p in PROMPTS] == expected
        drafts, accepted = (
            metric(server, "splitserve:spec_decode_num_draft_tokens_total"),
            metric(server, "splitserve:spec_decode_num_accepted_tokens_total"),
        )
        assert drafts > 0 and 0 < accepted <= drafts
        assert metric(server, "splitserve:spec_decode_num_accepted_tokens_per_pos_total") == accepted


def test_the_decode_instance_of_a_pd_deployment_speculates(expected):
    with RemoteServer(None, "serve", *FLAGS, "--speculative-config", NGRAM, "--pd", "1p1d") as router:
        assert [_completion(router.url, p) for p in PROMPTS] == expected


@pytest.mark.parametrize(
    "config, message",
    [
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 40}', "from 1 to 16"),
        ('{"model": "/no/such/draft", "num_speculative_tokens": 2}', "/no/such/draft"),
    ],
)
def test_bad_configurations_stop_the_server_with_the_reason(config, message):
    result = subprocess.run(
        [sys.executable, "-m", "splitserve.entrypoints.cli", "serve", "--speculative-config", config],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
