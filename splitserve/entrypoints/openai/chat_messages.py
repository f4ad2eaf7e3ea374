"""The messages and tools of a chat request: text and image content (parts of other kinds are refused
by name), assistant messages that called tools and the tool messages that answer them, and the tools
a request offers (OpenAI's function tools) with its tool choice."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from splitserve.entrypoints.openai.request_model import RequestModel


class TextContentPart(RequestModel):
    model_config = ConfigDict(**RequestModel.model_config, json_schema_extra={"additionalProperties": False})

    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str  # a data: URI, a file:// URL or path (--allowed-local-media-path), or an http(s) URL
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; the model's processor decides the size


class ImageURLContentPart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


# Chosen by `type`, so that a part is validated (and its fields checked) only as its own kind.
ContentPart = Annotated[TextContentPart | ImageURLContentPart, Field(discriminator="type")]


def _check_content(value: Any) -> Any:
    """Message content: a string, or text and image_url parts. Checked by hand so that an audio or
    other part gets an error naming its type instead of a list of failed union members."""
    if isinstance(value, str) or value is None:
        return value
    if not isinstance(value, list):
        raise ValueError("message 'content' must be a string or a list of content parts.")
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            url = part.get("image_url")
            if set(part) != {"type", "image_url"} or not isinstance(url, dict) or not isinstance(url.get("url"), str):
                raise ValueError(
                    "an 'image_url' content part must be {'type': 'image_url', 'image_url': {'url': ...}}."
                )
            continue
        if kind != "text":
            raise ValueError(
                f"content part type {kind!r} is not supported: only {{'type': 'text', 'text': ...}} and "
                "{'type': 'image_url', 'image_url': {'url': ...}} parts are accepted."
            )
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise ValueError("a 'text' content part must be exactly {'type': 'text', 'text': <string>}.")
    return value


class FunctionCallParam(RequestModel):
    name: str
    arguments: str  # JSON, as OpenAI returned it


class ToolCallParam(RequestModel):
    """A tool call an earlier assistant message made, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(RequestModel):
    """One message of a conversation. An assistant message may carry the tool calls it made (and no
    content); a tool message answers one of them by `tool_call_id`."""

    # In the OpenAPI document: content is required, unless an assistant message gives tool_calls.
    model_config = ConfigDict(
        **RequestModel.model_config,
        json_schema_extra={
            "anyOf": [
                {
                    "required": ["content"],
                    "properties": {"content": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}},
                },
                {
                    "required": ["role", "tool_calls"],
                    "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
                },
            ],
            # only an assistant message carries tool_calls
            "dependentSchemas": {"tool_calls": {"properties": {"role": {"const": "assistant"}}}},
        },
    )

    role: Literal["system", "user", "assistant", "developer", "tool"]
    tool_calls: list[ToolCallParam] | None = None  # before content: content's check reads it
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None

    _content = field_validator("content", mode="before")(_check_content)

    @field_validator("tool_calls")
    @classmethod
    def _only_assistants_call_tools(cls, value: list[ToolCallParam] | None, info: ValidationInfo):
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry 'tool_calls'.")
        return value

    @field_validator("content")
    @classmethod
    def _content_given(cls, value, info: ValidationInfo):
        if value is None and not info.data.get("tool_calls"):
            raise ValueError("message 'content' is required (an assistant message may give 'tool_calls' instead).")
        return value

    def text(self) -> str:
        """The content as one string: text parts joined with newlines (images left out)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content if part.type == "text")

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(part.type == "image_url" for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it. "developer" (OpenAI's newer name for the system
        role) becomes "system": templates know only the older name and many raise on unknown roles.
        Tool call arguments are given as objects, as the templates of tool-calling models read them
        (vLLM does the same)."""
        content = [part.model_dump(exclude_none=True) for part in self.content] if self.has_images() else self.text()
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_template_tool_call(call) for call in self.tool_calls]
        return message


def _template_tool_call(call: ToolCallParam) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments  # a template may still print it as written
    out = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        out["id"] = call.id
    return out


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatCompletionTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


def template_kwargs(req) -> dict:
    """The request's chat_template_kwargs, and its tools (chat requests only) as templates read them."""
    kwargs = dict(req.chat_template_kwargs or {})
    tools = getattr(req, "tools", None)
    if tools:
        kwargs.setdefault("tools", [tool.model_dump(exclude_none=True) for tool in tools])
    return kwargs
