"""`splitserve run-batch`: OpenAI's batch file format offline (vLLM's run-batch): every line gets a
result with its custom_id, the answers are what the server and the offline API give, and a bad line
costs only itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts an engine process

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Hello"}]


def test_a_batch_file_is_answered_line_by_line(tiny_chat_model, tmp_path):
    lines = [
        {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        },
        {
            "custom_id": "m",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": CHAT, "max_tokens": 8, "temperature": 0},
        },
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": PROMPT, "max_tokens": -1}},
        {"custom_id": "route", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "stream", "method": "POST", "url": "/v1/completions", "body": {"prompt": PROMPT, "stream": True}},
    ]
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{not json\n\n")
    results = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "splitserve.entrypoints.cli", "run-batch", "-i", str(requests), "-o", str(results)]
    cmd += [
        "--model",
        tiny_chat_model,
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-concurrency",
        "1",
    ]  # each alone, as offline
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "6 lines, 2 answered 200, 4 errors" in done.stdout
    by_id = {}
    for line in results.read_text().splitlines():
        result = json.loads(line)
        assert set(result) == {"id", "custom_id", "response", "error"}
        by_id[result["custom_id"]] = result
    assert set(by_id) == {"c", "m", "bad", "route", "stream", None}  # the line that is not JSON has no custom_id

    llm = LLM(tiny_chat_model, dtype="float32", max_model_len=512, use_tqdm_on_load=False)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    completion, chat = by_id["c"]["response"], by_id["m"]["response"]
    assert completion["status_code"] == 200 and by_id["c"]["error"] is None
    assert completion["body"]["choices"][0]["text"] == llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text
    assert chat["body"]["choices"][0]["message"]["content"] == llm.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0].text
    assert chat["body"]["object"] == "chat.completion" and chat["request_id"].startswith("splitserve-batch-")
    statuses = {
        key: (by_id[key]["response"]["status_code"], by_id[key]["error"]["param"]) for key in ("bad", "route", "stream")
    }
    assert statuses == {"bad": (400, "max_tokens"), "route": (404, "url"), "stream": (400, "stream")}
    assert by_id[None]["response"]["status_code"] == 400 and "not JSON" in by_id[None]["error"]["message"]
