"""Incremental detokenization and stop strings.

A fast tokenizer (a Hugging Face `tokenizers` backend, whose decode transformers does not post-process:
clean_up_tokenization_spaces off) decodes through the backend's own incremental decoder
(`tokenizers.decoders.DecodeStream`, as vLLM's fast detokenizer does): about 1 us per token in Rust,
against about 15 us for two Python decode calls per token, which bounded the host's time per step at
large batches. Other tokenizers decode a small window of recent token ids twice (with and without the
newest tokens) and emit the difference. Both give the text of decoding everything at once, spaces and
bytes merged across token boundaries; output whose decoding ends in U+FFFD is a multi-byte character
still missing bytes, and nothing is emitted until it completes. Both start from the last few prompt
tokens as left context.
"""

from __future__ import annotations

import tokenizers
from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 5  # prompt tokens used as left context, as vLLM's initial offset


def _stream_backend(tokenizer) -> tokenizers.Tokenizer | None:
    """The `tokenizers` backend to stream-decode with, if decoding through it is exactly `tokenizer.decode`."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend
    return None


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
        self._backend = _stream_backend(tokenizer)
        self._stream: DecodeStream | None = None
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in self.ids:  # left context: its text was the prompt's
                self._stream.step(self._backend, token_id)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def add_token(self, token_id: int) -> str:
        """Append a token; return the new complete text it releases (possibly empty)."""
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id) or ""
            self.output_text += delta
            return delta
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
