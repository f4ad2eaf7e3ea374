"""A quantized KV cache end to end, on the tiny models: ~400-token prompts prefilled in 64-token
chunks (every chunk after the first attends to quantized context), greedy decoding (reads
quantized blocks), and prompts that hit the prefix cache (their prefill reads blocks that other
requests quantized). Per kv_cache_dtype, two checks:

- exactness: the engine equals an unquantized-cache engine whose writes store exactly the values
  the quantized cache represents, within the float32 parity tolerance: nothing is lost or misread
  between writing and reading (scales, int4 packing, slots, prefix hits, decode's folded scales);
- accuracy: prompt logprobs stay close to those of the unquantized (auto) engine. These random
  models (initializer_range 0.5) turn any perturbation into large logprob changes, so the
  yardstick is the drift that computing in bfloat16 instead of float32 causes on the same model.
"""

from __future__ import annotations

import functools
import logging
import random
import statistics
from dataclasses import dataclass

import pytest
import torch

from splitserve import LLM, GenerationConfig, PytorchEngineConfig, SamplingParams, TurbomindEngineConfig, pipeline
from splitserve.executor.attention import torch_ref
from splitserve.quantization.kv_cache import dequantize_kv, kv_cache_spec, quantize_kv

ARCHS = ["llama", "mistral", "qwen3"]  # llama3 RoPE; sliding window 24; head_dim 32 with q/k norms
KV_DTYPES = ["int8", "fp8_e4m3", "fp8_e5m2", "int4"]
MAX_TOKENS = 8
LOGPROB_ATOL = 5e-4  # as test_hf_parity: float32, different but equivalent summation orders
# Mean |prompt logprob - auto's| may be at most this many times bfloat16's drift. Observed on the
# three models: int8 0.57-0.71 (it perturbs K/V less than bfloat16 rounding does), fp8_e4m3
# 2.5-3.0, fp8_e5m2 4.5-5.1, int4 5.9-8.3: the 3-bit and 2-bit mantissas and 16 levels cost more.
DRIFT_FACTOR = {"int8": 1.0, "fp8_e4m3": 4.0, "fp8_e5m2": 7.0, "int4": 11.0}


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randrange(380, 420))] for _ in range(3)]
    # Sharing 320 and 300 tokens with the first prompt: prefix-cache hits once it has run.
    hits = [prompts[0][:320] + [rng.randrange(3, 1024) for _ in range(40)], prompts[0][:300] + [7, 8, 9]]
    return prompts, hits


PROMPTS, HITS = _prompts()


@dataclass
class Greedy:
    token_ids: list[int]
    logprobs: list[float]
    gaps: list[float]  # between the best and second-best logprob at each step


@dataclass
class Run:
    prompt_logprobs: list[float]  # of every prompt token but the first, prompts in order
    outputs: list[Greedy]  # PROMPTS, then HITS


def _greedy(completion) -> Greedy:
    out = Greedy(completion.token_ids, [], [])
    for token, entries in zip(completion.token_ids, completion.logprobs):
        out.logprobs.append(entries[token].logprob)
        best, second = sorted((e.logprob for e in entries.values()), reverse=True)[:2]
        out.gaps.append(best - second)
    return out


def _run(path: str, kv_cache_dtype: str, dtype: str = "float32") -> Run:
    llm = LLM(
        path,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=512,
        max_num_batched_tokens=64,
        use_tqdm_on_load=False,
    )
    greedy = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 2}
    scored = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**greedy, prompt_logprobs=0), use_tqdm=False
    )
    # One at a time, after PROMPTS: prompt_logprobs requests read no cached blocks, these do.
    hits = [llm.generate([{"prompt_token_ids": p}], SamplingParams(**greedy), use_tqdm=False)[0] for p in HITS]
    assert [h.num_cached_tokens for h in hits] == [320, 288]  # whole blocks of 16
    prompt_logprobs = [
        out.prompt_logprobs[i][prompt[i]].logprob for prompt, out in zip(PROMPTS, scored) for i in range(1, len(prompt))
    ]
    return Run(prompt_logprobs, [_greedy(out.outputs[0]) for out in scored + hits])


@functools.cache
def _cached_run(path: str, kv_cache_dtype: str, dtype: str = "float32") -> Run:
    return _run(path, kv_cache_dtype, dtype)


def _assert_greedy_match(ours: Greedy, theirs: Greedy, tie_gap: float = 1e-3) -> None:
    """Identical tokens and logprobs (within LOGPROB_ATOL) up to a near tie in `theirs`."""
    for step, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)):
        if a != b:
            assert theirs.gaps[step] < tie_gap, f"diverged at step {step}: {ours.token_ids} vs {theirs.token_ids}"
            return
        assert abs(ours.logprobs[step] - theirs.logprobs[step]) < LOGPROB_ATOL


@pytest.fixture
def fake_quantized_cache(monkeypatch):
    """Make an auto (unquantized) cache store what kv_cache_dtype would represent: each written
    vector quantized and dequantized. Prompts with no cached context still use their exact k/v.
    (On the torch backend, whose write this patches; the CPU backend writes in C++.)"""

    def use(kv_cache_dtype: str) -> None:
        monkeypatch.setenv("SPLITSERVE_ATTENTION_BACKEND", "torch")
        storage, write_kv = kv_cache_spec(kv_cache_dtype, torch.float32).storage_dtype, torch_ref.write_kv

        def roundtrip(x):
            return dequantize_kv(*quantize_kv(x, storage), x.dtype)

        def write_roundtrip(k_cache, v_cache, k, v, slot_mapping):
            write_kv(k_cache, v_cache, roundtrip(k), roundtrip(v), slot_mapping)

        monkeypatch.setattr(torch_ref, "write_kv", write_roundtrip)

    return use


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_reads_exactly_what_it_stored(tiny_models, fake_quantized_cache, arch, kv_cache_dtype):
    quantized = _cached_run(tiny_models[arch], kv_cache_dtype)
    fake_quantized_cache(kv_cache_dtype)
    reference = _run(tiny_models[arch], "auto")
    diffs = [abs(a - b) for a, b in zip(quantized.prompt_logprobs, reference.prompt_logprobs)]
    assert max(diffs) < LOGPROB_ATOL
    for ours, theirs in zip(quantized.outputs, reference.outputs):
        _assert_greedy_match(ours, theirs)


@pytest.mark.parametrize("arch", ARCHS)
def test_accuracy_against_the_unquantized_cache(tiny_models, arch):
    path = tiny_models[arch]
    auto = _cached_run(path, "auto")

    def drift(run: Run) -> float:
        return statistics.mean(abs(a - b) for a, b in zip(run.prompt_logprobs, auto.prompt_logprobs))

    yardstick = drift(_cached_run(path, "auto", "bfloat16"))
    drifts = {name: drift(_cached_run(path, name)) for name in KV_DTYPES}
    for name, value in drifts.items():
        assert value <= DRIFT_FACTOR[name] * yardstick, (name, value, yardstick)
    # More bits, less drift: int8 < fp8_e4m3 < fp8_e5m2 < int4.
    assert list(drifts.values()) == sorted(drifts.values()), drifts


@pytest.mark.parametrize(
    "kv_cache_dtype, vector_bytes, described",
    [
        ("auto", 64, "float32"),
        ("int8", 20, "int8 + float32 scales"),
        ("fp8", 20, "fp8_e4m3 + float32 scales"),
        ("int4", 16, "int4 + float32 scales and mins"),
    ],
)
def test_the_same_memory_holds_more_blocks(tiny_models, caplog, kv_cache_dtype, vector_bytes, described):
    """head_dim 16 in float32 is 64 bytes a cached vector; int8 and fp8 16 plus a 4-byte scale;
    int4 8 plus scale and min. A block: K and V, 3 layers, 16 tokens, 2 KV heads."""
    with caplog.at_level(logging.INFO, logger="splitserve.executor.runner_kv_cache"):
        llm = LLM(
            tiny_models["llama"],
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory_bytes=1 << 20,
            max_model_len=512,
            use_tqdm_on_load=False,
        )
    block_bytes = 2 * 3 * 16 * 2 * vector_bytes
    assert llm.llm_engine.engine_core.executor.runner.kv_bytes_per_block() == block_bytes
    assert llm.llm_engine.config.cache_config.num_gpu_blocks == (1 << 20) // block_bytes
    assert f"GiB, {described})" in caplog.text


def test_unknown_kv_cache_dtype_is_refused(tiny_models):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'int4'.*got 'fp16'"):
        LLM(tiny_models["llama"], kv_cache_dtype="fp16")


# --- LMDeploy's quant_policy ---------------------------------------------------------------------
@pytest.mark.parametrize("config_class", [PytorchEngineConfig, TurbomindEngineConfig])
def test_quant_policy_maps_to_kv_cache_dtype(config_class):
    # As the pipeline document defines it: 4 means an 8-bit KV cache (8, newer LMDeploy's spelling, too).
    for policy, kv_cache_dtype in [(0, "auto"), (4, "int8"), (8, "int8")]:
        assert config_class(quant_policy=policy).to_engine_args("m").kv_cache_dtype == kv_cache_dtype
    with pytest.raises(ValueError, match=rf"{config_class.__name__}\.quant_policy must be 0 .* got 2"):
        config_class(quant_policy=2).to_engine_args("m")


def test_pipeline_with_quant_policy_runs_a_quantized_cache(tiny_chat_model):
    backend = PytorchEngineConfig(dtype="float32", session_len=256, num_gpu_blocks=64, quant_policy=8)
    llm = LLM(
        tiny_chat_model,
        dtype="float32",
        max_model_len=256,
        block_size=64,
        num_gpu_blocks_override=64,
        enable_prefix_caching=False,
        kv_cache_dtype="int8",
        use_tqdm_on_load=False,
    )
    expected = llm.generate(
        ["Shanghai is"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    with pipeline(tiny_chat_model, backend_config=backend) as pipe:
        assert pipe.engine.engine_core.executor.runner.kv_spec.name == "int8"
        response = pipe(
            "Shanghai is", gen_config=GenerationConfig(max_new_tokens=12, ignore_eos=True), do_preprocess=False
        )
    assert response.token_ids == expected.token_ids
