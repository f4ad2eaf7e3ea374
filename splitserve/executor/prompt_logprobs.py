"""Prompt logprobs (SamplingParams.prompt_logprobs): for the prompt positions a step computes, the
logprob of each next prompt token, its rank, and the top k, on the device."""

from __future__ import annotations

import torch

from splitserve.executor.host import to_device
from splitserve.executor.input_batch import CachedRequestState, PromptLogprobSpan

PROMPT_LOGPROBS_CHUNK = 512  # prompt positions whose full-vocabulary logprobs exist at once


def prompt_logprobs(
    model, request: CachedRequestState, hidden: torch.Tensor, span: PromptLogprobSpan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For prompt positions scored this step (hidden rows first_index.., each scoring the next
    prompt token): ids and logprobs [count, 1 + k] (the prompt token, then the top k) and the
    prompt token's rank [count], on the device. Computed PROMPT_LOGPROBS_CHUNK rows at a time:
    a whole 8192-token chunk's float32 logits over a 150k vocabulary would take ~10 GB."""
    first, count = span.first_index, span.count
    targets = to_device(request.prompt_token_ids[span.start + 1 : span.start + 1 + count], torch.long, hidden.device)
    k = request.sampling_params.prompt_logprobs or 0
    ids = torch.empty(count, 1 + k, dtype=torch.long, device=hidden.device)
    lps = torch.empty(count, 1 + k, dtype=torch.float32, device=hidden.device)
    ranks = torch.empty(count, dtype=torch.long, device=hidden.device)
    for lo in range(0, count, PROMPT_LOGPROBS_CHUNK):
        hi = min(lo + PROMPT_LOGPROBS_CHUNK, count)
        logprobs = torch.log_softmax(model.compute_logits(hidden[first + lo : first + hi]).float(), dim=-1)
        ids[lo:hi, 0] = targets[lo:hi]
        lps[lo:hi, :1] = logprobs.gather(-1, targets[lo:hi, None])
        ranks[lo:hi] = (logprobs > lps[lo:hi, :1]).sum(-1) + 1
        if k:
            lps[lo:hi, 1:], ids[lo:hi, 1:] = logprobs.topk(k, dim=-1)
    return ids, lps, ranks
