"""Sampling parameters through the whole engine, on a tiny random model with a real tokenizer."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.helpers.hf_reference import load_hf_model

PROMPT = {"prompt_token_ids": [17, 300, 45, 901, 12, 77, 5, 640, 33]}
OTHERS = [{"prompt_token_ids": [400 + i, 7, 8, 9 + i]} for i in range(5)]


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(tiny_models["llama"], dtype="float32", max_model_len=256, use_tqdm_on_load=False)


def _one(llm: LLM, params: SamplingParams, prompt=PROMPT):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def _greedy(llm: LLM, n: int = 24):
    return _one(llm, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)).outputs[0]


def test_top_k_one_equals_greedy(llm):
    sampled = _one(llm, SamplingParams(temperature=1.0, top_k=1, max_tokens=24, ignore_eos=True, seed=3))
    assert sampled.outputs[0].token_ids == _greedy(llm).token_ids


def test_seed_gives_the_same_tokens_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=42)
    alone = _one(llm, params).outputs[0].token_ids
    mixed = llm.generate(
        [OTHERS[0], PROMPT, *OTHERS[1:]],
        [SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True, seed=i) for i in range(1)]
        + [params]
        + [SamplingParams(temperature=1.0, max_tokens=10) for _ in OTHERS[1:]],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = _one(llm, params.clone(seed=43)).outputs[0].token_ids
    assert other_seed != alone


def test_n_samples_share_the_prompt_blocks(llm):
    long_prompt = {"prompt_token_ids": list(range(100, 140))}
    out = _one(llm, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=1, ignore_eos=True), long_prompt)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Samples after the first found the prompt's full blocks (32 of 40 tokens) in the prefix cache.
    assert out.num_cached_tokens == 32


def test_stop_strings_cut_exactly(llm):
    text = _greedy(llm).text
    stop = text[6:10]
    assert len(stop) == 4
    cut = text.index(stop)  # its first occurrence, which may come before position 6
    out = _one(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])).outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    inc = _one(
        llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    ).outputs[0]
    assert inc.text == text[: cut + len(stop)]


def test_stop_token_ids(llm):
    tokens = _greedy(llm).token_ids
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    out = _one(llm, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])).outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_min_tokens_defers_stop_tokens(llm):
    tokens = _greedy(llm).token_ids
    stop_id = tokens[0]
    out = _one(llm, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id], min_tokens=4)).outputs[0]
    assert len(out.token_ids) >= 4 and stop_id not in out.token_ids[:4]


def test_logit_bias_and_bad_words(llm, smollm_tokenizer):
    the = smollm_tokenizer(" the", add_special_tokens=False).input_ids
    assert len(the) == 1 and the[0] < 1024
    biased = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={the[0]: 100.0})
    assert _one(llm, biased).outputs[0].token_ids == the * 6
    # A bad word is never generated, even against a huge bias towards it.
    banned = _one(llm, biased.clone(bad_words=["the"])).outputs[0]
    assert the[0] not in banned.token_ids and len(banned.token_ids) == 6


def test_max_tokens_and_length_finish(llm):
    out = _one(llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)).outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_repetition_penalty_matches_transformers(llm, tiny_models):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8)
    ours = _one(llm, params).outputs[0].token_ids
    model = load_hf_model(tiny_models["llama"])
    ids = torch.tensor([PROMPT["prompt_token_ids"]])
    with torch.inference_mode():
        ref = model.generate(
            ids, max_new_tokens=16, do_sample=False, repetition_penalty=1.8, attention_mask=torch.ones_like(ids)
        )[0, ids.shape[1] :].tolist()
    assert ours == ref
    assert ours != _greedy(llm, 16).token_ids


def test_frequency_and_presence_penalties_reduce_repeats(llm):
    def repeats(tokens: list[int]) -> int:
        return len(tokens) - len(set(tokens))

    base = _greedy(llm, 48).token_ids
    penalized = (
        _one(
            llm,
            SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0),
        )
        .outputs[0]
        .token_ids
    )
    assert repeats(base) > 0 and repeats(penalized) < repeats(base)


@pytest.mark.parametrize("chunk", [512, 3])  # 3: the prompt's 8 scored positions in 3 pieces
def test_logprobs_and_prompt_logprobs(llm, tiny_models, monkeypatch, chunk):
    monkeypatch.setattr("splitserve.executor.prompt_logprobs.PROMPT_LOGPROBS_CHUNK", chunk)
    out = _one(llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2))
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for step, token in zip(completion.logprobs, completion.token_ids):
        assert token in step and step[token].rank == 1 and len(step) == 3
    assert completion.cumulative_logprob == pytest.approx(
        sum(s[t].logprob for s, t in zip(completion.logprobs, completion.token_ids))
    )
    prompt = PROMPT["prompt_token_ids"]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    model = load_hf_model(tiny_models["llama"])
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry and len(entry) <= 3
        top = ref[pos - 1].topk(2)
        assert all(int(t) in entry for t in top.indices)
        assert entry[prompt[pos]].logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
        assert entry[prompt[pos]].rank == int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum()) + 1


def test_invalid_input_is_refused_with_clear_errors(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _one(llm, SamplingParams(), {"prompt_token_ids": [5, 99999]})
    with pytest.raises(ValueError, match="maximum model length"):
        _one(llm, SamplingParams(), {"prompt_token_ids": [5] * 300})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
    # A bad prompt in a batch refuses the whole call and leaves nothing behind in the engine.
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([PROMPT, {"prompt_token_ids": [99999]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert not llm.llm_engine.engine_core.has_unfinished_requests()
    # The engine still works after refusing bad input.
    assert len(_greedy(llm, 3).token_ids) == 3
