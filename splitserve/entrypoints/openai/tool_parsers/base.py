"""Tool calls in the shapes of OpenAI's chat API, and the ToolParser base class that turns a model's
text into them, whole (`extract_tool_calls`) or delta by delta (`extract_streaming`).

A format's parser only says how to read a text: `_read(text, final)` returns a Snapshot (the content
so far and the calls so far, each with its name once complete and a prefix of its arguments string)
or raises MalformedToolCall when the text is not tool calls in that format. For an unfinished text
(`final=False`) every reader returns a Snapshot whose content and calls are prefixes of those of any
longer text, so streaming is a diff: the parser remembers what it has sent and sends what the newest
Snapshot adds. The non-streamed extraction is the final Snapshot of the same reader, so the streamed
deltas add up to exactly what `extract_tool_calls` returns for the whole text.

A text found malformed is all content: mid-stream, the rest of the text is then sent as content (a
call already streamed cannot be taken back, but the content deltas still add up to the whole text,
as in the non-streamed result).
"""

from __future__ import annotations

import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field


def _is_none(value: Any) -> bool:
    return value is None


def _omitted_when_none() -> Any:
    """A streamed field that OpenAI leaves out of a chunk when it has nothing to say."""
    return Field(None, exclude_if=_is_none)


def random_tool_call_id() -> str:
    """vLLM's tool call id: "chatcmpl-tool-<32 hex digits>"."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, serialized


class ToolCall(BaseModel):
    id: str = Field(default_factory=random_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = _omitted_when_none()
    arguments: str | None = _omitted_when_none()


class DeltaToolCall(BaseModel):
    """One streamed piece of the call at `index`: its first piece carries id, type and name."""

    index: int
    id: str | None = _omitted_when_none()
    type: Literal["function"] | None = _omitted_when_none()
    function: DeltaFunctionCall | None = _omitted_when_none()


class ExtractedToolCalls(BaseModel):
    """A whole output read: the calls, and the text outside them (None when there is none)."""

    tools_called: bool
    tool_calls: list[ToolCall] = Field(default_factory=list)
    content: str | None = None


class DeltaResult(BaseModel):
    """What one streamed text delta adds: content, pieces of tool calls, or both."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class MalformedToolCall(ValueError):
    """The text is not tool calls in the parser's format, so all of it is content."""


@dataclass
class PartialCall:
    """A call as far as the text goes: the name once it is complete, a prefix of the arguments."""

    name: str | None
    arguments: str = ""


@dataclass
class Snapshot:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


_SPACE = re.compile(r"\s*")


def skip_space(text: str, pos: int) -> int:
    """The first non-whitespace position from `pos` on (len(text) if none): no copy of the text."""
    return _SPACE.match(text, pos).end()


def partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `text` ends with: characters held back
    from the content because the next delta may complete the tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ToolParser(ABC):
    """Reads tool calls out of one choice's output. Create one per request and choice: streaming
    keeps what has been sent."""

    # Whether the serving code must detokenize with skip_special_tokens=False while tools are on,
    # because the format's markers are special tokens of the models that use it.
    needs_special_tokens: bool = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._sent_content = 0
        self._malformed = False
        self._sent_ids: list[str] = []
        self._sent_arguments: list[int] = []

    @abstractmethod
    def _read(self, text: str, final: bool) -> Snapshot:
        """The content and calls of `text` (the whole output when `final`); MalformedToolCall when it
        is not tool calls in this format."""

    def new_id(self) -> str:
        return random_tool_call_id()

    @property
    def tools_streamed(self) -> bool:
        """Whether a tool call has been streamed: the stream's finish_reason is then "tool_calls"."""
        return bool(self._sent_ids)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls and content of a whole output. Read by a fresh parser, so that a stream in
        progress on this one is left alone."""
        snapshot = type(self)(self.tokenizer)._final_snapshot(text)
        calls = [
            ToolCall(id=self.new_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in snapshot.calls
        ]
        return ExtractedToolCalls(tools_called=bool(calls), tool_calls=calls, content=snapshot.content or None)

    def extract_streaming(
        self, previous_text: str, current_text: str, delta_text: str, final: bool = False
    ) -> DeltaResult | None:
        """What `delta_text` adds to the stream; None while there is nothing to send. Only
        `current_text` (all the text so far, each call's extending the last's) is read: the parser
        diffs it against what it has sent.
        Pass final=True with the last delta (an empty one will do) to release text held back as a
        possible start of a call and to turn a text that never became valid calls into content."""
        snapshot = self._final_snapshot(current_text) if final else self._partial_snapshot(current_text)
        content = snapshot.content[self._sent_content :]
        self._sent_content = max(self._sent_content, len(snapshot.content))
        tool_calls = self._call_deltas(snapshot.calls)
        if not content and not tool_calls:
            return None
        return DeltaResult(content=content or None, tool_calls=tool_calls)

    def _partial_snapshot(self, text: str) -> Snapshot:
        """A text found malformed stays so however it goes on (readers raise only on what is
        written), so the stream is then read no more."""
        if not self._malformed:
            try:
                return self._read(text, final=False)
            except MalformedToolCall:
                self._malformed = True
        return Snapshot(content=text)

    def _final_snapshot(self, text: str) -> Snapshot:
        try:
            snapshot = self._read(text, final=True)
        except MalformedToolCall:
            return Snapshot(content=text)
        return snapshot if snapshot.calls else Snapshot(content=text)

    def _call_deltas(self, calls: list[PartialCall]) -> list[DeltaToolCall]:
        """The new pieces of `calls`, in order; a call is announced once its name is complete."""
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self._sent_ids):
                deltas.append(self._announce(index, call))
            elif len(call.arguments) > self._sent_arguments[index]:
                new_arguments = call.arguments[self._sent_arguments[index] :]
                self._sent_arguments[index] = len(call.arguments)
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=new_arguments)))
        return deltas

    def _announce(self, index: int, call: PartialCall) -> DeltaToolCall:
        """A call's first delta: id, type, name and the arguments known so far ("" as OpenAI sends)."""
        self._sent_ids.append(self.new_id())
        self._sent_arguments.append(len(call.arguments))
        function = DeltaFunctionCall(name=call.name, arguments=call.arguments)
        return DeltaToolCall(index=index, id=self._sent_ids[-1], type="function", function=function)
