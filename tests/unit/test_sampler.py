"""The batched sampler on synthetic logits: exact processor arithmetic, and sampling statistics
checked against the target distributions with generous (but failing-when-broken) tolerances."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.executor.sampler import (
    Sampler,
    SamplingMetadata,
    apply_logit_processors,
    apply_min_p,
    apply_top_k_top_p,
    gather_logprobs,
)

V = 8
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
N = 20000  # draws per statistical test: the standard error of a frequency is <= 0.0036


def _meta(rows: int, **kw) -> SamplingMetadata:
    kw.setdefault("temperature", torch.ones(rows))
    kw.setdefault("all_greedy", False)
    return SamplingMetadata(**kw)


def _frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).float() / tokens.numel()


def _draw(logits_row: torch.Tensor, **kw) -> torch.Tensor:
    logits = logits_row.expand(N, V).clone()
    fields = {k: (v.expand(N) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return Sampler()(logits, _meta(N, **fields)).token_ids


def test_greedy_takes_argmax():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    out = Sampler()(logits, _meta(2, temperature=torch.zeros(2), all_greedy=True))
    assert out.token_ids.tolist() == [0, V - 1]


def test_temperature_sampling_matches_softmax():
    torch.manual_seed(0)
    for t in (0.5, 1.0, 2.0):
        freq = _frequencies(_draw(LOGITS, temperature=torch.tensor(t)))
        expected = torch.softmax(LOGITS / t, -1)
        assert torch.allclose(freq, expected, atol=0.015), (t, freq, expected)


def test_top_k_one_is_greedy_and_top_k_limits_support():
    torch.manual_seed(0)
    assert set(_draw(LOGITS, top_k=torch.tensor(1)).tolist()) == {0}
    freq = _frequencies(_draw(LOGITS, top_k=torch.tensor(3)))
    expected = torch.softmax(LOGITS[:3], -1)
    assert freq[3:].sum() == 0
    assert torch.allclose(freq[:3], expected, atol=0.015)


def test_top_p_keeps_the_smallest_nucleus_with_enough_mass():
    torch.manual_seed(0)
    probs = torch.softmax(LOGITS, -1)  # 0.53, 0.20, 0.12, 0.07, ...
    top_p = float(probs[:2].sum()) + 0.01  # needs the first three tokens
    freq = _frequencies(_draw(LOGITS, top_p=torch.tensor(top_p)))
    assert freq[3:].sum() == 0
    assert torch.allclose(freq[:3], probs[:3] / probs[:3].sum(), atol=0.015)


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = torch.softmax(LOGITS, -1)[None]
    kept = apply_min_p(probs, torch.tensor([0.2]))
    # p(best) = 0.53: tokens with p < 0.106 go, i.e. all but the first three.
    assert (kept[0, :3] > 0).all() and (kept[0, 3:] == 0).all()


def test_top_k_top_p_rows_are_independent():
    logits = torch.stack([LOGITS, LOGITS])
    out = apply_top_k_top_p(logits, torch.tensor([2, V]), torch.tensor([1.0, 1.0]))
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[1]).all()


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    def sample(batch_rows: int, seed_row: int, indices=range(20)) -> list[int]:
        tokens = []
        for index in indices:
            logits = LOGITS.expand(batch_rows, V).clone()
            meta = _meta(batch_rows, seeds={seed_row: (1234, index)})
            tokens.append(int(Sampler()(logits, meta).token_ids[seed_row]))
        return tokens

    alone = sample(1, 0)
    assert sample(5, 3) == alone
    assert sample(2, 1) == alone
    assert len(set(alone)) > 1  # it really sampled
    # A draw is keyed by the output index alone: the same index gives the same token in any order.
    assert sample(1, 0, reversed(range(20))) == alone[::-1]


def test_seeded_uniforms_are_fixed_functions_of_seed_and_index():
    from splitserve.executor.sampler import seeded_uniform

    draws = [seeded_uniform(seed, i) for seed in (0, 1, -5, 2**40) for i in range(200)]
    assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) == len(draws)
    assert seeded_uniform(7, 3) == seeded_uniform(7, 3) != seeded_uniform(8, 3)
    mean = sum(draws) / len(draws)
    assert abs(mean - 0.5) < 0.03


def test_penalties_and_bias_arithmetic():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    counts = torch.tensor([[0.0, 0.0, 3.0, 0.0]])
    prompt = torch.tensor([[True, True, False, False]])
    meta = _meta(
        1,
        repetition_penalty=torch.tensor([2.0]),
        frequency_penalty=torch.tensor([0.1]),
        presence_penalty=torch.tensor([0.5]),
        prompt_mask=prompt,
        output_counts=counts,
        logit_bias=torch.tensor([[0.0, 0.0, 0.0, 10.0]]),
    )
    out = apply_logit_processors(logits, meta)
    # token 0: seen in prompt, positive -> /2; token 1: seen, negative -> *2;
    # token 2: seen 3x in output -> /2, -0.1*3, -0.5; token 3: unseen, +10 bias.
    assert torch.allclose(out, torch.tensor([[1.0, -4.0, 0.5 - 0.3 - 0.5, 10.5]]))


def test_logprobs_are_raw_and_ranked():
    logits = torch.stack([LOGITS, LOGITS])
    meta = _meta(
        2,
        temperature=torch.tensor([0.0, 0.0]),
        all_greedy=True,
        max_num_logprobs=3,
        logit_bias=torch.tensor([[0.0] * V, [0.0] * (V - 1) + [100.0]]),
    )
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(LOGITS, -1)
    assert out.token_ids.tolist() == [0, V - 1]
    assert out.logprob_token_ids[0].tolist() == [0, 0, 1, 2]
    assert torch.allclose(out.logprobs[0], raw[[0, 0, 1, 2]])
    # The biased row sampled the least likely token: its raw logprob and rank V are reported.
    assert math.isclose(float(out.logprobs[1, 0]), float(raw[V - 1]), rel_tol=1e-6)
    assert out.sampled_ranks.tolist() == [1, V]


@pytest.mark.parametrize("k", [0, 2])
def test_gather_logprobs_shapes(k):
    lp = torch.log_softmax(LOGITS[None], -1)
    ids, vals, ranks = gather_logprobs(lp, k, torch.tensor([2]))
    assert ids.shape == (1, k + 1) and ids[0, 0] == 2 and ranks.tolist() == [3]
