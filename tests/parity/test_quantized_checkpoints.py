"""Quantized checkpoints in the AutoAWQ, GPTQ (incl. act-order), compressed-tensors W4A16 (llm-compressor's),
fp8 and splitserve int8 layouts, written by the tests (tests/helpers/quant_layouts.py), load and generate
what transformers generates with the same dequantized weights: the engine's unpacking and int4 / int8
kernels are exact up to float rounding. SmoothQuant's run-time activation quantization is reproduced on
the transformers side with a hook that rounds each linear's input per token to int8."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.helpers.hf_reference import assert_greedy_match, hf_greedy, load_hf_model
from tests.helpers.quant_layouts import write_quantized_checkpoint

MAX_TOKENS = 16
# float32 on both sides; the int4 kernel and the int8 paths sum in another order than a dense
# matmul (observed differences ~1e-5 relative on logits of tens).
LOGPROB_ATOL = 1e-3
# SmoothQuant rounds every activation to int8: a 1e-6 difference upstream now and then flips a
# rounding by one level (~1% of a token's largest activation), and these tiny models' logits reach
# tens. Most steps still agree to 1e-3; a flipped step was seen to move a logprob by up to 0.17.
W8A8_LOGPROB_ATOL = 0.25
CASES = [
    ("llama", "awq", False),
    ("qwen2", "awq", False),
    ("llama", "gptq", False),
    ("qwen3", "gptq", True),
    ("llama", "compressed-tensors", False),
    ("qwen3", "compressed-tensors", True),
    ("llama", "weight_only_int8", False),
    ("qwen2", "smooth_quant", False),
    ("llama", "smooth_quant", False),
    ("llama", "fp8", False),
]


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 1024) for _ in range(rng.randrange(4, 40))] for _ in range(4)]


def _fake_quantize_inputs(model) -> None:
    """SmoothQuant at run time: each decoder linear's input rounded to int8 with a scale per token."""

    def hook(_module, args):
        x = args[0]
        scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6) / 127.0
        return (torch.round(x / scale).clamp(-127, 127) * scale,)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.register_forward_pre_hook(hook)


@pytest.mark.parametrize("arch,method,act_order", CASES)
def test_quantized_checkpoint_matches_transformers(tiny_models, tmp_path, arch, method, act_order):
    reference_state = write_quantized_checkpoint(
        tiny_models[arch], str(tmp_path / method), method, group_size=32, act_order=act_order
    )
    hf = load_hf_model(tiny_models[arch])
    hf.load_state_dict(reference_state, strict=False)
    if method == "smooth_quant":
        _fake_quantize_inputs(hf)
    prompts = _prompts()
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]

    llm = LLM(str(tmp_path / method), dtype="float32", max_model_len=256, use_tqdm_on_load=False)
    assert llm.llm_engine.model_config.quant_config.method == method  # detected from the checkpoint
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    atol = W8A8_LOGPROB_ATOL if method == "smooth_quant" else LOGPROB_ATOL
    close = []
    for out, ref in zip(outputs, refs):
        completion = out.outputs[0]
        logprobs = [lp[tok].logprob for lp, tok in zip(completion.logprobs, completion.token_ids)]
        assert_greedy_match(completion.token_ids, logprobs, ref, atol, tie_gap=atol)
        close += [abs(a - b) < LOGPROB_ATOL for a, b in zip(logprobs, ref.logprobs)]
    assert sum(close) >= 0.75 * len(close), f"only {sum(close)} of {len(close)} logprobs within {LOGPROB_ATOL}"


@pytest.mark.parametrize("method", ["gptq", "compressed-tensors"])
def test_act_order_checkpoints_refuse_tensor_parallelism_before_loading(tiny_models, tmp_path, method):
    """Act-order spreads a group's input channels over every rank's share of o_proj's and down_proj's
    inputs: refused with the reason when the engine is configured, before any worker starts."""
    write_quantized_checkpoint(tiny_models["llama"], str(tmp_path / "q"), method, group_size=32, act_order=True)
    with pytest.raises(ValueError, match="quantized with act-order .* cannot be split over 2 tensor-parallel ranks"):
        LLM(str(tmp_path / "q"), dtype="float32", tensor_parallel_size=2, use_tqdm_on_load=False)


def test_quantization_flag_must_match_checkpoint(tiny_models, tmp_path):
    write_quantized_checkpoint(tiny_models["llama"], str(tmp_path / "awq"), "awq")
    with pytest.raises(ValueError, match="checkpoint is quantized with awq"):
        LLM(str(tmp_path / "awq"), quantization="gptq", use_tqdm_on_load=False)


def test_calibrated_methods_refuse_unquantized_checkpoints(tiny_models):
    with pytest.raises(ValueError, match="splitserve quantize --quant-type awq"):
        LLM(tiny_models["llama"], quantization="awq", use_tqdm_on_load=False)
    with pytest.raises(ValueError, match="not supported; choose one of"):
        LLM(tiny_models["llama"], quantization="int3", use_tqdm_on_load=False)


def test_missing_quantized_tensor_is_named(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "gptq"
    write_quantized_checkpoint(tiny_models["llama"], str(path), "gptq")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.qzeros"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks \['qzeros'\] for shard 1"):
        LLM(str(path), use_tqdm_on_load=False)


@pytest.mark.parametrize("method", ["weight_only_int8", "fp8", "awq", "smooth_quant"])
def test_online_and_dummy_quantization_generate(tiny_models, method):
    """weight_only_int8 / fp8 quantize an unquantized checkpoint while loading; with dummy weights
    every method quantizes random weights (for benchmarks)."""
    load_format = "auto" if method in ("weight_only_int8", "fp8") else "dummy"
    llm = LLM(
        tiny_models["llama"],
        quantization=method,
        load_format=load_format,
        dtype="bfloat16",
        max_model_len=128,
        use_tqdm_on_load=False,
    )
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("quant_type", ["weight_only_int8", "smooth_quant", "awq", "gptq"])
def test_quantize_tool_round_trip(tiny_models, tmp_path, quant_type):
    """`splitserve quantize` -> the engine loads the result -> it generates what transformers does
    with the checkpoint's weights dequantized (and SmoothQuant's smoothing applied)."""
    from tests.helpers.quantize import dequantized_model, run_tool

    source = tiny_models["llama"]
    rng = random.Random(2)
    calibration = tmp_path / "ids.txt"
    calibration.write_text("\n".join(" ".join(str(rng.randrange(3, 1024)) for _ in range(64)) for _ in range(4)))
    out = run_tool(
        "-i",
        source,
        "-o",
        str(tmp_path / quant_type),
        "--quant-type",
        quant_type,
        "--group-size",
        "32",
        "-t",
        "fp32",
        "--tokenids-path",
        str(calibration),
    )
    hf = dequantized_model(out, source)
    if quant_type == "smooth_quant":
        _fake_quantize_inputs(hf)
    prompts = _prompts()[:2]
    refs = [hf_greedy(hf, p, 8) for p in prompts]
    llm = LLM(out, dtype="float32", max_model_len=128, use_tqdm_on_load=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    atol = W8A8_LOGPROB_ATOL if quant_type == "smooth_quant" else LOGPROB_ATOL
    for out_, ref in zip(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False), refs):
        completion = out_.outputs[0]
        logprobs = [lp[tok].logprob for lp, tok in zip(completion.logprobs, completion.token_ids)]
        assert_greedy_match(completion.token_ids, logprobs, ref, atol, tie_gap=atol)


def test_lmdeploy_model_format(tiny_models, tmp_path):
    from splitserve import GenerationConfig, TurbomindEngineConfig, pipeline

    path = str(tmp_path / "awq")
    write_quantized_checkpoint(tiny_models["llama"], path, "awq")
    with pipeline(
        path, backend_config=TurbomindEngineConfig(model_format="awq", session_len=128, cache_max_entry_count=0.01)
    ) as pipe:
        response = pipe("a b c", gen_config=GenerationConfig(max_new_tokens=4, ignore_eos=True), do_preprocess=False)
        assert response.generate_token_len == 4
    with pytest.raises(ValueError, match="checkpoint is quantized with awq"):
        pipeline(path, backend_config=TurbomindEngineConfig(model_format="gptq"))
