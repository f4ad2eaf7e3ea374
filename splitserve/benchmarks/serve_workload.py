"""`splitserve bench serve`'s random dataset (vLLM's): prompt and output lengths drawn from one seeded
generator, prompts as token ids (or text re-encoded to its length for chat, or common English words
without a tokenizer) after a shared prefix, the arrival schedule (gamma gaps of a Poisson process,
or bursts), a share of priority requests, and each request's OpenAI body."""

from __future__ import annotations

import argparse
import math
import random

import numpy as np

from splitserve.benchmarks.serve_client import WORDS as _WORDS
from splitserve.benchmarks.serve_client import Request

_FIT_ROUNDS = 4  # decode/re-encode rounds to bring a chat prompt to its token length


def arrival_gaps(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between successive requests: gamma draws with shape=burstiness and mean 1/rate (shape 1 is
    the exponential of a Poisson process), as vLLM draws them; all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count).tolist()


def sample_lengths(rng: random.Random, count: int, base: int, ratio: float) -> list[int]:
    """vLLM's random-dataset lengths: uniform integers in [base*(1-ratio), base*(1+ratio)], at least 1."""
    low, high = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def _text_of_length(tokenizer, ids: list[int], rng: random.Random, pool: list[int]) -> tuple[str, int]:
    """Text that encodes to len(ids) tokens, or close: random ids rarely survive decode -> encode unchanged
    (neighbouring pieces merge or split), so the re-encoded ids are trimmed or padded and decoded again."""
    target = len(ids)
    for _ in range(_FIT_ROUNDS):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == target:
            break
        ids = encoded[:target] + [rng.choice(pool) for _ in range(target - len(encoded))]
    return text, len(encoded)


def make_requests(ns: argparse.Namespace, tokenizer, chat: bool) -> list[Request]:
    """The random dataset: a shared prefix plus random tokens (or words) per prompt, with the input and output
    lengths drawn from one seeded generator so that a run can be repeated exactly."""
    rng = random.Random(ns.seed)
    input_lens = sample_lengths(rng, ns.num_prompts, ns.random_input_len, ns.random_range_ratio)
    output_lens = sample_lengths(rng, ns.num_prompts, ns.random_output_len, ns.random_range_ratio)
    if tokenizer is None:
        prefix = [rng.choice(_WORDS) for _ in range(ns.random_prefix_len)]
        words = [
            Request(" ".join(prefix + [rng.choice(_WORDS) for _ in range(n)]), len(prefix) + n, out)
            for n, out in zip(input_lens, output_lens)
        ]
        return _with_priorities(words, ns.priority_fraction)
    special = set(tokenizer.all_special_ids)
    pool = [t for t in range(tokenizer.vocab_size) if t not in special]
    prefix = [rng.choice(pool) for _ in range(ns.random_prefix_len)]
    requests = []
    for n, out in zip(input_lens, output_lens):
        ids = prefix + [rng.choice(pool) for _ in range(n)]
        if chat:
            text, length = _text_of_length(tokenizer, ids, rng, pool)
            requests.append(Request(text, length, out))
        else:
            requests.append(Request(ids, len(ids), out))
    return _with_priorities(requests, ns.priority_fraction)


def _with_priorities(requests: list[Request], fraction: float) -> list[Request]:
    """Request i gets priority -1 when floor((i + 1) f) > floor(i f): a share f, spread evenly."""
    for i, request in enumerate(requests):
        if math.floor((i + 1) * fraction) > math.floor(i * fraction):
            request.priority = -1
    return requests


def request_body(request: Request, ns: argparse.Namespace, model: str, chat: bool) -> dict:
    """One streamed OpenAI request asking for usage in the last chunk; chat sends max_completion_tokens,
    completions max_tokens, as vLLM's client does."""
    body: dict = {
        "model": model,
        "temperature": ns.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body |= {"messages": [{"role": "user", "content": request.prompt}], "max_completion_tokens": request.output_len}
    else:
        body |= {"prompt": request.prompt, "max_tokens": request.output_len}
    if ns.ignore_eos:
        body["ignore_eos"] = True
    if ns.guided_json is not None:
        body["guided_json"] = ns.guided_json
    if request.priority:
        body["priority"] = request.priority
    return body | (ns.extra_body or {})
