"""OpenAI's Responses API as the server reads it: the request body, the translation of a request
(with the conversation of its `previous_response_id`) into the chat completion request that asks
the same, the response object built from a chat answer, and the store of responses
(serving_responses.py serves the routes)."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.request_model import RequestModel


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(RequestModel):
    """POST /v1/responses. `input` is a text or a list of items: messages ({"role", "content"}, a
    content being a text or input_text / output_text parts), function_call and function_call_output."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_schema" | "json_object", ...}}
    metadata: dict[str, str] | None = None
    user: str | None = None
    request_id: str | None = None  # vLLM's: the client's id for /abort_requests
    # vLLM's sampling extensions, passed on to the chat request as they are
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop: str | list[str] | None = None


class ResponseObject(BaseModel):
    """The response (the whole of it, as GET /v1/responses/{id} answers)."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "queued", "cancelled", "failed"]
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    background: bool = False


# --- request -> chat -----------------------------------------------------------------------------
def _content(content: Any, where: str) -> str | list[dict]:
    """A message's content as chat content: its text, or with input_image parts the parts in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}: content must be a text or a list of content parts.", param="input")
    parts = [_part(part, where) for part in content]
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _part(part: Any, where: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": str(part.get("text", ""))}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    if kind == "input_image":
        raise APIError(f"{where}: an input_image part needs its image_url (file_id is not supported).", param="input")
    raise APIError(
        f"{where}: content parts of type {kind!r} are not supported (text and input_image are).", param="input"
    )


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's input as chat messages (without the instructions)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict] = []
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(f"input[{i}]: role must be user, assistant, system or developer.", param="input")
            content = _content(item.get("content", ""), f"input[{i}]")
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function"}
            call["function"] = {"name": item.get("name", ""), "arguments": item.get("arguments", "{}")}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            content = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":
            continue  # a reasoning item handed back: the template re-renders no reasoning
        else:
            raise APIError(f"input[{i}]: items of type {kind!r} are not supported.", param="input")
    if not messages:
        raise APIError("input must not be empty.", param="input")
    return messages


def to_chat_body(req: ResponsesRequest, history: list[dict]) -> dict:
    """The chat completion request that asks what `req` asks, after the earlier turns `history`."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += history + input_messages(req)
    body: dict = {"model": req.model, "messages": messages, "stream": req.stream and not req.background}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    for field in ("top_k", "min_p", "seed", "repetition_penalty", "ignore_eos", "stop"):
        if getattr(req, field) is not None:
            body[field] = getattr(req, field)
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if req.request_id:
        body["request_id"] = req.request_id
    if req.tools:
        body["tools"] = [_chat_tool(t, i) for i, t in enumerate(req.tools)]
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.tool_choice is not None:
        choice = req.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice.get("name", "")}}
        body["tool_choice"] = choice
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name", "output"), "schema": fmt.get("schema", {}), "strict": fmt.get("strict")}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt.get("type") != "text":
        raise APIError(f"text.format type {fmt.get('type')!r} is not supported.", param="text")
    return body


def _chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise APIError(f"tools[{i}]: only function tools are supported, not {tool.get('type')!r}.", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


# --- chat -> response ----------------------------------------------------------------------------
def output_items(message: dict) -> list[dict]:
    """A chat answer's message as Responses output items: reasoning, the message, function calls."""
    items: list[dict] = []
    if message.get("reasoning_content"):
        text = message["reasoning_content"]
        items.append({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [reasoning_part(text)]})
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(function_call_item(new_id("fc"), call["id"], function["name"], function["arguments"]))
    return items


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [text_part(text)]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage_of(chat_usage: dict | None) -> dict:
    usage = chat_usage or {}
    details = usage.get("prompt_tokens_details") or {}
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage.get("total_tokens", 0),
    }


def response_object(req: ResponsesRequest, response_id: str, model: str, status: str, **fields) -> ResponseObject:
    """The response object for `req`, its request fields echoed as OpenAI does."""
    text = req.text or {"format": {"type": "text"}}
    return ResponseObject(
        id=response_id,
        created_at=int(time.time()),
        status=status,
        model=model,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        tools=req.tools or [],
        tool_choice=req.tool_choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls,
        previous_response_id=req.previous_response_id,
        text=text,
        metadata=req.metadata or {},
        store=req.store,
        background=req.background,
        **fields,
    )


def finish_status(finish_reason: str | None) -> tuple[str, dict | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


# --- the store -------------------------------------------------------------------------------------
class ResponseStore:
    """Stored responses (store=true) and the conversation each ends, for previous_response_id and
    GET / DELETE / cancel: at most `capacity` of them, each for `ttl` seconds after it was stored;
    the oldest go first. One per API worker process."""

    def __init__(self, capacity: int = 1000, ttl: float = 3600.0):
        self.capacity, self.ttl = capacity, ttl
        self._items: OrderedDict[str, tuple[float, ResponseObject, list[dict]]] = OrderedDict()

    def put(self, response: ResponseObject, conversation: list[dict]) -> None:
        self._items[response.id] = (time.monotonic(), response, conversation)
        self._items.move_to_end(response.id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[ResponseObject, list[dict]] | None:
        item = self._items.get(response_id)
        if item is None:
            return None
        if time.monotonic() - item[0] > self.ttl:
            del self._items[response_id]
            return None
        return item[1], item[2]

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
