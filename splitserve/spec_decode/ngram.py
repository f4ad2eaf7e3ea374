"""Prompt lookup ("ngram"): draft the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min, searching the
prompt and the output so far. Copy-heavy requests (rewrites, code edits, quoting summaries) repeat
long runs of their context, which the target then accepts several tokens per step.

Each request keeps an index of its n-grams (n-gram -> where its latest occurrence ends), extended
by the tokens added since the last proposal, so a proposal costs O(prompt_lookup_max) dictionary
lookups however long the sequence.
"""

from __future__ import annotations


class _Index:
    def __init__(self, sizes: range):
        self.sizes = sizes
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> the end of its latest indexed occurrence
        self.indexed = 0  # n-grams ending at positions before this one are in `latest`

    def extend(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams that end before `upto` (exclusive end positions <= upto)."""
        for end in range(self.indexed + 1, upto + 1):
            for n in self.sizes:
                if end >= n:
                    self.latest[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, upto)


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.sizes = range(prompt_lookup_max, prompt_lookup_min - 1, -1)  # longest first
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, tokens: list[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens to follow `tokens` (the request's prompt and output so far)."""
        if max_drafts < 1:
            return []
        index = self._indexes.setdefault(request_id, _Index(self.sizes))
        # Occurrences that end before the last token: the suffix itself is never its own match.
        index.extend(tokens, len(tokens) - 1)
        for n in self.sizes:
            if len(tokens) <= n:
                continue
            end = index.latest.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + max_drafts]
        return []

    def finish(self, request_id: str, tokens: list[int]) -> None:
        self._indexes.pop(request_id, None)
