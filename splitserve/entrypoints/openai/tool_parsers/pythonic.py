"""pythonic: tool calls written as a Python list of calls (vLLM's `--tool-call-parser pythonic`,
used with Llama 3.2 and Llama 4 templates among others):

    [get_weather(city='Paris', unit="c"), get_time()]

The whole output must be that list. Arguments are keyword arguments whose values are literals:
strings, numbers (signed too), booleans, None, and lists and dicts (string keys) of literals. They are
read with `ast`, never evaluated, and serialized as a JSON object. Anything else (a positional
argument, a variable, an expression, text around the list) makes the output plain content.

Streaming: nothing is sent while the text may still become a list of calls. A call's name is sent
when its "(" arrives; its arguments are sent whole when its ")" does, since a Python literal can only
be read once complete (a number's digits, escapes, implicit string concatenation).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from splitserve.entrypoints.openai.tool_parsers.base import (
    MalformedToolCall,
    PartialCall,
    Snapshot,
    ToolParser,
    skip_space,
)

_CALL_HEAD = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")
_MAYBE_CALL_HEAD = re.compile(r"\s*(?:[A-Za-z_]\w*\s*)?")
_BRACKET_OR_QUOTE = re.compile(r"""[()\[\]{}'"]""")
# A run of a string's body up to its quote character: complete escapes only, so a trailing "\" waits.
_STRING_RUN = {quote: re.compile(r"(?:[^\\" + quote + r"]|\\.)*", re.DOTALL) for quote in "'\""}


def _literal(node: ast.expr) -> Any:
    """The value of a literal argument; MalformedToolCall for anything that is not one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, type(None))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = node.operand
        if isinstance(operand, ast.Constant) and type(operand.value) in (int, float):
            return -operand.value if isinstance(node.op, ast.USub) else operand.value
    if isinstance(node, ast.List):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {key.value: _literal(value) for key, value in zip(node.keys, node.values)}
    raise MalformedToolCall(f"not a literal argument: {ast.dump(node)[:60]}")


def _call_arguments(source: str) -> str:
    """The JSON object of the keyword arguments of the call `source` ("f(a=1)")."""
    try:
        call = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError) as error:
        raise MalformedToolCall(f"not a Python call: {source[:60]!r}") from error
    if not isinstance(call, ast.Call) or call.args or any(keyword.arg is None for keyword in call.keywords):
        raise MalformedToolCall(f"a tool call takes keyword arguments only: {source[:60]!r}")
    return json.dumps({keyword.arg: _literal(keyword.value) for keyword in call.keywords}, ensure_ascii=False)


class _CallReader:
    """One call of the list, from its name to its closing ')', read as far as the text allows.
    Reading resumes where it stopped (brackets open, inside a string or not), so a long call costs
    its length once, not once per delta."""

    def __init__(self, head: re.Match[str]) -> None:
        self.name = head.group(1)
        self.start = head.start(1)
        self.end: int | None = None
        self.arguments = ""
        self._pos = head.end()
        self._depth = 1
        self._quote: str | None = None
        self._closed_at: int | None = None

    def advance(self, text: str) -> PartialCall:
        """The call as far as `text` goes: its arguments once its ')' is there."""
        if self.end is None and (end := self._scan(text)) is not None:
            self.arguments = _call_arguments(text[self.start : end])
            self.end = end
        return PartialCall(self.name, self.arguments)

    def _scan(self, text: str) -> int | None:
        """Just past the call's ')' once it is in `text`, else None."""
        while self._closed_at is None:
            if self._quote is not None and not self._read_string(text):
                return None
            match = _BRACKET_OR_QUOTE.search(text, self._pos)
            if match is None:
                self._pos = len(text)
                return None
            if match.group() in "'\"":
                if not self._open_string(text, match.start()):
                    return None
                continue
            self._pos = match.end()
            self._depth += 1 if match.group() in "([{" else -1
            self._closed_at = self._pos if self._depth == 0 else None
        return self._closed_at

    def _open_string(self, text: str, pos: int) -> bool:
        """Enters the string whose quote is at `pos`; False while "'" or "''" may yet become "'''"."""
        quote = text[pos]
        if len(text) - pos < 3 and (quote * 3).startswith(text[pos:]):
            self._pos = pos
            return False
        self._quote = quote * 3 if text.startswith(quote * 3, pos) else quote
        self._pos = pos + len(self._quote)
        return True

    def _read_string(self, text: str) -> bool:
        """Reads on through the open string; True once past its closing quote."""
        quote = self._quote
        while True:
            self._pos = _STRING_RUN[quote[0]].match(text, self._pos).end()
            if self._pos == len(text) or text[self._pos] == "\\":
                return False
            if text.startswith(quote, self._pos):
                self._pos += len(quote)
                self._quote = None
                return True
            if len(text) - self._pos < len(quote):
                return False
            self._pos += 1  # a lone quote character inside a triple-quoted string


class PythonicToolParser(ToolParser):
    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._readers: dict[int, _CallReader] = {}

    def _read(self, text: str, final: bool) -> Snapshot:
        start = skip_space(text, 0)
        if start == len(text) and not final:
            return Snapshot()
        if not text.startswith("[", start):
            return Snapshot(content=text)
        return Snapshot(calls=self._calls(text, start + 1, final))

    def _calls(self, text: str, pos: int, final: bool) -> list[PartialCall]:
        """The calls of the list whose '[' ends before `pos`."""
        calls: list[PartialCall] = []
        while (reader := self._reader(text, pos)) is not None:
            calls.append(reader.advance(text))
            if reader.end is None and final:
                raise MalformedToolCall(f"unfinished tool call {reader.name}(...")
            if reader.end is None:
                return calls
            pos = skip_space(text, reader.end)
            if text.startswith(",", pos):
                pos += 1
            elif text.startswith("]", pos) and skip_space(text, pos + 1) == len(text):
                return calls
            elif pos < len(text) or final:
                raise MalformedToolCall(f"expected ',' or ']' after a tool call, got {text[pos : pos + 20]!r}")
            else:
                return calls
        if final or not _MAYBE_CALL_HEAD.fullmatch(text, pos):
            raise MalformedToolCall(f"not a list of tool calls at {text[pos : pos + 20]!r}")
        return calls

    def _reader(self, text: str, pos: int) -> _CallReader | None:
        """The reader of the call whose name starts after `pos`, once its '(' is there."""
        if pos not in self._readers and (head := _CALL_HEAD.match(text, pos)) is not None:
            self._readers[pos] = _CallReader(head)
        return self._readers.get(pos)
