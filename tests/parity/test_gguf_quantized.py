"""The default model run in its GGUF blocks (--quantization gguf, the default for a quantized .gguf
on CPU) against the same file dequantized (--quantization none): greedy tokens may part only where
the dequantized model's two best tokens are within a stated margin (the quantized kernels round the
activations of decode-sized batches to 8 bits, as llama.cpp does), the logprobs before that stay
close, and the perplexity stays within 1%. Decode's products take the layers' Q4_1 blocks repacked
16 rows at a time (kernels.gguf.repack)."""

from __future__ import annotations

import math

import pytest

from splitserve import LLM, SamplingParams
from splitserve.benchmarks.perplexity import BUILTIN_TEXT, compute_perplexity
from splitserve.kernels import gguf as gguf_kernels
from splitserve.kernels import packed_linear

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a"]
MAX_TOKENS = 32
# Where the dequantized model's best two tokens are closer than this (in logprob), 8-bit
# activations may pick the other one.
TIE_MARGIN = 0.5
MEAN_LOGPROB_ATOL, MAX_LOGPROB_ATOL = 0.06, 0.4


@pytest.fixture(scope="module")
def engines():
    common = {"max_model_len": 512, "dtype": "float32", "use_tqdm_on_load": False, "enable_prefix_caching": False}
    return LLM(quantization="gguf", **common), LLM(quantization="none", **common)


@pytest.mark.slow  # loads the default model
def test_the_default_model_runs_in_its_blocks_by_default(engines):
    quantized, dequantized = engines
    assert quantized.llm_engine.config.model_config.quant_config.method == "gguf"
    assert dequantized.llm_engine.config.model_config.quant_config is None
    default = LLM(max_model_len=256, use_tqdm_on_load=False)
    assert default.llm_engine.config.model_config.quant_config.method == "gguf"


def _gguf_runs(llm: LLM) -> list[int]:
    model = llm.llm_engine.engine_core.executor.runner.model
    return [qtype for m in model.modules() for qtype, _, _ in getattr(m, "gguf_runs", [])]


@pytest.mark.slow  # loads the default model
def test_the_layers_q4_1_blocks_are_repacked_for_decode(engines, monkeypatch):
    """The default model's layers are Q4_1 (the LM head Q8_0, tied to the embedding): every layer
    run is interleaved for the 16-row kernels after loading, unless prepacking is turned off."""
    runs = _gguf_runs(engines[0])
    assert runs and all(qtype == 3 + gguf_kernels.REPACKED for qtype in runs)
    monkeypatch.setenv(packed_linear.ENV, "0")
    unpacked = LLM(quantization="gguf", max_model_len=256, use_tqdm_on_load=False)
    assert set(_gguf_runs(unpacked)) == {3}
    out = unpacked.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def _greedy(llm: LLM, logprobs: int):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.slow  # loads the default model
def test_greedy_tokens_part_only_at_near_ties(engines):
    """Measured here: mean |logprob difference| 0.03 and at most 0.21 over 115 steps; 3 of the 5
    prompts parted, at gaps of 0.02, 0.07 and 0.17."""
    quantized, dequantized = engines
    ours, ref = _greedy(quantized, 0), _greedy(dequantized, 2)
    differences = []
    for mine, theirs in zip(ours, ref):
        for step, (a, b) in enumerate(zip(mine.token_ids, theirs.token_ids)):
            if a != b:
                top = sorted((lp.logprob for lp in theirs.logprobs[step].values()), reverse=True)
                assert top[0] - top[1] < TIE_MARGIN, f"parted at step {step} with a gap of {top[0] - top[1]:.3f}"
                break
            differences.append(abs(mine.logprobs[step][a].logprob - theirs.logprobs[step][b].logprob))
    assert len(differences) >= 50, "the prompts parted too early to compare"
    assert sum(differences) / len(differences) < MEAN_LOGPROB_ATOL and max(differences) < MAX_LOGPROB_ATOL


@pytest.mark.slow  # loads the default model
def test_perplexity_stays_within_one_percent(engines):
    quantized, dequantized = engines
    ids = quantized.get_tokenizer()(BUILTIN_TEXT).input_ids
    ours = compute_perplexity(quantized, ids, max_length=256, stride=128).perplexity
    ref = compute_perplexity(dequantized, ids, max_length=256, stride=128).perplexity
    assert math.isfinite(ours) and abs(ours / ref - 1) < 0.01, (ours, ref)


@pytest.mark.parametrize(
    ("requested", "quantized", "device", "expected"),
    [
        (None, True, "cpu", ("gguf", True)),
        (None, False, "cpu", None),
        ("none", True, "cpu", None),
        ("weight_only_int8", True, "cpu", ("weight_only_int8", False)),
        ("fp8", True, "cpu", ("fp8", False)),
        (None, True, "cuda", None),
        ("gguf", True, "cuda", ("gguf", True)),  # 4-bit blocks in the W4A16 kernel, others dense
        ("gguf", False, "cuda", None),
    ],
)
def test_which_quantization_a_gguf_file_runs_with(requested, quantized, device, expected):
    from splitserve.quantization.config import quantization_config_for

    got = quantization_config_for(None, requested, "gguf", gguf_quantized=quantized, device_type=device)
    assert (got and (got.method, got.from_checkpoint)) == expected


@pytest.mark.parametrize("requested", ["awq", "smooth_quant"])
def test_calibrated_methods_are_refused_for_a_gguf_file(requested):
    from splitserve.quantization.config import quantization_config_for

    with pytest.raises(ValueError, match="does not apply to a .gguf file"):
        quantization_config_for(None, requested, "gguf", gguf_quantized=True)
