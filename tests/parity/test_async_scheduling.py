"""Overlap (async) scheduling gives exactly the outputs of step-by-step scheduling.

With async_scheduling the engine launches step N+1 before it reads step N's tokens: a decode's
input token comes from the previous step's sampled tokens on the device, stop conditions are
checked one step late (the extra step's token is dropped), and requests whose sampling reads
their output history (penalties, bad words, min_tokens) make the engine finish the step in flight
first. On CPU the forward is synchronous, so this checks the bookkeeping, not the speed.
"""

from __future__ import annotations

import random

import pytest

from splitserve import LLM, SamplingParams
from splitserve.executor.model_runner import ModelRunner

PROMPTS = [[random.Random(i).randrange(3, 1024) for _ in range(4 + 3 * i)] for i in range(6)]


@pytest.fixture
def overlap_counter(monkeypatch):
    """Counts the steps whose inputs included a token still pending from the step in flight."""
    counts = {"pending_steps": 0}
    original = ModelRunner._input_ids

    def counting(self, batch, previous):
        counts["pending_steps"] += bool(batch.pending_inputs)
        return original(self, batch, previous)

    monkeypatch.setattr(ModelRunner, "_input_ids", counting)
    return counts


def _llm(path: str, overlap: bool, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return LLM(path, dtype="float32", max_model_len=128, use_tqdm_on_load=False, async_scheduling=overlap, **kwargs)


def _run(llm: LLM, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    engine = llm.llm_engine.engine_core
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.usage == 0.0
    engine.scheduler.check_invariants()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, _logprobs(o.outputs[0])) for o in outs]


def _logprobs(completion):
    if completion.logprobs is None:
        return None
    return [sorted((tok, lp.logprob) for tok, lp in step.items()) for step in completion.logprobs]


def _both(path: str, params, **kwargs):
    sync, overlap = _run(_llm(path, False, **kwargs), params), _run(_llm(path, True, **kwargs), params)
    assert [(tokens, reason) for tokens, reason, _ in sync] == [(tokens, reason) for tokens, reason, _ in overlap]
    # Logprobs agree to float32 noise: the batches differ (a step may carry a request that has just
    # stopped), which changes summation orders, not results.
    for (_, _, a), (_, _, b) in zip(sync, overlap):
        assert (a is None) == (b is None)
        for step_a, step_b in zip(a or [], b or []):
            assert [t for t, _ in step_a] == [t for t, _ in step_b]
            assert all(abs(x - y) < 1e-3 for (_, x), (_, y) in zip(step_a, step_b))
    return sync, overlap


def test_greedy_with_stops_and_lengths(tiny_models, overlap_counter):
    path = tiny_models["qwen2"]
    plain = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(PROMPTS)
    first = _run(_llm(path, False), plain)
    # Stop each request at a token it produces mid-way, and cap others by length at various steps.
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[tokens[4]], logprobs=2)
        if i % 2
        else SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True, logprobs=2)
        for i, (tokens, _, _) in enumerate(first)
    ]
    sync, _ = _both(path, params)
    assert {reason for _, reason, _ in sync} == {"stop", "length"}
    assert overlap_counter["pending_steps"] > 5


def test_seeded_sampling_and_logprobs(tiny_models, overlap_counter):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=100 + i, max_tokens=10, ignore_eos=True, logprobs=1)
        for i in range(len(PROMPTS))
    ]
    _both(tiny_models["llama"], params)
    assert overlap_counter["pending_steps"] > 5


def test_history_dependent_sampling_finishes_the_step_in_flight(tiny_models, overlap_counter):
    """Penalties, bad words and min_tokens read the output tokens on the host: those steps wait for
    the previous one; the plain requests mixed in still get the same tokens."""
    variants = [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.5, presence_penalty=0.3),
        dict(bad_words=[" the", " of"]),
        dict(min_tokens=6, stop_token_ids=[7, 9, 11]),
        dict(),
        dict(),
    ]
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, **extra) for extra in variants]
    _both(tiny_models["mistral"], params)


def test_preemption_under_a_small_cache(tiny_models, overlap_counter):
    """With few blocks, running requests are preempted (some while their last token is pending)
    and recomputed; the tokens are the same."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _both(tiny_models["llama_tied"], params, num_gpu_blocks_override=12, max_num_seqs=6)
    llm = _llm(tiny_models["llama_tied"], True, num_gpu_blocks_override=12, max_num_seqs=6)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_abort_while_a_step_is_in_flight(tiny_models):
    llm = _llm(tiny_models["qwen3"], True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
        steps += 1
        if steps == 4:
            assert engine.engine_core._in_flight is not None
            engine.abort_request(["r1", "r4"])
    assert set(finished) >= {f"r{i}" for i in (0, 2, 3, 5)} and all(finished[f"r{i}"] == 30 for i in (0, 2, 3, 5))
    core = engine.engine_core
    core.scheduler.check_invariants()
    assert not core.scheduler.requests and core.kv_manager.usage == 0.0
