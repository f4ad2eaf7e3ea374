"""What everyday clients and the deployment guides send, end to end against a server of the
embedded model: structured output (the Ascend guide's guided_json request, response_format through
the openai client's parse, regex, choice, grammar), tool calling (required, named, auto with the
hermes parser, streamed deltas, tool messages in the history), beam search and best_of, vLLM's
native /generate, and unknown fields (ignored, or refused with --strict-request-fields)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from splitserve import LLM, BeamSearchParams
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts servers

KNIGHT_SCHEMA = {
    "title": "Character",
    "type": "object",
    "properties": {
        "name": {"title": "Name", "maxLength": 10, "type": "string"},
        "age": {"title": "Age", "type": "integer"},
        "armor": {"$ref": "#/definitions/Armor"},
        "weapon": {"$ref": "#/definitions/Weapon"},
        "strength": {"title": "Strength", "type": "integer"},
    },
    "required": ["name", "age", "armor", "weapon", "strength"],
    "definitions": {
        "Armor": {
            "title": "Armor",
            "description": "An enumeration.",
            "enum": ["leather", "chainmail", "plate"],
            "type": "string",
        },
        "Weapon": {
            "title": "Weapon",
            "description": "An enumeration.",
            "enum": ["sword", "axe", "mace", "spear", "bow", "crossbow"],
            "type": "string",
        },
    },
}
KNIGHT_PROMPT = (
    "Meet our valorous character, named Knight, who has reached the age of 32. Clad in impenetrable plate armor, "
    "Knight is well-prepared for any battle. Armed with a trusty sword and boasting a strength score of 90, this "
    "character stands as a formidable warrior on the field.Please provide details for this character, including "
    "their Name, Age, preferred Armor, Weapon, and Strength"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string", "maxLength": 12}},
                "required": ["tz"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    # Batch-invariant numerics: a streamed request and the same one not streamed share their steps
    # with whatever else is in flight, yet must give the same greedy tokens on every CPU.
    with RemoteServer(
        None,
        "serve",
        "--batch-invariant",
        "--max-model-len",
        "1024",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--disable-log-requests",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def tiny_server(tiny_models):
    """A float32 tiny model's server that refuses fields it does not know."""
    with RemoteServer(
        tiny_models["llama"], "--dtype", "float32", "--max-model-len", "128", "--strict-request-fields"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


# --- structured output -------------------------------------------------------------------------
def test_the_guides_knight_request(server):
    """The Ascend guide's curl body, model name aside: the answer parses and validates."""
    body = {"prompt": KNIGHT_PROMPT, "max_tokens": 200, "temperature": 0, "guided_json": json.dumps(KNIGHT_SCHEMA)}
    answer = json.loads(_post(server, "/v1/completions", body).json()["choices"][0]["text"])
    jsonschema.validate(answer, KNIGHT_SCHEMA)


def test_response_format_through_the_clients_parse(client):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)

    completion = client.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": "Name a city and its country."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    assert isinstance(completion.choices[0].message.parsed, City)


@pytest.mark.parametrize(
    "field, value, check",
    [
        ("guided_regex", r"\d{3}-\d{4}", lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        ("guided_choice", ["yes", "no"], lambda t: t in ("yes", "no")),
        ("guided_grammar", 'root ::= ("a" | "b") ("a" | "b")? "!"', lambda t: re.fullmatch(r"[ab]{1,2}!", t)),
        ("response_format", {"type": "json_object"}, lambda t: isinstance(json.loads(t), dict)),
    ],
)
def test_chat_guides(client, field, value, check):
    # A short answer to copy: a 135M model may otherwise ramble inside a JSON string past max_tokens.
    messages = [{"role": "user", "content": 'Repeat exactly: {"city": "Paris"}'}]
    out = client.chat.completions.create(
        model="default", messages=messages, max_tokens=100, temperature=0, extra_body={field: value}
    )
    assert out.choices[0].finish_reason == "stop" and check(out.choices[0].message.content)


def test_streamed_guided_output_parses(server):
    body = {"prompt": KNIGHT_PROMPT, "max_tokens": 200, "temperature": 0, "stream": True, "guided_json": KNIGHT_SCHEMA}
    text = ""
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    jsonschema.validate(json.loads(text), KNIGHT_SCHEMA)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_bad_guides_are_400s_naming_the_field(server, body, param):
    r = _post(server, "/v1/completions", {"prompt": "Hi", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


# --- tools -------------------------------------------------------------------------------------
def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed_calls(client, **kwargs) -> tuple[list[tuple[str, dict]], str]:
    calls, reason = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0] if chunk.choices else None
        for delta in (choice.delta.tool_calls or []) if choice else []:
            entry = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            entry["name"] = entry["name"] or delta.function.name
            entry["arguments"] += delta.function.arguments or ""
        reason = (choice.finish_reason if choice else None) or reason
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], reason


@pytest.mark.parametrize(
    "tool_choice, reason",
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_time"}}, "stop")],
)
def test_forced_tool_calls_always_parse(client, tool_choice, reason):
    kwargs = dict(model="default", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=100, temperature=0)
    out = client.chat.completions.create(**kwargs)
    calls = _calls(out.choices[0].message)
    assert calls and out.choices[0].finish_reason == reason and out.choices[0].message.content is None
    for name, arguments in calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(arguments, schema)
    assert _streamed_calls(client, **kwargs) == (calls, reason)


def test_auto_tool_choice_reads_hermes_calls(client):
    """The model's text is pinned to a hermes call with a regex, so the parser's work is what is tested."""
    hermes = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "c"\}\}\n</tool_call>'
    kwargs = dict(
        model="default", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0, extra_body={"guided_regex": hermes}
    )
    out = client.chat.completions.create(**kwargs)
    expected = [("get_weather", {"city": "Paris", "unit": "c"})]
    assert _calls(out.choices[0].message) == expected and out.choices[0].finish_reason == "tool_calls"
    assert _streamed_calls(client, **kwargs) == (expected, "tool_calls")


def test_tool_results_in_the_history(client):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    out = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0
    )
    assert out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")


# --- beam search, best_of, /generate, fields -----------------------------------------------------
def test_beam_search_matches_the_offline_api(tiny_server, tiny_models):
    """The served search is the offline one. Compared on a float32 model: the default model's
    bfloat16 logits (steps of 0.125) and its quantized products, whose numerics follow the batch's
    row count (integer products for a few rows, dequantized tiles for more; docs/serving.md), let
    near-tied beams swap with the batching of a step, which an HTTP client does not control."""
    prompt_ids = [5, 6, 7, 8]
    body = {
        "prompt": prompt_ids,
        "max_tokens": 6,
        "temperature": 0,
        "use_beam_search": True,
        "n": 2,
        "best_of": 3,
        "top_k": -1,
        "length_penalty": 0.8,
        "return_token_ids": True,
    }
    choices = _post(tiny_server, "/v1/completions", body).json()["choices"]
    llm = LLM(tiny_models["llama"], dtype="float32", max_model_len=128, use_tqdm_on_load=False)
    offline = llm.beam_search(
        [{"prompt_token_ids": prompt_ids}], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.8)
    )[0]
    assert [c["token_ids"] for c in choices] == [s.tokens[len(prompt_ids) :] for s in offline.sequences[:2]]


def test_beam_search_of_the_default_model(server):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "use_beam_search": True}
    choices = _post(server, "/v1/completions", {**body, "n": 2, "best_of": 3, "return_token_ids": True}).json()[
        "choices"
    ]
    assert [c["index"] for c in choices] == [0, 1] and len({tuple(c["token_ids"]) for c in choices}) == 2
    assert all(c["text"].startswith(" Paris") and len(c["token_ids"]) == 6 for c in choices)


def test_best_of_returns_the_n_best_samples(server):
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "temperature": 1.0,
        "n": 2,
        "best_of": 4,
        "seed": 1,
        "ignore_eos": True,
        "logprobs": 0,
    }
    out = _post(server, "/v1/completions", body).json()
    sums = [sum(out_lp for out_lp in c["logprobs"]["token_logprobs"]) for c in out["choices"]]
    assert len(out["choices"]) == 2 and sums[0] >= sums[1] and out["usage"]["completion_tokens"] == 20


def test_native_generate(server):
    whole = _post(server, "/generate", {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0})
    text = whole.json()["text"]
    assert len(text) == 1 and text[0].startswith("The capital of France is")
    lines = []
    with httpx.stream(
        "POST",
        f"{server.url}/generate",
        timeout=60,
        json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "stream": True},
    ) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["text"] == text and len(lines) > 1


def test_unknown_fields_are_ignored(server):
    r = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "some_new_field": 1, "length_penalty": 1.0})
    assert r.status_code == 200


def test_strict_request_fields_refuse_them(tiny_server):
    r = _post(tiny_server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "some_new_field": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "some_new_field"
