"""The default model's greedy answers through a 1P1D deployment and through one mixed instance, in
its default numerics for requests sent one at a time (the decode instance starts from the prefill
instance's first token and computes what the mixed instance computes after the prompt), and in
batch-invariant numerics for requests sent all at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # default-model servers and a PD deployment

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "def fibonacci(n):\n    ",
]
COMMON = ["--max-model-len", "1024", "--disable-log-requests"]


def _tokens(url: str, prompt: str) -> list[str]:
    body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "logprobs": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def _answers(url: str, concurrent: bool) -> list[list[str]]:
    if not concurrent:
        return [_tokens(url, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _tokens(url, p), PROMPTS))


@pytest.mark.parametrize("invariant", [False, True], ids=["default-numerics", "batch-invariant"])
def test_pd_answers_as_a_mixed_instance(invariant):
    flags = COMMON + (["--batch-invariant"] if invariant else [])
    with RemoteServer(None, "serve", *flags) as mixed:
        expected = _answers(mixed.url, concurrent=invariant)
        if invariant:
            assert _answers(mixed.url, concurrent=False) == expected  # the same, batched or not
    with RemoteServer(None, "serve", *flags, "--pd", "1p1d") as router:
        assert _answers(router.url, concurrent=invariant) == expected
