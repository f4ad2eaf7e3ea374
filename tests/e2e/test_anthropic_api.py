"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through the official `anthropic`
SDK, unchanged: the same greedy text as the chat completions route for the same conversation, whole
and streamed (Anthropic's event sequence), stop sequences, token counts, a tool round trip
(tool_use, then tool_result), and Anthropic's error body for a bad request."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts a server

# Batch-invariant numerics: the embedded model's greedy tokens then do not depend on what shares a step.
COMMON = ["--batch-invariant", "--max-model-len", "1024", "--num-gpu-blocks-override", "256", "--disable-log-requests"]
KEY = "anthropic-test-key"
# The SDK (2.x) no longer has sampling arguments; the API still takes them, as older SDKs send them.
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(default_gguf):
    """The embedded model: a random one wanders inside a tool call's JSON whitespace."""
    with RemoteServer(default_gguf, *COMMON, "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)  # sends x-api-key


def _chat_text(server, messages: list[dict], max_tokens: int = 12) -> str:
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    answer = chat.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens, temperature=0)
    return answer.choices[0].message.content


def test_a_message_is_the_chat_routes_answer(server, client):
    message = client.messages.create(
        model="default",
        max_tokens=12,
        extra_body=GREEDY,
        system="You are terse.",
        messages=[
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        ],
    )
    expected = _chat_text(
        server,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Name a colour."},
        ],
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "text" and message.content[0].text == expected
    assert message.stop_reason in ("max_tokens", "end_turn") and message.usage.output_tokens > 0
    assert (
        message.usage.input_tokens
        == client.messages.count_tokens(
            model="default",
            system="You are terse.",
            messages=[
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Name a colour."},
            ],
        ).input_tokens
    )


def test_streamed_events_add_up_to_the_message(client):
    kwargs = {
        "model": "default",
        "max_tokens": 12,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert [b.text for b in final.content] == [b.text for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_end_the_message(client):
    base = {
        "model": "default",
        "max_tokens": 24,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "Count"}],
    }
    text = client.messages.create(**base).content[0].text
    stop = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[:2]
    message = client.messages.create(**base, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text


def test_a_tool_round_trip(client):
    """A forced tool call comes back as a tool_use block with its input, whole and streamed; its
    tool_result goes in the next turn and the model answers in text."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    call = client.messages.create(model="default", max_tokens=64, extra_body=GREEDY, messages=ask, **forced)
    uses = [b for b in call.content if b.type == "tool_use"]
    assert call.stop_reason == "tool_use" and len(uses) == 1, call
    assert uses[0].name == "get_weather" and uses[0].input["city"] in ("Paris", "Rome")
    with client.messages.stream(model="default", max_tokens=64, extra_body=GREEDY, messages=ask, **forced) as s:
        streamed = s.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(uses[0].name, uses[0].input)]
    assert streamed.stop_reason == "tool_use"
    answer = client.messages.create(
        model="default",
        max_tokens=16,
        extra_body=GREEDY,
        tools=[WEATHER],
        messages=[
            *ask,
            {"role": "assistant", "content": [b.model_dump() for b in call.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]},
        ],
    )
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text


def test_a_bad_request_gets_anthropics_error_body(server, client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="default", max_tokens=0, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{server.url}/v1/messages",
        headers={"x-api-key": KEY},
        json={"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        timeout=30,
    )
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
    assert httpx.post(f"{server.url}/v1/messages", json={}, timeout=30).status_code == 401


def test_through_a_pd_router(default_gguf, client):
    """`serve --pd 1p1d`: the router translates, prefill and decode run as for a chat completion, and
    the message (whole and streamed) is the deployment's own chat answer. (Compared within one
    deployment: the embedded model's greedy text may differ between deployments on some CPUs.)"""
    kwargs = {
        "model": "default",
        "max_tokens": 10,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    with RemoteServer(default_gguf, *COMMON, "--pd", "1p1d", "--api-key", KEY) as router:
        through = anthropic.Anthropic(base_url=router.url, api_key=KEY, max_retries=0)
        message = through.messages.create(**kwargs)
        with through.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        counted = through.messages.count_tokens(model="default", messages=kwargs["messages"]).input_tokens
        expected = _chat_text(router, kwargs["messages"], max_tokens=10)
    assert [b.text for b in message.content] == [expected]
    assert [b.text for b in streamed.content] == [expected]
    assert counted == message.usage.input_tokens == client.messages.create(**kwargs).usage.input_tokens
