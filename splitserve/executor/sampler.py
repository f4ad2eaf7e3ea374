"""Batched sampling on the model runner's device.

Order of operations (as vLLM's V1 sampler): logprobs are taken from the raw model logits; then logit
processors (allowed tokens, logit_bias, bad words, min_tokens) and penalties adjust the logits;
greedy rows take the argmax, random rows are scaled by temperature, cut by top-k, top-p and min-p,
and sampled by inverting their cumulative distribution at one uniform draw per row (one draw per
row, not one per vocabulary entry, keeps sampling cheap on CPU). A seeded request's draw for its
output token i is a fixed function of (seed, i) (`seeded_uniform`): its tokens do not depend on what
else is in the batch, on preemptions, on which instance of a PD deployment samples them, nor on how
many draft tokens speculative decoding verified before. A batch that asks for nothing but
temperature (or greedy) is sampled by one fused kernel (splitserve.kernels.sample: C++ on CPU,
Triton on CUDA) straight from the model-dtype logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitserve import kernels
from splitserve.executor.host import to_device

GREEDY_TEMPERATURE = 1e-5  # a row whose temperature is below this is greedy


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [R] float32; 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [R] int64; vocab size means "no limit"
    top_p: torch.Tensor | None = None  # [R] float32
    min_p: torch.Tensor | None = None  # [R] float32
    seeds: dict[int, tuple[int, int]] = field(default_factory=dict)  # row -> (seed, output index it samples)
    repetition_penalty: torch.Tensor | None = None  # [R]
    frequency_penalty: torch.Tensor | None = None  # [R]
    presence_penalty: torch.Tensor | None = None  # [R]
    prompt_mask: torch.Tensor | None = None  # [R, V] bool: token occurs in the prompt
    output_counts: torch.Tensor | None = None  # [R, V] float32: occurrences in the output
    logit_bias: torch.Tensor | None = None  # [R, V] float32 additive bias (-inf bans)
    max_num_logprobs: int | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R]
    sampled_logprobs: torch.Tensor | None = None  # [R] float32: each token's logprob under the raw logits
    # When logprobs were asked for: [R, 1 + k] ids and logprobs (sampled token first) and [R] ranks.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None

    def host_tensors(self) -> list[torch.Tensor]:
        """What the host reads: the tokens and their logprobs, then the top-k logprob tensors if any."""
        tensors = [self.token_ids, self.sampled_logprobs]
        if self.logprobs is None:
            return tensors
        return tensors + [self.logprob_token_ids, self.logprobs, self.sampled_ranks]


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if _plain(meta) and kernels.sample_supported(logits):
            # Temperature (or greedy) only: one fused pass per row (CPU or CUDA), on the model-dtype logits.
            u = None if meta.all_greedy else _uniforms(logits, meta.seeds)
            return SamplerOutput(*kernels.sample(logits, meta.temperature, u))
        raw = logits.float()
        raw_logprobs = torch.log_softmax(raw, dim=-1) if meta.max_num_logprobs is not None else None
        logits = apply_logit_processors(raw, meta)
        greedy = logits.argmax(dim=-1)
        tokens = greedy if meta.all_greedy else self._sample(logits, greedy, meta)
        out = SamplerOutput(tokens)
        if raw_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = gather_logprobs(
                raw_logprobs, meta.max_num_logprobs, tokens
            )
            out.sampled_logprobs = out.logprobs[:, 0]
        else:
            out.sampled_logprobs = raw.gather(-1, tokens[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1)
        return out

    def _sample(self, logits: torch.Tensor, greedy: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        is_greedy = meta.temperature < GREEDY_TEMPERATURE
        # (capped: an infinite temperature would turn a banned token's -inf into NaN)
        temperature = torch.where(is_greedy, torch.ones_like(meta.temperature), meta.temperature).clamp(max=1e30)
        logits = logits / temperature[:, None]
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            probs = apply_min_p(probs, meta.min_p)
        sampled = inverse_cdf_sample(probs, meta.seeds)
        return torch.where(is_greedy, greedy, sampled)


def apply_logit_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.logit_bias is not None:
        logits = logits + meta.logit_bias
    if meta.repetition_penalty is not None:
        seen = meta.prompt_mask | (meta.output_counts > 0)
        penalty = meta.repetition_penalty[:, None]
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if meta.frequency_penalty is not None:
        logits = logits - meta.frequency_penalty[:, None] * meta.output_counts
    if meta.presence_penalty is not None:
        logits = logits - meta.presence_penalty[:, None] * (meta.output_counts > 0).float()
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(-1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        cut = cumulative <= (1.0 - top_p[:, None])
        cut[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return probs.masked_fill(probs < threshold, 0.0)


def _plain(meta: SamplingMetadata) -> bool:
    """Nothing but temperature: no logprobs, logit processors, penalties, top-k/top-p/min-p."""
    return (
        meta.max_num_logprobs is None
        and meta.logit_bias is None
        and meta.repetition_penalty is None
        and meta.frequency_penalty is None
        and meta.presence_penalty is None
        and meta.top_k is None
        and meta.top_p is None
        and meta.min_p is None
    )


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int) -> float:
    """A uniform draw in [0, 1) that depends on (seed, index) only: SplitMix64 of both, 53 bits."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64)) >> 11) * 2.0**-53


def _uniforms(like: torch.Tensor, seeds: dict[int, tuple[int, int]]) -> torch.Tensor:
    """One uniform draw per row [R]; a seeded row's is seeded_uniform(seed, output index)."""
    u = torch.rand(like.shape[0], device=like.device)
    if seeds:  # through pinned memory: a plain copy to a GPU would wait for the whole queue
        rows = list(seeds)
        values = [seeded_uniform(*seeds[row]) for row in rows]
        u[to_device(rows, torch.long, like.device)] = to_device(values, torch.float32, like.device)
    return u


def inverse_cdf_sample(probs: torch.Tensor, seeds: dict[int, tuple[int, int]]) -> torch.Tensor:
    """One token per row of (unnormalised) `probs`: the first whose cumulative mass exceeds u * total."""
    u = _uniforms(probs, seeds)[:, None]
    cdf = probs.cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return tokens.clamp_(max=probs.shape[-1] - 1).squeeze(1)


def gather_logprobs(logprobs: torch.Tensor, k: int, tokens: torch.Tensor):
    """Ids and logprobs of the sampled token followed by the top-k, and the sampled token's rank."""
    sampled_lp = logprobs.gather(-1, tokens[:, None])
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        return torch.cat([tokens[:, None], top_ids], dim=1), torch.cat([sampled_lp, top_lp], dim=1), ranks
    return tokens[:, None], sampled_lp, ranks


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of the tokens each row's bitmask forbids. `bitmask` is
    int32 [len(rows), ceil(V / 32)]; bit b of word w allows token 32 w + b."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))
