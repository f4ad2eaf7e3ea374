"""Batch-invariant numerics (--batch-invariant): the same greedy request gives the same tokens and the
same logprobs alone, in a batch of 16 other requests, after a prefix-cache hit, with its prompt
chunked into 64-token steps, and verified by speculative decoding; on the default model (its GGUF
blocks) in bfloat16 and float32, and on a dense bfloat16 model (packed oneDNN products). PD against
a mixed instance is in tests/e2e/test_determinism.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitserve import LLM, SamplingParams
from splitserve.kernels import batch_invariant, cpu_features

PROMPT = {"prompt_token_ids": [1] + list(range(400, 499))}  # 100 tokens: 6 full blocks and a partial one
OTHERS = [{"prompt_token_ids": list(range(100 + 13 * i, 120 + 17 * i))} for i in range(16)]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def _answer(llm: LLM, prompts) -> tuple[list[int], list[list[tuple[int, float]]]]:
    out = llm.generate(prompts, PARAMS, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [sorted((t, lp.logprob) for t, lp in entry.items()) for entry in out.logprobs]


def _check_invariance(model: str | None, dtype: str, **engine) -> None:
    kwargs = dict(dtype=dtype, max_model_len=512, use_tqdm_on_load=False, batch_invariant=True, **engine)
    llm = LLM(model, **kwargs) if model else LLM(**kwargs)
    alone = _answer(llm, [PROMPT])
    assert _answer(llm, [PROMPT] + OTHERS) == alone, "in a batch of 16 others"
    assert _answer(llm, [PROMPT]) == alone, "after a prefix-cache hit"
    assert llm.llm_engine.engine_core.scheduler.prefix_cache_stats.hits > 0
    del llm
    chunked = LLM(model, **kwargs, max_num_batched_tokens=64) if model else LLM(**kwargs, max_num_batched_tokens=64)
    assert _answer(chunked, [PROMPT] + OTHERS[:3]) == alone, "chunked into 64-token steps"
    del chunked
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    spec = LLM(model, **kwargs, speculative_config=ngram) if model else LLM(**kwargs, speculative_config=ngram)
    assert _answer(spec, [PROMPT] + OTHERS[:3])[0] == alone[0], "verified by speculative decoding"
    assert spec.llm_engine.engine_core.speculator.stats.num_drafts > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_default_model_answers_alike_however_it_is_batched(dtype):
    if dtype == "bfloat16" and not cpu_features.native_bf16():
        pytest.skip("bfloat16 is emulated on this CPU (the engine's auto dtype is float32 here)")
    _check_invariance(None, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_dense_model_answers_alike_however_it_is_batched(tiny_models, dtype):
    _check_invariance(tiny_models["llama"], dtype)


def test_the_probe_pads_products_so_that_rows_do_not_depend_on_their_count(tiny_models):
    llm = LLM(tiny_models["qwen2"], dtype="bfloat16", max_model_len=128, use_tqdm_on_load=False, batch_invariant=True)
    assert batch_invariant.enabled() and batch_invariant.row_multiple() in (1, 2, 4, 8, 16, 32, 64)
    assert batch_invariant.padded_row_count(3) % batch_invariant.row_multiple() == 0
    llm.llm_engine.shutdown()  # the mode is the process's: the next engine here must not inherit it
    assert not batch_invariant.enabled()


def test_the_mode_is_refused_where_it_is_not_implemented():
    import torch

    with pytest.raises(ValueError, match="implemented for CPUs"):
        batch_invariant.enable(torch.nn.Linear(4, 4), torch.device("cuda"))


def _onednn_isas() -> list[str]:
    flags = cpu_features.cpu_flags()
    isas = ["AVX2"]
    if "avx512_bf16" in flags:
        isas.append("AVX512_CORE_BF16")
    if "amx_bf16" in flags:
        isas.append("AVX512_CORE_AMX")
    return isas


@pytest.mark.slow
@pytest.mark.parametrize("isa", _onednn_isas())
def test_every_onednn_isa_of_this_host_keeps_rows_invariant(tiny_models, isa):
    """oneDNN picks its kernels by the ISA it may use: with each one this CPU has, the probe finds a
    padding that keeps a dense bfloat16 model's rows invariant."""
    code = (
        "from tests.parity.test_determinism import _check_invariance; import sys; "
        f"_check_invariance({tiny_models['llama']!r}, 'bfloat16')"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
