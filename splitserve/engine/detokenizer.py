"""Incremental detokenization and stop strings.

Text is produced by decoding a small window of recent token ids twice (with and without the
newest tokens) and emitting the difference, so that tokenizers that merge spaces or bytes across
token boundaries still give the same text as decoding everything at once. A window whose decoding
ends in U+FFFD is a multi-byte character still missing bytes: nothing is emitted until it completes.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens used as left context, as vLLM's initial offset


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def add_token(self, token_id: int) -> str:
        """Append a token; return the new complete text it releases (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.output_text += delta
        return delta


def find_stop_string(text: str, num_new_chars: int, stop: list[str], include: bool) -> tuple[str, int] | None:
    """The first stop string that the last `num_new_chars` characters completed, and where the text
    must be cut (after the stop string when `include`, before it otherwise)."""
    for s in stop:
        at = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if at != -1:
            return s, at + len(s) if include else at
    return None
