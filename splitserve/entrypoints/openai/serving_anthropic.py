"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what the `anthropic` SDK and
Claude Code send), served by the chat completions path: a request is translated into a chat
completion request (anthropic_protocol.py), and the answer, whole or streamed, back into Anthropic's
message and its event sequence (message_start, content_block_start/delta/stop, message_delta,
message_stop). Errors have Anthropic's body, `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.anthropic_protocol import (
    ERROR_TYPES,
    AnthropicCountTokensRequest,
    AnthropicMessageResponse,
    AnthropicMessagesRequest,
    AnthropicTokenCount,
    AnthropicUsage,
    anthropic_error,
    parse_request,
    to_chat_body,
)

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


# --- the answer ---------------------------------------------------------------------------------
def _stop(finish_reason: str | None, stop_reason, called: bool = False) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish: a turn that ends with
    tool calls stops for "tool_use" (chat says "stop" for a named tool choice, "tool_calls" else)."""
    if finish_reason is None:
        return None, None
    if called and finish_reason in ("stop", "tool_calls"):
        return "tool_use", None
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def _tool_input(arguments: str | None) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def to_message(chat: dict, model: str) -> AnthropicMessageResponse:
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": _tool_input(call["function"]["arguments"]),
            }
        )
    called = bool(message.get("tool_calls"))
    stop_reason, stop_sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"), called)
    usage = chat.get("usage") or {}
    return AnthropicMessageResponse(
        id="msg_" + chat["id"].removeprefix("chatcmpl-"),
        model=model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=AnthropicUsage(
            input_tokens=usage.get("prompt_tokens", 0), output_tokens=usage.get("completion_tokens", 0)
        ),
    )


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


class _StreamState:
    """Turns chat chunks into Anthropic events: one content block open at a time (thinking, text, or
    one tool_use per call), closed when the next kind starts or the message ends."""

    def __init__(self, model: str):
        self.model = model
        self.started = False
        self.index = -1
        self.open: tuple[str, int | None] | None = None  # the open block's kind (and tool call index)
        self.finish: tuple[str | None, str | None] = (None, None)
        self.called = False  # a tool_use block was streamed
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}

    def _open(self, kind: str, block: dict, call: int | None = None) -> list[str]:
        events = self._close()
        self.index += 1
        self.open = (kind, call)
        return [*events, _event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def start(self, chunk: dict) -> list[str]:
        self.started = True
        self.usage = chunk.get("usage") or self.usage
        message = {
            "id": "msg_" + str(chunk.get("id", "")).removeprefix("chatcmpl-"),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.usage.get("prompt_tokens", 0), "output_tokens": 0},
        }
        return [_event("message_start", {"message": message})]

    def chunk(self, chunk: dict) -> list[str]:
        events = [] if self.started else self.start(chunk)
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != ("thinking", None):
                    events += self._open("thinking", {"type": "thinking", "thinking": ""})
                thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
                events.append(_event("content_block_delta", {"index": self.index, "delta": thinking}))
            if delta.get("content"):
                if self.open != ("text", None):
                    events += self._open("text", {"type": "text", "text": ""})
                text = {"type": "text_delta", "text": delta["content"]}
                events.append(_event("content_block_delta", {"index": self.index, "delta": text}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                self.called = True
                if self.open != ("tool_use", call.get("index")):
                    block = {
                        "type": "tool_use",
                        "id": call.get("id") or "",
                        "name": function.get("name") or "",
                        "input": {},
                    }
                    events += self._open("tool_use", block, call.get("index"))
                if function.get("arguments"):
                    partial = {"type": "input_json_delta", "partial_json": function["arguments"]}
                    events.append(_event("content_block_delta", {"index": self.index, "delta": partial}))
            if choice.get("finish_reason"):
                self.finish = _stop(choice["finish_reason"], choice.get("stop_reason"), self.called)
        return events

    def end(self) -> list[str]:
        events = [] if self.started else self.start({})
        stop_reason, stop_sequence = self.finish
        delta = {"stop_reason": stop_reason or "end_turn", "stop_sequence": stop_sequence}
        usage = {"output_tokens": self.usage.get("completion_tokens", 0)}
        return [
            *events,
            *self._close(),
            _event("message_delta", {"delta": delta, "usage": usage}),
            _event("message_stop", {}),
        ]


async def anthropic_events(chat_events: AsyncIterator, model: str) -> AsyncIterator[str]:
    """Anthropic's event stream from the chat stream's server-sent events (in chunks of any size)."""
    state, buffered = _StreamState(model), ""
    async for raw in chat_events:
        buffered += raw.decode() if isinstance(raw, bytes) else raw
        *complete, buffered = buffered.split("\n\n")
        for event in complete:
            payload = event.strip().removeprefix("data:").strip()
            if not payload:
                continue
            if payload == "[DONE]":
                for out in state.end():
                    yield out
                return
            chunk = json.loads(payload)
            if "error" in chunk:
                error = chunk["error"]
                body = {"type": ERROR_TYPES.get(error.get("code"), "api_error"), "message": error.get("message", "")}
                yield _event("error", {"error": body})
                return
            for out in state.chunk(chunk):
                yield out


def anthropic_answer(req: AnthropicMessagesRequest, answer: Response, wrap_stream=None) -> Response:
    """The chat route's answer (a JSON body, an OpenAI error, or a stream) as Anthropic's.
    `wrap_stream(events)` makes the streamed response (default: a plain StreamingResponse)."""
    if isinstance(answer, StreamingResponse) and answer.status_code == 200:
        events = anthropic_events(answer.body_iterator, req.model)
        return wrap_stream(events) if wrap_stream else StreamingResponse(events, media_type="text/event-stream")
    try:
        body = json.loads(answer.body)
    except (ValueError, AttributeError):
        body = None
    if answer.status_code != 200:
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return answer  # no body to translate (a client that left: 499)
        return anthropic_error(str(error.get("message", "")), answer.status_code)
    return JSONResponse(to_message(body, req.model).model_dump())


class AnthropicServing:
    """The two routes, over the chat completions endpoint (`chat`: OpenAIServingChat)."""

    def __init__(self, chat):
        self.chat = chat

    async def create_message(self, body: dict, raw: Request) -> Response:
        try:
            req = parse_request(AnthropicMessagesRequest, body)
            answer = await self.chat.create_chat_completion(to_chat_body(req), raw)
        except APIError as exc:
            return anthropic_error(exc.message, exc.status)
        return anthropic_answer(req, answer)

    async def count_tokens(self, body: dict) -> Response:
        try:
            req = parse_request(AnthropicCountTokensRequest, body)
            count = await self.chat.count_prompt_tokens(to_chat_body(req))
        except APIError as exc:
            return anthropic_error(exc.message, exc.status)
        return JSONResponse(AnthropicTokenCount(input_tokens=count).model_dump())
