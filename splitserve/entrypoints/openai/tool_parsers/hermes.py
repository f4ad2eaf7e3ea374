"""hermes: the tool calls of Hermes 2 Pro, Qwen2.5 and Qwen3 chat templates (vLLM's
`--tool-call-parser hermes`):

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls may follow one another. The content is the text before the first <tool_call>; text
between or after the calls is dropped, as vLLM does. A call's closing </tool_call> may be missing
(generation stopped on it): the call ends with its JSON object.

Streaming: the content streams as it comes, except for a trailing "<tool_c" that may be the start
of the tag. Inside a call the name is sent once its string is complete, then the arguments as they
are written (see json_call).
"""

from __future__ import annotations

from splitserve.entrypoints.openai.tool_parsers.base import Snapshot, partial_tag_len
from splitserve.entrypoints.openai.tool_parsers.json_call import JsonToolParser

TOOL_CALL_START = "<tool_call>"


class HermesToolParser(JsonToolParser):
    needs_special_tokens = True  # <tool_call> is a special token of Hermes models

    def _read(self, text: str, final: bool) -> Snapshot:
        first = text.find(TOOL_CALL_START)
        if first < 0:
            held = 0 if final else partial_tag_len(text, TOOL_CALL_START)
            return Snapshot(content=text[: len(text) - held])
        calls = []
        start = first
        while start >= 0:
            scanner = self._scanner(start + len(TOOL_CALL_START))
            calls.append(scanner.advance(text, final))
            if scanner.end is None:
                break
            start = text.find(TOOL_CALL_START, scanner.end)
        return Snapshot(content=text[:first], calls=calls)
