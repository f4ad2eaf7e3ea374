"""A stand-in proposer for the speculative decoding tests (tests/parity/test_speculative.py and the GPU
check's tests/parity/test_gpu.py). A random tiny model rarely repeats itself, so an n-gram proposer
would hardly ever have its drafts accepted; this one drafts a known reference continuation with every
third token corrupted, so that verification accepts runs of drafts and rejects others at known places."""

from __future__ import annotations

# Prompts whose first three have oracle drafts in the tests, the last none (a batch that mixes both).
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(100, 140)), [3, 4], [700, 1, 700, 1, 700]]


class OracleProposer:
    """Drafts the reference continuation of a prompt it knows, every third draft token wrong (the
    vocabulary's next id); nothing for prompts it does not know."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab: int):
        self.references, self.vocab = references, vocab
        self.proposed = 0

    def propose(self, request_id: str, tokens: list[int], max_drafts: int) -> list[int]:
        for prompt, output in self.references.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                drafts = list(output[done : done + max_drafts])
                for i in range(2 - done % 3, len(drafts), 3):
                    drafts[i] = (drafts[i] + 1) % self.vocab
                self.proposed += len(drafts)
                return drafts
        return []

    def finish(self, request_id: str, tokens: list[int]) -> None:
        pass
