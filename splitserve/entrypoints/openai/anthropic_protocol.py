"""Anthropic's Messages API as the server reads it: the request and answer bodies (pydantic
models, also the OpenAPI document's), Anthropic's error body, and the translation of a request into
the chat completion request that asks the same (serving_anthropic.py serves it and translates the
answer back)."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.request_model import validation_error_message

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


# --- the request --------------------------------------------------------------------------------
class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[_Block]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control and the like
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")  # disable_parallel_tool_use
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class AnthropicMessagesRequest(BaseModel):
    """POST /v1/messages; count_tokens takes the same body without max_tokens."""

    model_config = ConfigDict(extra="allow")  # metadata, service_tier ...: accepted, unused
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[_Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None


class AnthropicCountTokensRequest(AnthropicMessagesRequest):
    max_tokens: int = Field(default=1, ge=1)


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicMessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def anthropic_error(message: str, status: int) -> JSONResponse:
    error = {"type": ERROR_TYPES.get(status, "api_error"), "message": message}
    return JSONResponse({"type": "error", "error": error}, status_code=status)


def _text(blocks: str | list[_Block] | None, where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    parts = []
    for block in blocks:
        if block.type != "text" or not isinstance(getattr(block, "text", None), str):
            raise APIError(f"{where} may hold only text blocks, not {block.type!r}.", param=where)
        parts.append(block.text)
    return "\n".join(parts)


def _image_part(block: _Block, i: int) -> dict:
    """An image block as a chat image_url part: a base64 source as a data URI, a url source as it is."""
    source = getattr(block, "source", None)
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise APIError(
        f"messages[{i}]: an image block's source must be base64 (media_type, data) or url.", param="messages"
    )


def _user_turn(content: str | list[_Block], i: int) -> list[dict]:
    """A user turn: its tool results first (one tool message each), then its text and images."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    messages, texts, parts = [], [], []
    for block in content:
        if block.type == "tool_result":
            call_id = getattr(block, "tool_use_id", None)
            if not isinstance(call_id, str):
                raise APIError(f"messages[{i}]: a tool_result block needs its tool_use_id.", param="messages")
            result = getattr(block, "content", "")
            try:
                blocks = [_Block.model_validate(b) for b in result] if isinstance(result, list) else result
            except ValidationError:
                raise APIError(f"messages[{i}]: a tool_result's content must be text or text blocks.") from None
            if not isinstance(blocks, (str, list)):
                raise APIError(f"messages[{i}]: a tool_result's content must be text or text blocks.")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(blocks, "tool_result")})
        elif block.type == "text" and isinstance(getattr(block, "text", None), str):
            texts.append(block.text)
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image":
            parts.append(_image_part(block, i))
        else:
            raise APIError(
                f"messages[{i}]: content blocks of type {block.type!r} are not supported (text, image and "
                "tool_result are).",
                param="messages",
            )
    if len(parts) > len(texts):  # images: the parts in their order, for a vision-language model
        messages.append({"role": "user", "content": parts})
    elif texts or not messages:
        messages.append({"role": "user", "content": "\n".join(texts)})
    return messages


def _assistant_turn(content: str | list[_Block], i: int) -> dict:
    """An assistant turn: its text and the tools it called (thinking blocks are left out)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls = [], []
    for block in content:
        if block.type == "text" and isinstance(getattr(block, "text", None), str):
            texts.append(block.text)
        elif block.type == "tool_use":
            name, call_input = getattr(block, "name", None), getattr(block, "input", {})
            if not isinstance(name, str) or not isinstance(call_input, dict):
                raise APIError(f"messages[{i}]: a tool_use block needs a name and an input object.", param="messages")
            call_id = getattr(block, "id", None) or f"toolu_{i}_{len(calls)}"
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(call_input)}}
            )
        elif block.type not in ("thinking", "redacted_thinking"):
            raise APIError(
                f"messages[{i}]: content blocks of type {block.type!r} are not supported in an assistant turn.",
                param="messages",
            )
    message: dict = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def to_chat_body(req: AnthropicMessagesRequest) -> dict:
    """The chat completion request that asks what `req` asks."""
    messages = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    for i, turn in enumerate(req.messages):
        if turn.role == "user":
            messages += _user_turn(turn.content, i)
        else:
            messages.append(_assistant_turn(turn.content, i))
    body: dict = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens, "stream": req.stream}
    for field in ("temperature", "top_p", "top_k"):
        if getattr(req, field) is not None:
            body[field] = getattr(req, field)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
            }
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None and (req.tools or choice.type == "none"):
        if choice.type == "tool":
            if not choice.name:
                raise APIError('tool_choice {"type": "tool"} needs the tool\'s name.', param="tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.get("type") == "enabled"}
    return body


def parse_request(model: type[AnthropicMessagesRequest], body: dict) -> AnthropicMessagesRequest:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, _ = validation_error_message(exc)
        raise APIError(message) from None
