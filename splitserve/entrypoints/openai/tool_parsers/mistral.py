"""mistral: the tool calls of Mistral's instruct models (vLLM's `--tool-call-parser mistral`):
[TOOL_CALLS] and a JSON array of calls,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]

The content is the text before [TOOL_CALLS]; text after the array is dropped. Ids are 9 letters and
digits, the only form Mistral's chat templates accept in the tool messages sent back.

Streaming: the content streams as it comes, except for a trailing "[TOOL_" that may be the start of
the marker. Calls stream their name once complete, then their arguments as they are written (see
json_call).
"""

from __future__ import annotations

import random
import string

from splitserve.entrypoints.openai.tool_parsers.base import (
    MalformedToolCall,
    Snapshot,
    partial_tag_len,
    skip_space,
)
from splitserve.entrypoints.openai.tool_parsers.json_call import JsonToolParser

TOOL_CALLS = "[TOOL_CALLS]"
_ID_ALPHABET = string.ascii_letters + string.digits


def random_mistral_id() -> str:
    return "".join(random.choices(_ID_ALPHABET, k=9))


class MistralToolParser(JsonToolParser):
    needs_special_tokens = True  # [TOOL_CALLS] is a special token

    def new_id(self) -> str:
        return random_mistral_id()

    def _read(self, text: str, final: bool) -> Snapshot:
        marker = text.find(TOOL_CALLS)
        if marker < 0:
            held = 0 if final else partial_tag_len(text, TOOL_CALLS)
            return Snapshot(content=text[: len(text) - held])
        pos = skip_space(text, marker + len(TOOL_CALLS))
        if pos < len(text) and text[pos] != "[":
            raise MalformedToolCall(f"{TOOL_CALLS} is followed by a JSON array, not {text[pos]!r}")
        calls = self._array(text, pos + 1, final) if pos < len(text) else []
        return Snapshot(content=text[:marker], calls=calls)
