"""Tool-call parsers for the chat API, by vLLM's `--tool-call-parser` names: each reads a model's
output into OpenAI tool calls, whole or streamed (base.py says how)."""

from __future__ import annotations

from typing import Any

from splitserve.entrypoints.openai.tool_parsers.base import (
    DeltaFunctionCall,
    DeltaResult,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    ToolParser,
)
from splitserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from splitserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from splitserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from splitserve.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


def get_tool_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """A new parser of the format `name`, for one request's choice; ValueError listing the known
    names otherwise."""
    try:
        parser_class = TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"Unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}.") from None
    return parser_class(tokenizer)


__all__ = [
    "TOOL_PARSERS",
    "DeltaFunctionCall",
    "DeltaResult",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionCall",
    "ToolCall",
    "ToolParser",
    "get_tool_parser",
]
