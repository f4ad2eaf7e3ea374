"""build_sampling_metadata against a plain per-row reference (the per-request logic it replaces), the
None-ness of its optional fields, and a number of host->device copies that does not grow with the batch."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import splitserve.executor.sampling_metadata as sm
from splitserve.executor.input_batch import CachedRequestState, SampleSlot
from splitserve.executor.sampler import SamplingMetadata
from splitserve.executor.sampling_metadata import build_sampling_metadata
from splitserve.sampling_params import SamplingParams

V = 16
EOS = 0
CPU = torch.device("cpu")
INF = float("inf")


def make(rid: str, prompt, output=(), bad_words=(), **params) -> SampleSlot:
    """What sampling reads of a request: the model runner's state, as of its next output token."""
    sp = SamplingParams(max_tokens=16, **params)
    sp.bad_words_token_ids = [list(w) for w in bad_words]  # filled by the processor in the engine
    stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {EOS})
    state = CachedRequestState(rid, list(prompt), sp, stop, output_token_ids=list(output))
    return SampleSlot(state, len(output))


# --- the per-row reference: the old model-runner logic, one request at a time -----------------------
def reference(requests: list[SampleSlot], vocab: int) -> SamplingMetadata:
    params = [r.sampling_params for r in requests]
    temps = [p.temperature for p in params]
    meta = SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32), all_greedy=all(t < 1e-5 for t in temps)
    )
    if any(p.top_k for p in params):
        meta.top_k = torch.tensor([p.top_k or vocab for p in params], dtype=torch.long)
    if any(p.top_p < 1.0 for p in params):
        meta.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    if any(p.min_p > 0.0 for p in params):
        meta.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    meta.seeds = {
        i: (r.sampling_params.seed, r.sample_index)
        for i, r in enumerate(requests)
        if r.sampling_params.seed is not None
    }
    reference_penalties(meta, requests, vocab)
    meta.logit_bias = reference_logit_bias(requests, vocab)
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = max(logprobs) if logprobs else None
    return meta


_NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def reference_penalties(meta: SamplingMetadata, requests: list[SampleSlot], vocab: int) -> None:
    params = [r.sampling_params for r in requests]
    used = [name for name, neutral in _NEUTRAL.items() if any(getattr(p, name) != neutral for p in params)]
    if not used:
        return
    meta.output_counts = torch.zeros(len(requests), vocab)
    for i, r in enumerate(requests):
        for token in r.output_token_ids:
            meta.output_counts[i, token] += 1
    for name in used:
        setattr(meta, name, torch.tensor([float(getattr(p, name)) for p in params]))
    if "repetition_penalty" in used:
        meta.prompt_mask = torch.zeros(len(requests), vocab, dtype=torch.bool)
        for i, r in enumerate(requests):
            for token in r.prompt_token_ids:
                meta.prompt_mask[i, token] = True


def reference_logit_bias(requests: list[SampleSlot], vocab: int) -> torch.Tensor | None:
    out = torch.zeros(len(requests), vocab)
    needed = False
    for i, r in enumerate(requests):
        p, output = r.sampling_params, r.output_token_ids
        additive = dict(p.logit_bias or {})
        if len(output) < p.min_tokens:
            for token in r.stop_token_set:
                additive[token] = -INF
        for words in p.bad_words_token_ids:
            prefix = words[:-1]
            if not prefix or output[-len(prefix) :] == prefix:
                additive[words[-1]] = -INF
        if p.allowed_token_ids is None and not additive:
            continue
        needed = True
        if p.allowed_token_ids is not None:
            out[i] = -INF
            for token in p.allowed_token_ids:
                out[i, token] = 0.0
        for token, value in additive.items():
            out[i, token] += value
    return out if needed else None


def assert_same(got: SamplingMetadata, want: SamplingMetadata) -> None:
    for f in dataclasses.fields(SamplingMetadata):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), f.name
            assert a.dtype == b.dtype and a.shape == b.shape, (f.name, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a, b), (f.name, a, b)
        else:
            assert a == b and (a is None) == (b is None), (f.name, a, b)


# --- a batch with a bit of everything --------------------------------------------------------------
def mixed_batch(copies: int = 1) -> list[SampleSlot]:
    specs = [
        {"prompt": [1, 2, 3], "temperature": 0.0},  # greedy, nothing else
        {
            "prompt": [4, 4, 5],
            "output": [3, 3, 7, 3],
            "temperature": 0.7,
            "top_k": 5,
            "seed": 11,
            "repetition_penalty": 1.3,
        },
        {
            "prompt": [6],
            "output": [1, 2, 1, 1],
            "top_p": 0.9,
            "frequency_penalty": 0.5,
            "presence_penalty": -0.4,
            "logit_bias": {4: 2.5, 9: -3.0},
            "logprobs": 2,
        },
        {
            "prompt": [2, 8],
            "output": [9, 7, 8],
            "min_p": 0.1,
            "allowed_token_ids": [2, 5, 9, 11],
            "logit_bias": {5: 1.5, 6: 4.0, 9: -1.25},
            "bad_words": [[5], [7, 8, 11]],
            "logprobs": 0,
        },
        # min_tokens not reached: the stop ids and eos are banned, over a logit_bias on one of them
        {
            "prompt": [3],
            "output": [4, 13],
            "temperature": 1.2,
            "seed": 5,
            "min_tokens": 5,
            "stop_token_ids": [12],
            "logit_bias": {12: 3.0, 10: 0.5},
            "bad_words": [[1, 2, 14]],
        },
        # min_tokens reached: nothing banned
        {"prompt": [5, 6, 7], "output": [12, 4, 13], "min_tokens": 2, "stop_token_ids": [12], "top_k": 3},
        # a stop token that is also allowed stays banned
        {
            "prompt": [9, 9],
            "output": [],
            "repetition_penalty": 0.8,
            "min_tokens": 1,
            "ignore_eos": True,
            "stop_token_ids": [15],
            "allowed_token_ids": [15, 14, 14],
        },
        {"prompt": [10], "output": [2], "temperature": 0.0, "bad_words": [[3, 2, 6], [2, 7]], "logprobs": 5},
    ]
    requests = []
    for c in range(copies):
        for j, spec in enumerate(specs):
            spec = dict(spec)
            requests.append(
                make(f"r{c}-{j}", spec.pop("prompt"), spec.pop("output", ()), spec.pop("bad_words", ()), **spec)
            )
    return requests


def check(requests: list[SampleSlot], vocab: int = V) -> SamplingMetadata:
    got = build_sampling_metadata(requests, vocab, CPU)
    assert_same(got, reference(requests, vocab))
    return got


def test_mixed_batch_matches_the_per_row_reference():
    meta = check(mixed_batch())
    for name in (
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "prompt_mask",
        "output_counts",
        "logit_bias",
    ):
        assert getattr(meta, name) is not None, name
    assert set(meta.seeds) == {1, 4} and meta.max_num_logprobs == 5 and not meta.all_greedy


def test_mixed_batch_values_spelled_out():
    meta = check(mixed_batch())
    assert meta.top_k.tolist() == [V, 5, V, V, V, 3, V, V]
    assert meta.output_counts[1, 3] == 3 and meta.output_counts[1, 7] == 1 and meta.output_counts[2, 1] == 3
    assert meta.prompt_mask[1].nonzero().flatten().tolist() == [4, 5]
    bias = meta.logit_bias
    assert bias[0].eq(0).all() and bias[5].eq(0).all()  # nothing asked / min_tokens reached
    assert bias[2, 4] == 2.5 and bias[2, 9] == -3.0
    assert bias[3, 2] == 0 and bias[3, 9] == -1.25 and bias[3, 11] == -INF  # 11: bad word 7 8 -> 11
    assert bias[3, 5] == -INF and bias[3, 6] == -INF  # banned allowed; bias outside allowed
    assert bias[4, 12] == -INF and bias[4, EOS] == -INF and bias[4, 10] == 0.5  # ban overrides logit_bias
    assert bias[4, 14] == 0  # bad-word prefix 1 2 not matched
    assert bias[6, 15] == -INF and bias[6, 14] == 0 and bias[6, EOS] == -INF and bias[6, 1] == -INF
    assert bias[7, 7] == -INF and bias[7, 6] == 0


def test_random_batches_match_the_per_row_reference():
    rng = random.Random(0)
    for _ in range(30):
        check([random_request(rng, f"q{i}") for i in range(rng.randint(1, 12))])


def random_request(rng: random.Random, rid: str) -> SampleSlot:
    def tokens(n: int) -> list[int]:
        return [rng.randrange(V) for _ in range(n)]

    params = {"temperature": rng.choice([0.0, 0.5, 1.0])}
    maybe = {
        "top_k": lambda: rng.randint(1, V),
        "top_p": lambda: rng.uniform(0.1, 1.0),
        "min_p": lambda: rng.random(),
        "seed": lambda: rng.randrange(1000),
        "repetition_penalty": lambda: rng.uniform(0.5, 2.0),
        "frequency_penalty": lambda: rng.uniform(-2, 2),
        "presence_penalty": lambda: rng.uniform(-2, 2),
        "logit_bias": lambda: {t: rng.uniform(-100, 100) for t in tokens(rng.randint(1, 4))},
        "allowed_token_ids": lambda: tokens(rng.randint(1, 5)),
        "logprobs": lambda: rng.randint(0, 5),
        "min_tokens": lambda: rng.randint(0, 6),
        "stop_token_ids": lambda: tokens(rng.randint(0, 2)),
    }
    for name, value in maybe.items():
        if rng.random() < 0.3:
            params[name] = value()
    output = tokens(rng.randint(0, 8))
    bad = [tokens(rng.randint(1, 3)) for _ in range(rng.randint(0, 2))]
    if output and rng.random() < 0.5:
        bad.append(output[-2:] + tokens(1))  # a multi-token bad word whose prefix ends the output
    return make(rid, tokens(rng.randint(1, 6)), output, bad, **params)


@pytest.mark.parametrize("greedy", [False, True])
def test_temperature_only_leaves_every_optional_field_unset(greedy):
    temps = [0.0, 0.0] if greedy else [0.0, 0.8]
    requests = [make(f"t{i}", [1, 2], [3, 3], temperature=t, min_tokens=1) for i, t in enumerate(temps)]
    meta = check(requests)
    assert meta.all_greedy is greedy and meta.seeds == {} and meta.temperature.dtype == torch.float32
    for f in dataclasses.fields(SamplingMetadata):
        if f.name not in ("temperature", "all_greedy", "seeds"):
            assert getattr(meta, f.name) is None, f.name


def test_only_the_fields_asked_for_are_built():
    meta = check([make("a", [1], [2, 2], frequency_penalty=0.3), make("b", [4], [], allowed_token_ids=[3])])
    assert meta.output_counts is not None and meta.frequency_penalty is not None and meta.logit_bias is not None
    assert meta.prompt_mask is None and meta.repetition_penalty is None and meta.presence_penalty is None
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None and meta.max_num_logprobs is None


def test_host_to_device_copies_do_not_grow_with_the_batch(monkeypatch):
    calls = []

    def counting(values, dtype, device):
        calls.append(dtype)
        return torch.tensor(values, dtype=dtype)

    monkeypatch.setattr(sm, "to_device", counting)
    monkeypatch.setattr(sm, "move", lambda t, d: calls.append("move") or t, raising=False)
    counts = []
    for copies in (1, 10):  # 8 and 80 requests, every spec in both
        calls.clear()
        check(mixed_batch(copies))
        counts.append(len(calls))
    assert counts[0] == counts[1], counts
    assert counts[0] <= 16, counts
