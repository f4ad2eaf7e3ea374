"""Readers of the outputs that structured output forces for tool_choice="required" and for a named
tool choice (entrypoints/openai/tool_calling.py): the output is then sure to be calls.

- required: a JSON array of {"name": ..., "parameters": {...}} objects, read like mistral's array
  (names stream once complete, arguments as they are written);
- named: the output is the arguments object itself, sent as it is written under the named function.
"""

from __future__ import annotations

from typing import Any

from splitserve.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    FunctionCall,
    MalformedToolCall,
    PartialCall,
    Snapshot,
    ToolCall,
    ToolParser,
    skip_space,
)
from splitserve.entrypoints.openai.tool_parsers.json_call import JsonToolParser


class RequiredToolCallsParser(JsonToolParser):
    def _read(self, text: str, final: bool) -> Snapshot:
        pos = skip_space(text, 0)
        if pos == len(text):
            if final:
                raise MalformedToolCall("no tool calls")
            return Snapshot()
        if text[pos] != "[":
            raise MalformedToolCall(f"the calls are a JSON array, not {text[pos]!r}...")
        return Snapshot(calls=self._array(text, pos + 1, final))


class NamedToolCallParser(ToolParser):
    def __init__(self, name: str, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self.name = name

    def _read(self, text: str, final: bool) -> Snapshot:
        return Snapshot(calls=[PartialCall(self.name, text)])

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        call = ToolCall(id=self.new_id(), function=FunctionCall(name=self.name, arguments=text))
        return ExtractedToolCalls(tools_called=True, tool_calls=[call], content=None)
