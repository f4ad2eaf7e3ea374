"""llama3_json: the JSON tool calls of Llama 3.1 and 3.2 (vLLM's `--tool-call-parser llama3_json`):
an optional <|python_tag|>, then one or more objects separated by ";":

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}

"arguments" is accepted in place of "parameters". An output is tool calls only when it starts (after
whitespace) with <|python_tag|> or "{", and then it has no content.

Streaming: while the text is empty or may still become <|python_tag|>, nothing is sent; a text that
starts otherwise is content at once. Calls stream their name once complete, then their arguments as
they are written (see json_call).
"""

from __future__ import annotations

from splitserve.entrypoints.openai.tool_parsers.base import MalformedToolCall, PartialCall, Snapshot, skip_space
from splitserve.entrypoints.openai.tool_parsers.json_call import JsonToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(JsonToolParser):
    def _read(self, text: str, final: bool) -> Snapshot:
        start = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, start):
            return Snapshot(calls=self._calls(text, start + len(PYTHON_TAG), final))
        if text.startswith("{", start):
            return Snapshot(calls=self._calls(text, start, final))
        if not final and len(text) - start < len(PYTHON_TAG) and PYTHON_TAG.startswith(text[start:]):
            return Snapshot()
        return Snapshot(content=text)

    def _calls(self, text: str, pos: int, final: bool) -> list[PartialCall]:
        """The ";"-separated call objects from `pos` on (a trailing ";" is allowed)."""
        calls = []
        while (pos := skip_space(text, pos)) < len(text):
            scanner = self._scanner(pos)
            calls.append(scanner.advance(text, final))
            if scanner.end is None:
                break
            pos = skip_space(text, scanner.end)
            if pos == len(text):
                break
            if text[pos] != ";":
                raise MalformedToolCall(f"expected ';' between tool calls, got {text[pos]!r}")
            pos += 1
        return calls
