"""Every serving deployment with every request kind, through HTTP: each pair answers with a 200, no
process prints a traceback, and the answer is the plain server's once ids and timestamps are left
out.

The server's share of the pairwise matrix (the engine's is tests/parity/test_feature_matrix.py). A
deployment (a column) is a server started with one flag: `serve --pd 1p1d` and `2p1d`, `--workers 2`,
`--data-parallel-size 2`, `--tensor-parallel-size 2`, `--pipeline-parallel-size 2`, n-gram
speculation, a reasoning parser, tracing to an OTLP collector, the global scheduler on Redis. A
request kind (a row) is an API and its options: completions plain, with a stop string or token, echo
and logprobs, prompt logprobs, n and best_of, a seed, a guided regex, beam search; chat plain, with
logprobs, a JSON schema, forced tool calls; the Responses, Anthropic and Batch APIs; /tokenize; a
request dropped by its client; a LoRA adapter loaded at run time (every server takes adapters:
`--enable-lora`). A streamed answer must be the same request's unstreamed one. None of the columns
changes the numbers of a request sent alone (but for tensor parallelism's last digits: RANK_PLACES),
so each answer must be the plain server's (greedy or seeded, float32, one request at a time). Each
column's server starts once for all its rows (pytest groups the tests by column); the whole matrix
takes about five minutes.
"""

from __future__ import annotations

import contextlib
import json
import math
import time

import httpx
import pytest

from tests.helpers.models import make_peft_adapter
from tests.helpers.otlp import EXPORTER_ENV, OtlpCollector
from tests.helpers.redis_server import redis_server
from tests.helpers.server import RemoteServer, metric

pytestmark = pytest.mark.slow  # starts five deployments, three of them with several processes

COMMON = ("--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "256", "--disable-log-requests")
# Every server takes LoRA adapters at run time (the lora_runtime row loads one through the deployment).
COMMON += ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
ADAPTER: dict[str, str] = {}  # "path": the row's adapter, made by the `reference` fixture
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
COLUMNS = {
    "pd_1p1d": ("--pd", "1p1d"),
    # A router choosing between two prefill instances: what one instance keeps (a batch, a file, a
    # loaded adapter) must reach the request that asks for it through whichever instance it is sent to.
    "pd_2p1d": ("--pd", "2p1d"),
    # Two API processes, each sending streamed answers in chunks of 4 tokens (--stream-interval).
    "workers_2_stream_interval_4": ("--workers", "2", "--stream-interval", "4"),
    "data_parallel_2": ("--data-parallel-size", "2"),
    "speculative_ngram": ("--speculative-config", NGRAM),
    # float32 sums split over two ranks: the same tokens, logprobs within the rows' 1e-3
    "tensor_parallel_2": ("--tensor-parallel-size", "2"),
    "pipeline_parallel_2": ("--pipeline-parallel-size", "2"),
    # Qwen3's parser on a model that never thinks: every answer is content, split the same streamed
    "reasoning_parser": ("--reasoning-parser", "qwen3"),
    # Columns that need a service of their own (_service): an OTLP collector, a Redis queue.
    "tracing": (),
    "global_scheduler": ("--scheduler-name", "global"),
}
# Columns whose numbers differ from the plain server's in the last digits (float32 sums split over two
# ranks): logprobs within the rows' 1e-3, and a prompt token's rank among the vocabulary's near-equal
# logits by up to this many places.
RANK_PLACES = {"tensor_parallel_2": 2}
# (column, row) -> the bug that makes the pair fail (strict: it must fail until the bug is fixed).
XFAIL: dict[tuple[str, str], str] = {}

TIMEOUT = 60
# What the answers repeat (numbers, JSON) is in the prompts, so that n-gram speculation has drafts,
# and the forced tokens of the guided rows accept some of them.
PROMPT = "Count on: 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20"
REGEX = r"(, [0-9]{2}){6}"
SAMPLES = '{"unit": "c", "rainy": true} or [{"name": "get_weather", "parameters": {"unit": "c"}}]'
ASK = [{"role": "user", "content": f"Reply {SAMPLES}: is it raining in Paris?"}]
GREEDY = {"model": "default", "temperature": 0, "max_tokens": 10}
SCHEMA = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "rainy": {"type": "boolean"}},
    "required": ["unit", "rainy"],
}
RESPONSES = {"model": "default", "input": ASK[0]["content"], "max_output_tokens": 10, "temperature": 0}
ANTHROPIC = {"model": "default", "messages": ASK, "max_tokens": 10, "temperature": 0}
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": UNIT}}]
# Left out of the comparison: per-request ids, clocks, and the cache's state (cached prompt tokens).
DROPPED = {
    "id",
    "created",
    "created_at",
    "completed_at",
    "system_fingerprint",
    "prompt_tokens_details",
    "input_tokens_details",
}


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, (path, r.status_code, r.text)
    return r.json()


def _events(url: str, path: str, body: dict, done: bool = True) -> list[dict]:
    """The data of every server-sent event of a streamed request (OpenAI's end with [DONE])."""
    events, ended = [], False
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, (path, r.status_code, r.read())
        for line in r.iter_lines():
            if line == "data: [DONE]":
                ended = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event and event.get("type") != "error", event
                events.append(event)
    assert ended or not done, f"{path}: the stream ended without [DONE]"
    return events


def _same(streamed: dict, whole: dict) -> dict:
    """A streamed answer, checked against the same server's answer to the same request unstreamed."""
    differences = _differences(streamed, whole)
    assert not differences, ("streamed != not streamed", differences)
    return streamed


def _normal(value):
    """The answer without what differs between two servers giving the same result."""
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items() if k not in DROPPED}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def _differences(got, expected, path: str = "", rank_places: int = 0) -> list[str]:
    """Where two normalised answers differ; floats (logprobs) to within 1e-3, a token's `rank` to
    within `rank_places` places."""
    if isinstance(expected, dict) and isinstance(got, dict):
        keys = sorted(set(got) | set(expected))
        missing = "<missing>"
        return [
            d
            for k in keys
            for d in _differences(got.get(k, missing), expected.get(k, missing), f"{path}.{k}", rank_places)
        ]
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)) and len(got) == len(expected):
        return [
            d for i, (g, e) in enumerate(zip(got, expected)) for d in _differences(g, e, f"{path}[{i}]", rank_places)
        ]
    if isinstance(expected, float) and isinstance(got, float):
        return [] if math.isclose(got, expected, abs_tol=1e-3) else [f"{path}: {got!r} != {expected!r}"]
    if path.endswith(".rank") and isinstance(got, int) and isinstance(expected, int):
        return [] if abs(got - expected) <= rank_places else [f"{path}: {got!r} != {expected!r}"]
    return [] if got == expected else [f"{path}: {got!r} != {expected!r}"]


# --- the rows: each asks a server one request kind and returns its normalised answer ---------------
# `ref` holds the plain server's answers to the rows before (the stops are taken from them).
def _completion(url, ref, **fields) -> dict:
    return _normal(_post(url, "/v1/completions", {**GREEDY, "prompt": PROMPT, "return_token_ids": True, **fields}))


def _completion_stream(url, ref, **fields) -> dict:
    body = {**GREEDY, "prompt": PROMPT, "return_token_ids": True, "logprobs": 1, **fields}
    choices = [e["choices"][0] for e in _events(url, "/v1/completions", body) if e["choices"]]
    logprobs = [c["logprobs"] for c in choices if c["logprobs"]]
    whole = _post(url, "/v1/completions", body)["choices"][0]
    return _same(
        {
            "text": "".join(c["text"] for c in choices),
            "token_ids": [t for c in choices for t in c["token_ids"] or []],
            "tokens": [t for lp in logprobs for t in lp["tokens"]],
            "logprobs": [x for lp in logprobs for x in lp["token_logprobs"]],
            "finish_reason": [c["finish_reason"] for c in choices if c["finish_reason"]],
        },
        {
            "text": whole["text"],
            "token_ids": whole["token_ids"],
            "tokens": whole["logprobs"]["tokens"],
            "logprobs": whole["logprobs"]["token_logprobs"],
            "finish_reason": [whole["finish_reason"]],
        },
    )


def _stop_string(url, ref) -> dict:
    stop = ref["completion"]["choices"][0]["text"][5:8]
    out = _completion(url, ref, stop=[stop])
    assert out["choices"][0]["finish_reason"] == "stop" and stop not in out["choices"][0]["text"], (stop, out)
    return out


def _stop_token(url, ref) -> dict:
    stop = ref["completion"]["choices"][0]["token_ids"][5]
    out = _completion(url, ref, stop_token_ids=[stop], ignore_eos=True)
    assert out["choices"][0]["finish_reason"] == "stop", out
    return out


def _regex_stop_token(url, ref) -> dict:
    """A guided answer (drafts accepted) cut by a stop token that first comes late in it, streamed."""
    ids = ref["guided_regex"]["choices"][0]["token_ids"]
    stop = next(t for i, t in enumerate(ids) if i >= 8 and t not in ids[:i])
    return _completion_stream(url, ref, guided_regex=REGEX, stop_token_ids=[stop], max_tokens=30)


def _chat(url, ref, **fields) -> dict:
    return _normal(_post(url, "/v1/chat/completions", {**GREEDY, "messages": ASK, **fields}))


def _chat_stream(url, ref, **fields) -> dict:
    body = {**GREEDY, "messages": ASK, "logprobs": True, **fields}
    choices = [e["choices"][0] for e in _events(url, "/v1/chat/completions", body) if e["choices"]]
    calls: dict[int, list[str]] = {}
    for delta in (d for c in choices for d in c["delta"].get("tool_calls") or []):
        call = calls.setdefault(delta["index"], ["", ""])
        call[0] += delta["function"].get("name") or ""
        call[1] += delta["function"].get("arguments") or ""
    whole = _post(url, "/v1/chat/completions", body)["choices"][0]
    return _same(
        {
            "text": "".join(c["delta"].get("content") or "" for c in choices),
            "tool_calls": [calls[i] for i in sorted(calls)],
            "logprobs": [
                (x["token"], x["logprob"]) for c in choices if c["logprobs"] for x in c["logprobs"]["content"]
            ],
            "finish_reason": [c["finish_reason"] for c in choices if c["finish_reason"]],
        },
        {
            "text": whole["message"]["content"] or "",
            "tool_calls": [
                [c["function"]["name"], c["function"]["arguments"]] for c in whole["message"].get("tool_calls") or []
            ],
            "logprobs": [(x["token"], x["logprob"]) for x in whole["logprobs"]["content"]],
            "finish_reason": [whole["finish_reason"]],
        },
    )


def _anthropic_stream(url, ref) -> dict:
    events = _events(url, "/v1/messages", ANTHROPIC, done=False)
    whole = _post(url, "/v1/messages", ANTHROPIC)
    return _same(
        {
            "text": "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"),
            "stop_reason": [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"],
        },
        {"text": "".join(c["text"] for c in whole["content"]), "stop_reason": [whole["stop_reason"]]},
    )


def _responses_stream(url, ref) -> dict:
    events = _events(url, "/v1/responses", RESPONSES, done=False)
    [final] = [e["response"] for e in events if e["type"] in ("response.completed", "response.incomplete")]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"]
    return _same(_normal(final), _normal(_post(url, "/v1/responses", RESPONSES)))


def _json_schema(url, ref) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    out = _chat(url, ref, response_format=fmt, max_tokens=40)
    assert out["choices"][0]["finish_reason"] == "stop", out
    assert set(json.loads(out["choices"][0]["message"]["content"])) == {"unit", "rainy"}
    return out


def _tools_required(url, ref) -> dict:
    out = _chat(url, ref, tools=TOOLS, tool_choice="required", max_tokens=64)
    assert out["choices"][0]["finish_reason"] == "tool_calls", out
    for call in out["choices"][0]["message"]["tool_calls"]:
        assert set(json.loads(call["function"]["arguments"])) == {"unit"}, out
    return out


def _batch(url, ref) -> list[dict]:
    """Two completions through the Batch API (upload, create, wait, read the output file): each line's
    answer is the online answer."""
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": {**GREEDY, "prompt": p}}
        for i, p in enumerate((PROMPT, PROMPT[:20]))
    ]
    content = "\n".join(json.dumps(line) for line in lines).encode()
    r = httpx.post(f"{url}/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    body = {"input_file_id": r.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    batch = _post(url, "/v1/batches", body)
    deadline = time.monotonic() + TIMEOUT
    while batch["status"] not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = httpx.get(f"{url}/v1/batches/{batch['id']}", timeout=TIMEOUT).json()
    assert batch["status"] == "completed" and batch["request_counts"]["failed"] == 0, batch
    out = httpx.get(f"{url}/v1/files/{batch['output_file_id']}/content", timeout=TIMEOUT)
    assert out.status_code == 200, out.text
    answers = sorted((json.loads(line) for line in out.text.splitlines() if line), key=lambda a: a["custom_id"])
    return [
        {"custom_id": a["custom_id"], "status": a["response"]["status_code"], "body": _normal(a["response"]["body"])}
        for a in answers
    ]


def _abort_then_answer(url, ref) -> dict:
    """A streamed request the client drops after its first token, then a plain one: the server freed
    the first (nothing hangs or leaks into the next answer)."""
    body = {**GREEDY, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
    return _completion(url, ref)


def _lora_runtime(url, ref) -> dict:
    """An adapter loaded through the deployment at run time (on every instance, replica and API worker
    behind it), then asked for by name (streamed and whole)."""
    load = {"lora_name": "runtime", "lora_path": ADAPTER["path"]}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return _completion_stream(url, ref, model="runtime")


ROWS = {
    "completion": _completion,
    "completion_stream": _completion_stream,
    "stop_token_stream": lambda url, ref: _completion_stream(
        url, ref, stop_token_ids=[ref["completion"]["choices"][0]["token_ids"][5]], ignore_eos=True
    ),
    "stop_string": _stop_string,
    "stop_token_ids": _stop_token,
    "echo_logprobs": lambda url, ref: _completion(url, ref, echo=True, logprobs=2, max_tokens=8),
    "prompt_logprobs": lambda url, ref: _completion(url, ref, prompt_logprobs=1, max_tokens=8),
    "n_best_of": lambda url, ref: _completion(url, ref, n=2, best_of=3, seed=3, temperature=1.0),
    "seeded": lambda url, ref: _completion(url, ref, seed=7, temperature=1.0, top_p=0.9),
    "chat": _chat,
    "chat_stream": _chat_stream,
    "chat_logprobs": lambda url, ref: _chat(url, ref, logprobs=True, top_logprobs=2),
    "chat_json_schema": _json_schema,
    "chat_tools_required": _tools_required,
    "chat_tools_stream": lambda url, ref: _chat_stream(url, ref, tools=TOOLS, tool_choice="required", max_tokens=64),
    "responses": lambda url, ref: _normal(_post(url, "/v1/responses", RESPONSES)),
    "responses_stream": _responses_stream,
    "anthropic_messages": lambda url, ref: _normal(_post(url, "/v1/messages", ANTHROPIC)),
    "anthropic_stream": _anthropic_stream,
    "guided_regex": lambda url, ref: _completion(url, ref, guided_regex=REGEX, max_tokens=30),
    "regex_stop_token_stream": _regex_stop_token,
    "beam_search": lambda url, ref: _completion(url, ref, use_beam_search=True, n=2, max_tokens=6),
    "tokenize": lambda url, ref: _normal(_post(url, "/tokenize", {"model": "default", "prompt": PROMPT})),
    "batch_api": _batch,
    "abort_then_answer": _abort_then_answer,
    "lora_runtime": _lora_runtime,
}


@pytest.fixture(scope="module")
def reference(tiny_chat_model, tmp_path_factory) -> dict:
    """The plain server's answer to every row."""
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ADAPTER["path"] = make_peft_adapter(tiny_chat_model, str(tmp_path_factory.mktemp("lora")), projections, seed=5)
    answers, log = {}, tmp_path_factory.mktemp("matrix") / "plain.log"
    with RemoteServer(tiny_chat_model, *COMMON, log_path=str(log)) as plain:
        for row in ROWS:
            answers[row] = _answer(plain.url, answers, row)
    _no_traceback(log)
    return answers


def _answer(url: str, ref: dict, row: str):
    """The row's answer, or how the plain server failed it (that row's tests fail with it)."""
    try:
        return ROWS[row](url, ref)
    except (AssertionError, httpx.HTTPError, KeyError, TypeError, ValueError) as e:
        return RuntimeError(f"the plain server failed {row}: {e!r}")


def _no_traceback(log) -> None:
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[text.index("Traceback") - 2000 :][:6000]


@contextlib.contextmanager
def _service(name: str):
    """What the column's server needs beside it: (its extra flags, its environment, a check once its
    rows have run that the feature was at work)."""
    if name == "tracing":
        with OtlpCollector() as collector:
            # The rows' requests were traced: server spans for the rows' requests reached the collector.
            yield ("--otlp-traces-endpoint", collector.endpoint), EXPORTER_ENV, lambda server: _traced(collector)
    elif name == "global_scheduler":
        with redis_server() as port:
            yield ("--scheduler-port", str(port)), {}, lambda server: None
    elif name == "speculative_ngram":  # the rows ran through accepted drafts
        yield (), {}, lambda server: _accepted_drafts(server)
    elif name == "pd_2p1d":  # the router sent the rows' prompts to both prefill instances
        yield (), {}, lambda server: _every_prefill_instance_served(server)
    else:
        yield (), {}, lambda server: None


def _traced(collector: OtlpCollector) -> None:
    """Every row's engine requests were recorded: llm_request spans with their phases reached the collector."""
    deadline = time.monotonic() + 20
    while len({s.name for s in collector.spans if s.name in ("llm_request", "queue", "prefill", "decode")}) < 4:
        assert time.monotonic() < deadline, f"spans collected: {sorted({s.name for s in collector.spans})}"
        time.sleep(0.1)
    assert all(s.attributes.get("gen_ai.request.id") for s in collector.spans if s.name == "llm_request")


def _every_prefill_instance_served(server) -> None:
    instances = httpx.get(f"{server.url}/router/instances", timeout=10).json()["instances"]
    prefill = [i["url"] for i in instances if i["role"] == "prefill"]
    assert len(prefill) == 2, instances
    assert all(metric(url, "splitserve:prompt_tokens_total") > 0 for url in prefill), prefill


def _accepted_drafts(server) -> None:
    assert metric(server, "splitserve:spec_decode_num_accepted_tokens_total") > 0


@pytest.fixture(scope="module")
def column(request, tiny_chat_model, tmp_path_factory) -> str:
    """The column's server (started once for all its rows, closed after them): its URL. Its output
    (every process's: the router's, the instances', the replicas', the API workers') holds no traceback."""
    args, log = COLUMNS[request.param], tmp_path_factory.mktemp("matrix") / f"{request.param}.log"
    with _service(request.param) as (extra, env, check):
        with RemoteServer(tiny_chat_model, *COMMON, *args, *extra, env=env, log_path=str(log)) as server:
            yield server.url
            check(server)
    _no_traceback(log)


@pytest.mark.parametrize("column", COLUMNS, indirect=True)
@pytest.mark.parametrize("row", ROWS)
def test_every_request_kind_on_every_deployment(request, reference, column, row):
    pair = (request.node.callspec.params["column"], row)
    if pair in XFAIL:  # strict: the test fails once the bug is fixed, and the entry goes
        request.applymarker(pytest.mark.xfail(strict=True, reason=XFAIL[pair]))
    if isinstance(reference[row], Exception):
        raise reference[row]
    answer = ROWS[row](column, reference)
    differences = _differences(answer, reference[row], rank_places=RANK_PLACES.get(pair[0], 0))
    assert not differences, differences
