"""Speculative decoding gives exactly what the target alone gives.

A random tiny model rarely repeats itself, so an n-gram proposer would hardly ever have its drafts
accepted. These tests put an oracle in the proposer's place: it drafts the reference output (the
model run without speculation) with every third token corrupted, so verification accepts runs of
drafts and rejects others at known places, in a batch where some requests draft and some do not.
Greedy and seeded outputs must then be identical token for token, and unseeded sampling must keep
the target's distribution."""

from __future__ import annotations

from collections import Counter

import pytest

from splitserve import LLM, SamplingParams
from splitserve.sampling_params import GuidedDecodingParams
from tests.helpers.spec_oracle import PROMPTS, OracleProposer

K = 4


def _inputs(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def plain(model) -> LLM:
    return LLM(model, dtype="float32", max_model_len=256, use_tqdm_on_load=False)


@pytest.fixture(scope="module")
def speculative(model) -> LLM:
    return LLM(
        model,
        dtype="float32",
        max_model_len=256,
        use_tqdm_on_load=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": K},
    )


def _with_oracle(llm: LLM, references: dict, vocab: int = 1024) -> OracleProposer:
    oracle = OracleProposer(references, vocab)
    llm.llm_engine.engine_core.speculator.proposer = oracle
    return oracle


def _run(llm: LLM, prompts, params: SamplingParams):
    return [o.outputs[0] for o in llm.generate(_inputs(prompts), params, use_tqdm=False)]


def test_greedy_tokens_and_logprobs_match_the_target_alone(plain, speculative):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    expected = _run(plain, PROMPTS, params)
    # The last prompt drafts nothing: the batch mixes drafting and plain decoding requests.
    oracle = _with_oracle(speculative, {tuple(p): o.token_ids for p, o in zip(PROMPTS[:3], expected)})
    stats_before = speculative.llm_engine.engine_core.speculator.stats.num_accepted_tokens
    got = _run(speculative, PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for g, e in zip(got, expected):
        for g_entry, e_entry in zip(g.logprobs, e.logprobs):
            assert g_entry.keys() == e_entry.keys()
            for token, lp in e_entry.items():
                assert g_entry[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert g.cumulative_logprob == pytest.approx(e.cumulative_logprob, abs=1e-3)
    stats = speculative.llm_engine.engine_core.speculator.stats
    assert oracle.proposed > 0 and stats.num_accepted_tokens - stats_before > 0
    assert 0 < stats.acceptance_rate < 1  # runs accepted, corrupted drafts rejected


def test_seeded_sampling_draws_the_same_tokens(plain, speculative):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True, seed=7)
    expected = _run(plain, PROMPTS, params)
    _with_oracle(speculative, {tuple(p): o.token_ids for p, o in zip(PROMPTS, expected)})
    assert [o.token_ids for o in _run(speculative, PROMPTS, params)] == [o.token_ids for o in expected]


def test_penalties_see_the_drafts_before_each_position(plain, speculative):
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=5
    )
    expected = _run(plain, PROMPTS, params)
    _with_oracle(speculative, {tuple(p): o.token_ids for p, o in zip(PROMPTS, expected)})
    assert [o.token_ids for o in _run(speculative, PROMPTS, params)] == [o.token_ids for o in expected]


def test_stops_inside_an_accepted_run_cut_it_there(plain, speculative):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = _run(plain, PROMPTS[:2], greedy)
    _with_oracle(speculative, {tuple(p): o.token_ids for p, o in zip(PROMPTS[:2], full)})
    # max_tokens inside a run of drafts, a stop token id met at each place of one (its first, middle
    # and last token: the text of the tokens accepted before it stays), and a stop string.
    stop_ids = [[full[1].token_ids[at]] for at in (8, 9, 10)]
    stop_text = full[0].text[12:16]
    for params in (
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        *(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=ids) for ids in stop_ids),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_text]),
    ):
        expected, got = _run(plain, PROMPTS[:2], params), _run(speculative, PROMPTS[:2], params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
            (o.token_ids, o.text, o.finish_reason) for o in expected
        ]


def test_structured_output_masks_every_verified_position(plain, speculative):
    guide = GuidedDecodingParams(regex=r"[0-9]{3}-[a-z]{4}-[0-9]{2}")
    params = SamplingParams(temperature=0, max_tokens=40, guided_decoding=guide)
    expected = _run(plain, PROMPTS[:2], params)
    oracle = _with_oracle(speculative, {tuple(p): o.token_ids for p, o in zip(PROMPTS[:2], expected)})
    got = _run(speculative, PROMPTS[:2], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert oracle.proposed > 0


def test_unseeded_sampling_keeps_the_target_distribution(plain, speculative):
    """The third token of 400 samples, with drafts of the greedy continuation: its distribution
    with speculation and without must agree within sampling noise."""
    prompt, n = PROMPTS[0], 400
    greedy = _run(plain, [prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].token_ids
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    without = Counter(o.token_ids[2] for o in _run(plain, [prompt] * n, params))
    _with_oracle(speculative, {tuple(prompt): greedy})
    spec_engine = speculative.llm_engine.engine_core
    accepted_before = spec_engine.speculator.stats.num_accepted_tokens
    with_spec = Counter(o.token_ids[2] for o in _run(speculative, [prompt] * n, params))
    assert spec_engine.speculator.stats.num_accepted_tokens > accepted_before
    tokens = set(without) | set(with_spec)
    distance = sum(abs(without[t] - with_spec[t]) for t in tokens) / (2 * n)
    assert distance < 0.12, (without, with_spec)


def test_a_draft_model_proposes_and_the_target_decides(model, plain, tiny_models):
    """The target as its own draft accepts nearly everything; another model of the same vocabulary
    as draft accepts less; both give the target's tokens. The KV pool is small enough that requests
    are preempted and their draft KV is rebuilt."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in _run(plain, PROMPTS, params)]
    for draft, least_rate in ((model, 0.9), (tiny_models["qwen2"], 0.0)):
        llm = LLM(
            model,
            dtype="float32",
            max_model_len=128,
            use_tqdm_on_load=False,
            num_gpu_blocks_override=10,  # 160 tokens for 4 requests of up to 80 (+ lookahead): preemptions
            speculative_config={"model": draft, "num_speculative_tokens": 3},
        )
        assert [o.token_ids for o in _run(llm, PROMPTS, params)] == expected
        stats = llm.llm_engine.engine_core.speculator.stats
        assert stats.num_drafts > 0 and stats.acceptance_rate >= least_rate
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        del llm


def test_a_draft_with_another_vocabulary_is_refused(tiny_models, tiny_chat_model):
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens"):
        LLM(
            tiny_chat_model,
            dtype="float32",
            speculative_config={"model": tiny_models["llama"], "num_speculative_tokens": 2},
        )


def test_lora_requests_speculate_too(tiny_models, tmp_path):
    """n-gram drafts for requests with and without an adapter: each verified against its own weights."""
    from splitserve.lora.request import LoRARequest
    from tests.helpers.models import make_peft_adapter

    base = tiny_models["llama"]
    adapter = make_peft_adapter(base, str(tmp_path / "lora"), ["q_proj", "v_proj", "down_proj"])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    lora = LoRARequest("a", 1, adapter)
    outputs = {}
    for config in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        llm = LLM(
            base,
            dtype="float32",
            max_model_len=256,
            use_tqdm_on_load=False,
            enable_lora=True,
            speculative_config=config,
        )
        with_adapter = llm.generate(_inputs(PROMPTS[:2]), params, lora_request=lora, use_tqdm=False)
        without = llm.generate(_inputs(PROMPTS[2:]), params, use_tqdm=False)
        outputs[config is None] = [o.outputs[0].token_ids for o in with_adapter + without]
        del llm
    assert outputs[True] == outputs[False]


@pytest.mark.slow
def test_tensor_parallel_ranks_verify_and_draft(model, plain):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.token_ids for o in _run(plain, PROMPTS, params)]
    for config in (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        {"model": model, "num_speculative_tokens": 3},
    ):
        llm = LLM(
            model,
            dtype="float32",
            max_model_len=256,
            use_tqdm_on_load=False,
            tensor_parallel_size=2,
            speculative_config=config,
        )
        assert [o.token_ids for o in _run(llm, PROMPTS, params)] == expected
        assert llm.llm_engine.engine_core.speculator.stats.num_drafts > 0
        del llm
