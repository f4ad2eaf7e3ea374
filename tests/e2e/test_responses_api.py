"""OpenAI's Responses API (/v1/responses) through the official `openai` SDK, unchanged: the same
greedy text as chat completions for the same conversation, whole and streamed (OpenAI's event
sequence), max_output_tokens (incomplete), instructions, a conversation continued with
previous_response_id, stored responses read and deleted, a function call round trip, structured
output, a background response cancelled, and OpenAI's error body for bad requests."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts a server

# Batch-invariant numerics: the embedded model's greedy tokens then do not depend on what shares a step.
ARGS = ["--batch-invariant", "--max-model-len", "2048", "--num-gpu-blocks-override", "256", "--disable-log-requests"]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(default_gguf):
    """The embedded model: a random one wanders inside a tool call's JSON whitespace."""
    with RemoteServer(default_gguf, *ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def _chat(client, messages, **kw) -> str:
    answer = client.chat.completions.create(model="default", messages=messages, temperature=0, **kw)
    return answer.choices[0]


def test_text_whole_and_streamed_match_chat(client):
    chat = _chat(
        client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], max_tokens=12
    )
    response = client.responses.create(
        model="default", input="Hello", instructions="Be brief.", temperature=0, max_output_tokens=12
    )
    assert response.output_text == chat.message.content and response.object == "response"
    assert response.status == ("incomplete" if chat.finish_reason == "length" else "completed")
    assert response.usage.output_tokens <= 12 and response.usage.input_tokens > 0
    events = list(
        client.responses.create(
            model="default", input="Hello", instructions="Be brief.", temperature=0, max_output_tokens=12, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1].startswith("response.")
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat.message.content
    assert events[-1].response.output_text == chat.message.content
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(model="default", input="My name is Ada.", temperature=0, max_output_tokens=8)
    second = client.responses.create(
        model="default", input="What is my name?", temperature=0, max_output_tokens=8, previous_response_id=first.id
    )
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.output_text == _chat(client, messages, max_tokens=8).message.content
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="default", input="x", previous_response_id=first.id)
    unstored = client.responses.create(model="default", input="hi", max_output_tokens=2, store=False)
    assert httpx.get(f"{server.url}/v1/responses/{unstored.id}").status_code == 404


def test_function_call_round_trip(client):
    response = client.responses.create(
        model="default",
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    followup = client.responses.create(
        model="default",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}],
        max_output_tokens=4,
    )
    assert followup.status in ("completed", "incomplete")


def test_structured_output(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model="default",
        input="A number:",
        max_output_tokens=30,
        text={"format": {"type": "json_schema", "name": "num", "schema": schema}},
    )
    assert isinstance(json.loads(response.output_text)["n"], int)


def test_background_response_can_be_cancelled(client):
    response = client.responses.create(
        model="default", input="Count:", background=True, max_output_tokens=1500, extra_body={"ignore_eos": True}
    )
    assert response.status == "in_progress"
    time.sleep(0.3)
    cancelled = client.responses.cancel(response.id)
    assert cancelled.status == "cancelled"
    done = client.responses.create(model="default", input="Hi", background=True, max_output_tokens=3)
    for _ in range(100):
        if client.responses.retrieve(done.id).status != "in_progress":
            break
        time.sleep(0.1)
    assert client.responses.retrieve(done.id).status in ("completed", "incomplete")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": []}, "input"),
    ],
)
def test_errors_are_400s(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "default", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
