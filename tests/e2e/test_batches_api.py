"""OpenAI's Batch API (/v1/files + /v1/batches) through the official `openai` SDK against a server of
the embedded model: each output line answers its custom_id with the body the online route gives the
same request, a bad line lands in the error file, a batch is cancelled, the lists show them, and
unknown ids get a 404 with OpenAI's error body. The server schedules by priority, so the batch's
lines run at the batch priority (the path that yields to online traffic)."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts a server

# Batch-invariant numerics: the embedded model's greedy tokens then do not depend on what shares a step.
ARGS = ["--batch-invariant", "--max-model-len", "512", "--num-gpu-blocks-override", "256", "--disable-log-requests"]
ARGS += ["--scheduling-policy", "priority", "--batch-max-concurrency", "2"]
COMPLETION = {"model": "default", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def client(default_gguf):
    with RemoteServer(default_gguf, *ARGS) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


def _upload(client, text: str) -> str:
    return client.files.create(file=("requests.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def _batch(client, file_id: str, endpoint: str = "/v1/chat/completions"):
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")


def _wait(client, batch_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def _same(body: dict) -> dict:
    """What two answers of the same greedy request share: not their ids, times and prefix-cache hits,
    and their cumulative logprobs to 1e-3 (a prompt found in the prefix cache is not recomputed)."""
    usage = {key: value for key, value in body["usage"].items() if key != "prompt_tokens_details"}
    choices = [
        {**choice, "cum_log_probs": pytest.approx(choice["cum_log_probs"], abs=1e-3)}
        if choice.get("cum_log_probs") is not None
        else choice
        for choice in body["choices"]
    ]
    return {"object": body["object"], "model": body["model"], "choices": choices, "usage": usage}


def test_output_lines_are_the_online_answers(client):
    text = _line("chat", "/v1/chat/completions", CHAT) + _line(
        "bad", "/v1/chat/completions", {**CHAT, "max_tokens": -1}
    )
    text += _line("other-route", "/v1/completions", COMPLETION)
    batch = client.batches.create(
        input_file_id=_upload(client, text),
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "e2e"},
    )
    assert batch.status == "validating" and batch.object == "batch" and batch.metadata == {"run": "e2e"}
    batch = _wait(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.model_dump() == {
        "total": 3,
        "completed": 1,
        "failed": 2,
    }
    [result] = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    online = client.chat.completions.with_raw_response.create(**CHAT).http_response.json()
    assert result["custom_id"] == "chat" and result["response"]["status_code"] == 200 and result["error"] is None
    assert _same(result["response"]["body"]) == _same(online)
    errors = {r["custom_id"]: r for r in map(json.loads, client.files.content(batch.error_file_id).text.splitlines())}
    assert (errors["bad"]["response"]["status_code"], errors["bad"]["error"]["param"]) == (400, "max_tokens")
    assert (errors["other-route"]["response"]["status_code"], errors["other-route"]["error"]["param"]) == (404, "url")


def test_completions_batch_matches_the_online_route(client):
    prompts = ["The capital of France is", "One, two, three,"]
    text = "".join(_line(f"p{i}", "/v1/completions", {**COMPLETION, "prompt": p}) for i, p in enumerate(prompts))
    batch = _wait(client, _batch(client, _upload(client, text), "/v1/completions").id)
    assert batch.status == "completed" and batch.error_file_id is None
    results = {r["custom_id"]: r for r in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    for i, prompt in enumerate(prompts):
        online = client.completions.with_raw_response.create(**{**COMPLETION, "prompt": prompt}).http_response.json()
        assert results[f"p{i}"]["custom_id"] == f"p{i}" and _same(results[f"p{i}"]["response"]["body"]) == _same(online)


def test_cancel_lists_and_404s(client):
    text = "".join(_line(f"r{i}", "/v1/chat/completions", {**CHAT, "max_tokens": 16}) for i in range(40))
    file_id = _upload(client, text)
    batch = _batch(client, file_id)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    batch = _wait(client, batch.id)
    assert batch.status == "cancelled" and batch.request_counts.completed < 40
    if batch.output_file_id:
        assert len(client.files.content(batch.output_file_id).text.splitlines()) == batch.request_counts.completed
    assert batch.id in [b.id for b in client.batches.list()]
    assert file_id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.retrieve(file_id).bytes == len(text.encode())
    for call in (
        lambda: client.batches.retrieve("batch_unknown"),
        lambda: client.files.retrieve("file-unknown"),
        lambda: client.files.content("file-unknown"),
        lambda: _batch(client, "file-unknown"),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["type"] == "not_found_error" and info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        _batch(client, file_id, "/v1/embeddings")  # not a pooling server
    assert info.value.body["param"] == "endpoint"
    assert client.files.delete(file_id).deleted
