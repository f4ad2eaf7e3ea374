"""Greedy outputs and logprobs equal transformers' on tiny random-weight models of every
supported architecture, in float32, however the engine batches, chunks, caches or preempts."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from tests.helpers.hf_reference import assert_greedy_match, hf_greedy, load_hf_model
from tests.helpers.models import TINY_ARCHS
from tests.helpers.parity import LOGPROB_ATOL, PROMPTS

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def references(tiny_models):
    refs = {}
    for arch, path in tiny_models.items():
        model = load_hf_model(path)
        refs[arch] = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return refs


def _generate(llm: LLM, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _check(outputs, refs) -> None:
    for out, ref in zip(outputs, refs):
        completion = out.outputs[0]
        logprobs = [lp[tok].logprob for lp, tok in zip(completion.logprobs, completion.token_ids)]
        assert_greedy_match(completion.token_ids, logprobs, ref, LOGPROB_ATOL)


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    return LLM(path, dtype="float32", use_tqdm_on_load=False, **kwargs)


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_greedy_parity_whole_batch(tiny_models, references, arch):
    llm = _llm(tiny_models[arch])
    _check(_generate(llm), references[arch])
    # The same prompts again are served from the prefix cache and must not change a token.
    again = _generate(llm)
    assert sum(o.num_cached_tokens for o in again) > 0
    _check(again, references[arch])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_greedy_parity_batch_sizes(tiny_models, references, arch, max_num_seqs):
    llm = _llm(tiny_models[arch], max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    _check(_generate(llm), references[arch])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_parity_small_chunks(tiny_models, references, arch):
    # A 7-token step budget splits every prompt into several chunks that share steps with decodes.
    llm = _llm(tiny_models[arch], max_num_batched_tokens=7, enable_prefix_caching=False)
    _check(_generate(llm), references[arch])


@pytest.mark.parametrize("arch", ["llama_tied", "qwen3"])
def test_greedy_parity_under_preemption(tiny_models, references, arch):
    # 20 blocks of 4 tokens cannot hold 8 sequences of up to 72 tokens: requests get preempted
    # and recomputed (with prefix-cache hits on their own freed blocks).
    llm = _llm(tiny_models[arch], block_size=4, num_gpu_blocks_override=20, max_model_len=80)
    _check(_generate(llm), references[arch])
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_greedy_parity_under_swap_preemption(tiny_models, references, kv_cache_dtype):
    """preemption_mode="swap" (LMDeploy's eviction_type="copy"): preempted requests' KV (and its
    scales, when quantized) goes to host blocks and back, and the tokens are transformers'."""
    llm = _llm(
        tiny_models["qwen3"],
        block_size=4,
        num_gpu_blocks_override=20,
        max_model_len=80,
        preemption_mode="swap",
        num_cpu_blocks=64,
        kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=False,  # every resumed token then comes from the swapped blocks
    )
    outputs = _generate(llm)
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0 and core.kv_manager.cpu_pool.num_free_blocks == 64
    if kv_cache_dtype == "auto":
        _check(outputs, references["qwen3"])
    else:
        # A quantized cache moves the logits a little, so compare with the same cache never preempted:
        # swapped blocks come back bit for bit (recomputing them would quantize other values).
        roomy = _llm(tiny_models["qwen3"], block_size=4, max_model_len=80, kv_cache_dtype=kv_cache_dtype)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in _generate(roomy)]
