"""Building the sampler's inputs (SamplingMetadata) for one step with a fixed number of device operations.

Everything a step's requests ask for is first gathered on the host into flat Python lists (one entry
per row for the scalar columns, one (row, token) pair per token for the [R, V] tables), and each list
crosses to the device once, through `host.to_device` (pinned memory, asynchronous on CUDA). The dense
[R, V] tables are then made on the device: zeros, filled by one indexed write per table. So the
number of device operations and host->device copies does not grow with the number of requests, no
copy makes the host wait for the GPU's queue, and no dense [R, V] tensor (100+ MB for a large batch
and vocabulary) is ever built on the host or copied.
"""

from __future__ import annotations

import torch

from splitserve.executor.host import to_device
from splitserve.executor.input_batch import CachedRequestState
from splitserve.executor.sampler import GREEDY_TEMPERATURE, SamplingMetadata
from splitserve.sampling_params import SamplingParams


def build_sampling_metadata(requests: list[CachedRequestState], vocab: int, device: torch.device) -> SamplingMetadata:
    """The sampler's inputs for `requests` (one row each, in order) over a vocabulary of `vocab` logits.

    Optional fields stay None when no row needs them, so that the sampler can skip their work (and
    take its fused path when nothing but temperature is asked for). A seeded row's draw is keyed by its
    seed and the output index it samples (`sample_index`), so that it depends on nothing else.
    """
    params = [r.sampling_params for r in requests]
    temps = [p.temperature for p in params]
    meta = SamplingMetadata(
        temperature=to_device(temps, torch.float32, device), all_greedy=all(t < GREEDY_TEMPERATURE for t in temps)
    )
    _add_truncation(meta, params, vocab, device)
    meta.seeds = {
        i: (r.sampling_params.seed, r.sample_index)
        for i, r in enumerate(requests)
        if r.sampling_params.seed is not None
    }
    _add_penalties(meta, requests, vocab, device)
    meta.logit_bias = _logit_bias(requests, vocab, device)
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = max(logprobs) if logprobs else None
    return meta


def _add_truncation(meta: SamplingMetadata, params: list[SamplingParams], vocab: int, device: torch.device) -> None:
    """top_k (vocab where a row has no limit), top_p and min_p: one column copy each, when any row uses it."""
    if any(p.top_k for p in params):
        meta.top_k = to_device([p.top_k or vocab for p in params], torch.long, device)
    if any(p.top_p < 1.0 for p in params):
        meta.top_p = to_device([p.top_p for p in params], torch.float32, device)
    if any(p.min_p > 0.0 for p in params):
        meta.min_p = to_device([p.min_p for p in params], torch.float32, device)


def _add_penalties(
    meta: SamplingMetadata, requests: list[CachedRequestState], vocab: int, device: torch.device
) -> None:
    """Penalty columns, the output counts every penalty reads, and the prompt mask that only the
    repetition penalty reads; nothing when no row has a penalty."""
    params = [r.sampling_params for r in requests]
    rep = any(p.repetition_penalty != 1.0 for p in params)
    freq = any(p.frequency_penalty != 0.0 for p in params)
    pres = any(p.presence_penalty != 0.0 for p in params)
    if not (rep or freq or pres):
        return
    meta.output_counts = _output_counts(requests, vocab, device)
    if rep:
        meta.prompt_mask = _prompt_mask(requests, vocab, device)
        meta.repetition_penalty = to_device([p.repetition_penalty for p in params], torch.float32, device)
    if freq:
        meta.frequency_penalty = to_device([p.frequency_penalty for p in params], torch.float32, device)
    if pres:
        meta.presence_penalty = to_device([p.presence_penalty for p in params], torch.float32, device)


def _output_counts(requests: list[CachedRequestState], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32 occurrences of each token in each row's output: every (row, token) pair of all
    outputs crosses once, and one accumulating write counts them on the device (repeats add up)."""
    counts = torch.zeros(len(requests), vocab, dtype=torch.float32, device=device)
    rows, tokens = _pairs([r.output_token_ids for r in requests])
    if tokens:
        index = _index_to_device(rows, tokens, device)
        counts.index_put_(index, torch.ones(len(tokens), dtype=torch.float32, device=device), accumulate=True)
    return counts


def _prompt_mask(requests: list[CachedRequestState], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, V] bool: the token occurs in the row's prompt. One copy of all (row, token) pairs, one write
    (a token repeated in a prompt writes True twice, which is harmless)."""
    mask = torch.zeros(len(requests), vocab, dtype=torch.bool, device=device)
    rows, tokens = _pairs([r.prompt_token_ids for r in requests])
    if tokens:
        index = _index_to_device(rows, tokens, device)
        mask.index_put_(index, torch.ones(len(tokens), dtype=torch.bool, device=device))
    return mask


def _logit_bias(requests: list[CachedRequestState], vocab: int, device: torch.device) -> torch.Tensor | None:
    """A dense [R, V] float32 additive bias for the rows that need one: allowed_token_ids, logit_bias,
    bad words, and the stop tokens that min_tokens forbids for now. None when no row needs anything.

    Rows with allowed_token_ids start at -inf with their allowed tokens at 0; then each row's additive
    entries (one per token: a ban overrides a logit_bias value) are added, so a ban on an allowed
    token still bans it and a bias on a token outside the allowed set leaves it at -inf.
    """
    biases = [_row_bias(r) for r in requests]
    if all(b is None for b in biases):
        return None
    out = torch.zeros(len(requests), vocab, dtype=torch.float32, device=device)
    _restrict_to_allowed(out, [b[0] if b else None for b in biases], device)
    _add_additive(out, [b[1] if b else {} for b in biases], device)
    return out


def _restrict_to_allowed(out: torch.Tensor, allowed: list[list[int] | None], device: torch.device) -> None:
    """Rows with an allowed list: -inf everywhere (one row-index copy, one fill), then 0 at their allowed
    tokens (one pair copy, one write)."""
    restricted = [i for i, tokens in enumerate(allowed) if tokens is not None]
    if not restricted:
        return
    out.index_fill_(0, to_device(restricted, torch.long, device), float("-inf"))
    rows, tokens = _pairs([t or [] for t in allowed])
    index = _index_to_device(rows, tokens, device)
    out.index_put_(index, torch.zeros(len(tokens), dtype=torch.float32, device=device))


def _add_additive(out: torch.Tensor, additive: list[dict[int, float]], device: torch.device) -> None:
    """Add each row's {token: value} entries: one pair copy, one value copy, one accumulating write
    (each token appears once per row, so accumulating adds each value to the base exactly once)."""
    rows, tokens, values = [], [], []
    for i, entries in enumerate(additive):
        rows.extend([i] * len(entries))
        tokens.extend(entries.keys())
        values.extend(entries.values())
    if not tokens:
        return
    index = _index_to_device(rows, tokens, device)
    out.index_put_(index, to_device(values, torch.float32, device), accumulate=True)


def _row_bias(request: CachedRequestState) -> tuple[list[int] | None, dict[int, float]] | None:
    """(allowed_token_ids, {token: additive value}) for one row, or None when it needs no bias."""
    params = request.sampling_params
    if (
        not params.logit_bias
        and params.allowed_token_ids is None
        and not params.bad_words_token_ids
        and len(request.output_token_ids) >= params.min_tokens
    ):
        return None  # the common row, every step: nothing to build
    additive: dict[int, float] = dict(params.logit_bias or {})
    for token in _banned_tokens(request):
        additive[token] = float("-inf")
    if params.allowed_token_ids is None and not additive:
        return None
    return params.allowed_token_ids, additive


def _banned_tokens(request: CachedRequestState) -> list[int]:
    """Tokens the next step must not produce: the stop tokens while min_tokens is not reached, and the
    last token of each bad word whose other tokens end the output so far."""
    params, output = request.sampling_params, request.output_token_ids
    banned = []
    if len(output) < params.min_tokens:
        banned.extend(request.stop_token_set)
    for words in params.bad_words_token_ids:
        prefix = words[:-1]
        if not prefix or output[-len(prefix) :] == prefix:
            banned.append(words[-1])
    return banned


def _pairs(token_lists: list[list[int]]) -> tuple[list[int], list[int]]:
    """Flat (row, token) lists over the rows' token lists, built on the host."""
    rows: list[int] = []
    tokens: list[int] = []
    for i, ids in enumerate(token_lists):
        rows.extend([i] * len(ids))
        tokens.extend(ids)
    return rows, tokens


def _index_to_device(rows: list[int], tokens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors on `device` from one [2, N] int64 copy (not one per row or per list)."""
    both = to_device([rows, tokens], torch.long, device)
    return both[0], both[1]
