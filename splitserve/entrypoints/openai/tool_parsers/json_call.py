"""Reading one JSON tool call, {"name": "f", "arguments": {...}}, from a text that may still be
growing: hermes, llama3_json and mistral all write their calls this way.

The arguments object is re-serialized token by token in `json.dumps(..., ensure_ascii=False)` form
(", " and ": " separators, no escapes beyond JSON's own), so a prefix of the model's text gives a
prefix of the final arguments string, whatever whitespace or escapes the model wrote: the streamed
argument deltas add up to the very string the non-streamed extraction returns. An unfinished string
is sent as far as it decodes; a number or literal waits until it ends. A scanner resumes where it
stopped (after its last token, or inside a string), so a stream's call is read once, not once per
delta.
"""

from __future__ import annotations

import json
import re
from typing import Any

from splitserve.entrypoints.openai.tool_parsers.base import (
    MalformedToolCall,
    PartialCall,
    ToolParser,
    skip_space,
)

ARGUMENT_KEYS = ("arguments", "parameters")  # llama3 writes "parameters"
_SCALAR = re.compile(r"[-+.\w]+")
# A run of a string's body that decodes on its own: no escape cut short, no high surrogate without
# its low half (decoded alone it would not be a prefix of the pair's character).
_DECODABLE = re.compile(
    r'(?:[^"\\]|\\[^u]|\\u(?![dD][89abAB])[0-9a-fA-F]{4}|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[0-9a-fA-F]{4})*'
)
_LONGEST_CUT_ESCAPE = len("\\ud83d\\ude0")  # an undecodable tail longer than this is a bad escape
_STRUCTURE = frozenset("{}[]:,")
_SEPARATORS = {",": ", ", ":": ": "}


def _decode(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as error:
        raise MalformedToolCall(f"not JSON: {raw[:40]!r}") from error


def _canonical(raw: str) -> str:
    """A complete token as json.dumps writes it."""
    if raw in _STRUCTURE:
        return _SEPARATORS.get(raw, raw)
    return json.dumps(_decode(raw), ensure_ascii=False)


def _bare_token(text: str, pos: int, final: bool) -> tuple[str, int] | None:
    """The structural character, number or literal at `pos` and where it ends; None while the text
    ends before the token surely does."""
    if pos == len(text):
        return None
    if text[pos] in _STRUCTURE:
        return text[pos], pos + 1
    match = _SCALAR.match(text, pos)
    if match is None:
        raise MalformedToolCall(f"unexpected {text[pos]!r} in a JSON tool call")
    if match.end() == len(text) and not final:
        return None
    return match.group(), match.end()


class _OpenString:
    """A string token being read: how far its body decodes, and that part as json.dumps writes it.
    Reading resumes there, so a long string costs its length once, not once per delta."""

    def __init__(self, quote: int) -> None:
        self.quote = quote
        self.decoded_to = quote + 1
        self.dumped = '"'

    def read_on(self, text: str) -> int | None:
        """Just past the closing quote once it is in `text`, else None."""
        end = _DECODABLE.match(text, self.decoded_to).end()
        self.dumped += json.dumps(_decode(f'"{text[self.decoded_to : end]}"'), ensure_ascii=False)[1:-1]
        self.decoded_to = end
        if end < len(text) and text[end] == '"':
            return end + 1
        if len(text) - end > _LONGEST_CUT_ESCAPE:
            raise MalformedToolCall(f"bad escape in a JSON string: {text[end : end + 12]!r}")
        return None


def _is_call(value: Any) -> bool:
    """A call object: a non-empty string name, arguments (if given) an object."""
    return (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and bool(value["name"])
        and all(isinstance(value[key], dict) for key in ARGUMENT_KEYS if key in value)
    )


class CallScanner:
    """One call object from `start` on (whitespace skipped), read as far as the text allows.
    `advance` resumes where it stopped, so give it ever longer texts that begin alike (a stream's
    current_text). Structure is checked loosely on the way and strictly (json.loads) at the end."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self.start: int | None = None  # the '{'
        self.end: int | None = None  # just past the closing '}'
        self.name: str | None = None
        self.arguments = ""
        self._depth = 0
        self._expect = "key"  # at depth 1: "key", "colon", "value" or "comma"
        self._key: str | None = None
        self._capturing = False
        self._captured = False
        self._string: _OpenString | None = None

    def advance(self, text: str, final: bool = False) -> PartialCall:
        """The call as far as `text` goes; MalformedToolCall if it cannot be a call, or, when
        `final`, if it is unfinished."""
        while self.end is None and (token := self._next_token(text, final)) is not None:
            self._take(text, *token)
            self.pos, self._string = token[1], None
        if self.end is None and final:
            raise MalformedToolCall("unfinished JSON tool call")
        unfinished = self._string.dumped if self._string and self._capturing else ""
        return PartialCall(self.name, self.arguments + unfinished)

    def _next_token(self, text: str, final: bool) -> tuple[str, int] | None:
        """The next token (a string with its quotes) and where it ends; None while the text ends
        before the token surely does."""
        if self._string is None:
            pos = skip_space(text, self.pos)
            if not text.startswith('"', pos):
                return _bare_token(text, pos, final)
            self._string = _OpenString(pos)
        end = self._string.read_on(text)
        return None if end is None else (text[self._string.quote : end], end)

    def _take(self, text: str, raw: str, end: int) -> None:
        if self._depth == 0:
            if raw != "{":
                raise MalformedToolCall(f"a tool call is a JSON object, not {raw!r}...")
            self.start, self._depth = end - 1, 1
        elif self._depth == 1 and self._expect != "value":
            self._member_syntax(text, raw, end)
        else:
            self._value(raw)

    def _member_syntax(self, text: str, raw: str, end: int) -> None:
        """A key, colon, comma or the closing brace of the call object itself."""
        if raw == "}":
            self._close(text, end)
        elif self._expect == "key" and raw[0] == '"':
            self._key, self._expect = _decode(raw), "colon"
        elif (self._expect, raw) in (("colon", ":"), ("comma", ",")):
            self._expect = "value" if raw == ":" else "key"
        else:
            raise MalformedToolCall(f"unexpected {raw!r} in a JSON tool call")

    def _value(self, raw: str) -> None:
        """A token of a member's value; the first object under an argument key is captured."""
        if self._depth == 1:
            if raw in ("}", "]", ":", ","):
                raise MalformedToolCall(f"unexpected {raw!r} in a JSON tool call")
            self._capturing = raw == "{" and self._key in ARGUMENT_KEYS and not self._captured
            self._captured |= self._capturing
            if self._key == "name" and raw[0] == '"' and self.name is None:
                self.name = _decode(raw)
        if self._capturing:
            self.arguments += _canonical(raw)
        self._depth += 1 if raw in ("{", "[") else -1 if raw in ("}", "]") else 0
        if self._depth == 1:
            self._expect, self._capturing = "comma", False

    def _close(self, text: str, end: int) -> None:
        if not _is_call(_decode(text[self.start : end])):
            raise MalformedToolCall("a tool call needs a name and an object of arguments")
        self.end, self._depth = end, 0
        if not self._captured:
            self.arguments = "{}"


class JsonToolParser(ToolParser):
    """A parser whose calls are JSON objects: one scanner per call of the stream, by its start."""

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._scanners: dict[int, CallScanner] = {}

    def _scanner(self, start: int) -> CallScanner:
        if start not in self._scanners:
            self._scanners[start] = CallScanner(start)
        return self._scanners[start]

    def _array(self, text: str, pos: int, final: bool) -> list[PartialCall]:
        """The calls of the array whose '[' ends before `pos`."""
        calls = []
        while (pos := skip_space(text, pos)) < len(text):
            scanner = self._scanner(pos)
            calls.append(scanner.advance(text, final))
            if scanner.end is None:
                return calls
            pos = skip_space(text, scanner.end)
            if pos == len(text):
                break
            if text[pos] == "]":
                return calls
            if text[pos] != ",":
                raise MalformedToolCall(f"expected ',' or ']' after a tool call, got {text[pos]!r}")
            pos += 1
        if final:
            raise MalformedToolCall("unfinished array of tool calls")
        return calls
