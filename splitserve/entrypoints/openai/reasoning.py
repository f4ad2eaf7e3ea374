"""Reasoning parsers: split a thinking model's output into its reasoning (inside <think>...</think>)
and its answer, for the `reasoning_content` / `content` fields of chat responses. Names as vLLM's
`--reasoning-parser`:

- "deepseek_r1": the chat template ends the prompt with <think>, so generation starts inside the
  reasoning. Everything up to the first </think> is reasoning, what follows is content; without
  </think> all of it is reasoning. A <think> the model repeats at the very start is dropped.
- "qwen3": reasoning only when the text starts with <think>: what lies between it and the first
  </think> (all the rest while </think> has not come), then content. A text not starting with
  <think> is all content.
- "ernie45" (ERNIE 4.5's thinking models): as deepseek_r1, and the answer after </think> comes as
  "\n\n<response>\nANSWER\n</response>\n" or as plain text: the newlines before it, the
  <response> tags and the newlines just inside them are not content.

Without --reasoning-parser, `parser_for_model` picks one for a model whose chat template thinks
(it writes </think>): qwen3 for Qwen3, ernie45 for ERNIE 4.5; `--reasoning-parser none` turns that off.

Streaming is stateless: `extract_delta(previous_text, delta_text)` splits the text before and after
the delta and returns the difference. While the text ends with what may be the start of a tag
("</thi"), those characters are held back, so no delta ever carries part of a tag; the delta with
`final=True` (the stream's last) releases what was held when the tag never completed.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


def _partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `text` ends with: characters that may
    become the tag once more text arrives."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    """Splits text at <think>/</think>. `starts_in_reasoning`: a text that does not open with
    <think> is reasoning (deepseek_r1) rather than content (qwen3)."""

    name: str
    starts_in_reasoning: bool
    start_tag: str = THINK_START
    end_tag: str = THINK_END
    response_tags: tuple[str, str] | None = None  # the answer's own wrapping (ernie45's <response>)

    def _sections(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of `text`. Unless `final`, a trailing possible tag start is held back,
        so that the sections of a prefix are always prefixes of the sections of the longer text."""
        if text.startswith(self.start_tag):
            body = text[len(self.start_tag) :]
        elif not final and self.start_tag.startswith(text):
            return "", ""  # may still become the opening tag
        elif self.starts_in_reasoning:
            body = text
        else:
            return "", text
        end = body.find(self.end_tag)
        if end >= 0:
            return body[:end], self._answer(body[end + len(self.end_tag) :], final)
        held = 0 if final else _partial_tag_len(body, self.end_tag)
        return body[: len(body) - held], ""

    def _answer(self, text: str, final: bool) -> str:
        """The content after </think>, less the answer's wrapping where the parser has one. Unless
        `final`, what may still turn out to be wrapping is held back (as tags are in `_sections`)."""
        if self.response_tags is None:
            return text
        start, end = self.response_tags
        text = text.lstrip("\n")
        if not final and (not text or (start.startswith(text) and text != start)):
            return ""  # newlines so far, or what may become <response>
        if not text.startswith(start):
            return text
        inner = text[len(start) :]
        if not final and not inner:
            return ""  # the newline after <response> may follow
        inner = inner.removeprefix("\n")
        close = inner.find(end)
        if close >= 0:
            return inner[:close].removesuffix("\n")
        if final:
            return inner
        held = max(_partial_tag_len(inner, end), _partial_tag_len(inner, "\n" + end))
        return inner[: len(inner) - held]

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; an empty part is None."""
        reasoning, content = self._sections(text, final=True)
        return reasoning or None, content or None

    def extract_delta(self, previous_text: str, delta_text: str, final: bool = False) -> tuple[str | None, str | None]:
        """(reasoning delta, content delta) that `delta_text` adds to `previous_text` (all the text
        streamed before it); an empty part is None. Pass final=True with the stream's last delta
        (even an empty one) to release characters held back as a possible tag start."""
        old_reasoning, old_content = self._sections(previous_text, final=False)
        reasoning, content = self._sections(previous_text + delta_text, final=final)
        return reasoning[len(old_reasoning) :] or None, content[len(old_content) :] or None


_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_in_reasoning=True),
    "qwen3": ReasoningParser("qwen3", starts_in_reasoning=False),
    "ernie45": ReasoningParser("ernie45", starts_in_reasoning=True, response_tags=("<response>", "</response>")),
}
REASONING_PARSERS: tuple[str, ...] = tuple(_PARSERS)
# model_type -> the parser of that family's thinking models (picked when the chat template thinks)
_FAMILY_PARSERS = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "ernie4_5": "ernie45",
    "ernie4_5_moe": "ernie45",
    "deepseek_v3": "deepseek_r1",
}


def parser_for_model(model_type: str, chat_template: str | None) -> str | None:
    """The reasoning parser for a model served without --reasoning-parser: its family's, when its
    chat template writes </think> (a thinking model); None otherwise."""
    if not chat_template or THINK_END not in chat_template:
        return None
    return _FAMILY_PARSERS.get(model_type)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`; ValueError listing the known names otherwise."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"Unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}.") from None
