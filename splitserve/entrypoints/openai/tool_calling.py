"""Tool calling on /v1/chat/completions, as vLLM serves it:

- `tool_choice="none"` (or no tools): plain text; the tools still reach the chat template;
- `"auto"` (the default when tools are given and the server runs with --enable-auto-tool-choice):
  the model decides; the server's --tool-call-parser reads its calls out of the text;
- `"required"` and a named function: structured output forces calls, so they always parse: a JSON
  array of {"name", "parameters"} objects (at most one with parallel_tool_calls=false), or the named
  function's arguments object.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.chat_messages import NamedToolChoice
from splitserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser
from splitserve.entrypoints.openai.tool_parsers.forced import NamedToolCallParser, RequiredToolCallsParser
from splitserve.sampling_params import GuidedDecodingParams

_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    parser_name: str | None = None  # auto: the server's --tool-call-parser
    function: str | None = None  # named: the function

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    def new_parser(self, tokenizer) -> ToolParser | None:
        """One per choice: parsers keep what they have streamed."""
        if self.mode == "auto":
            return get_tool_parser(self.parser_name, tokenizer)
        if self.mode == "required":
            return RequiredToolCallsParser(tokenizer)
        if self.mode == "named":
            return NamedToolCallParser(self.function, tokenizer)
        return None

    @property
    def needs_special_tokens(self) -> bool:
        """The auto parser's markers are special tokens: the text must keep them."""
        return self.mode == "auto" and TOOL_PARSERS[self.parser_name].needs_special_tokens

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when the model stopped after calling tools (a named choice keeps "stop")."""
        if called and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def plan_tools(req, enable_auto_tool_choice: bool, tool_call_parser: str | None) -> ToolPlan:
    """What the request's tools and tool_choice ask for, under the server's tool flags."""
    if not req.tools or req.tool_choice == "none":
        return ToolPlan("none")
    choice = req.tool_choice or ("auto" if enable_auto_tool_choice else "none")
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("named", function=choice.function.name)
    if choice == "auto" and not (enable_auto_tool_choice and tool_call_parser):
        raise APIError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set.',
            param="tool_choice",
        )
    return ToolPlan(choice, parser_name=tool_call_parser if choice == "auto" else None)


def tool_guide(req, plan: ToolPlan) -> GuidedDecodingParams | None:
    """The structured output that forces the calls of a required or named tool choice."""
    if plan.mode == "named":
        tool = next(t for t in req.tools if t.function.name == plan.function)
        return GuidedDecodingParams(json=tool.function.parameters or _ANY_OBJECT)
    if plan.mode != "required":
        return None
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(t) for t in req.tools]}}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return GuidedDecodingParams(json=schema)


def _call_schema(tool) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "parameters": tool.function.parameters or _ANY_OBJECT,
        },
        "required": ["name", "parameters"],
    }


def template_tools(req) -> list[dict] | None:
    """The tools as chat templates read them (OpenAI's shape)."""
    if not req.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in req.tools]
