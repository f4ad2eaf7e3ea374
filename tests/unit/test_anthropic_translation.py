"""Anthropic's Messages API onto chat completions and back (serving_anthropic.py), without a model:
the request's turns, blocks and tools; the answer's blocks and stop reasons; the event sequence a
chat stream becomes."""

from __future__ import annotations

import asyncio
import json

import pytest

from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.anthropic_protocol import (
    AnthropicMessagesRequest,
    to_chat_body,
)
from splitserve.entrypoints.openai.serving_anthropic import (
    anthropic_events,
    to_message,
)


def _req(**fields) -> AnthropicMessagesRequest:
    return AnthropicMessagesRequest.model_validate({"model": "m", "max_tokens": 5, **fields})


def test_turns_blocks_and_tools_become_a_chat_request():
    req = _req(
        system=[{"type": "text", "text": "Be brief."}],
        stop_sequences=["\n\n"],
        temperature=0.5,
        tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any"},
        messages=[
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "42"}]},
                    {"type": "text", "text": "and?"},
                ],
            },
        ],
    )
    body = to_chat_body(req)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "42"},
        {"role": "user", "content": "and?"},
    ]
    assert body["stop"] == ["\n\n"] and body["temperature"] == 0.5 and body["max_tokens"] == 5
    assert body["tools"][0]["function"] == {"name": "f", "description": "d", "parameters": {"type": "object"}}
    assert body["tool_choice"] == "required"
    named = to_chat_body(
        _req(messages=[{"role": "user", "content": "q"}], tools=req.tools, tool_choice={"type": "tool", "name": "f"})
    )
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    "content, message",
    [
        ([{"type": "document", "source": {}}], "'document' are not supported"),
        ([{"type": "image", "source": {}}], "source must be base64"),
        ([{"type": "tool_result", "content": "x"}], "tool_use_id"),
    ],
)
def test_unsupported_blocks_are_refused_by_name(content, message):
    with pytest.raises(APIError, match=message):
        to_chat_body(_req(messages=[{"role": "user", "content": content}]))


def test_image_blocks_become_image_url_parts_in_order():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}
    linked = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    content = [{"type": "text", "text": "Compare"}, image, linked]
    body = to_chat_body(_req(messages=[{"role": "user", "content": content}]))
    assert body["messages"][-1]["content"] == [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]


def test_a_chat_answer_becomes_a_message():
    chat = {
        "id": "chatcmpl-abc",
        "choices": [
            {
                "message": {
                    "content": "ok",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": 2}'}}],
                },
                "finish_reason": "tool_calls",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3},
    }
    message = to_message(chat, "m").model_dump()
    assert message["id"] == "msg_abc" and message["stop_reason"] == "tool_use"
    assert message["content"] == [
        {"type": "text", "text": "ok"},
        {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 2}},
    ]
    assert message["usage"] == {"input_tokens": 7, "output_tokens": 3}
    stopped = {**chat, "choices": [{"message": {"content": "x"}, "finish_reason": "stop", "stop_reason": "END"}]}
    assert to_message(stopped, "m").stop_reason == "stop_sequence" and to_message(stopped, "m").stop_sequence == "END"
    length = {**chat, "choices": [{"message": {"content": "x"}, "finish_reason": "length", "stop_reason": None}]}
    assert to_message(length, "m").stop_reason == "max_tokens"


def _sse(*chunks) -> list[str]:
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


async def _aiter(items):
    for item in items:
        yield item


def _events(chunks) -> list[tuple[str, dict]]:
    async def collect():
        return [e async for e in anthropic_events(_aiter(chunks), "m")]

    out = []
    for raw in asyncio.run(collect()):
        name, data = raw.strip().split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_chat_stream_becomes_anthropics_event_sequence():
    usage = {"prompt_tokens": 4, "completion_tokens": 0}
    events = _events(
        _sse(
            {"id": "chatcmpl-s", "choices": [{"delta": {"role": "assistant", "content": ""}}], "usage": usage},
            {"id": "chatcmpl-s", "choices": [{"delta": {"content": "Hel"}}]},
            {"id": "chatcmpl-s", "choices": [{"delta": {"content": "lo"}}]},
            {
                "choices": [
                    {"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]}}
                ]
            },
            {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}}]},
            {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}}]},
            {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
            {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9}},
        )
    )
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 4 and events[0][1]["message"]["id"] == "msg_s"
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert "".join(d["delta"]["text"] for n, d in events[2:4]) == "Hello"
    assert events[5][1] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "c1", "name": "f", "input": {}},
    }
    assert "".join(d["delta"]["partial_json"] for n, d in events[6:8]) == '{"a": 1}'
    assert events[9][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[9][1]["usage"] == {"output_tokens": 9}


def test_an_error_in_the_chat_stream_becomes_an_error_event():
    error = {"error": {"message": "The engine is restarting", "type": "service_unavailable", "code": 503}}
    events = _events([f"data: {json.dumps(error)}\n\n", "data: [DONE]\n\n"])
    assert events == [
        ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "The engine is restarting"}})
    ]
