"""Quantized mixture-of-experts models against transformers on the same (dequantized) weights:
GGUF files written from tiny Qwen3-MoE and Qwen2-MoE checkpoints (experts stacked as llama.cpp
stores them) served in their blocks and dequantized, under expert parallelism too; and unquantized
checkpoints quantized while loading (weight_only_int8, fp8), every expert per row; AWQ, GPTQ and
compressed-tensors W4A16 checkpoints, every expert in 4 bits. Plus what is refused, with the reason."""

from __future__ import annotations

import os
import random

import pytest
import torch

from splitserve import SamplingParams
from splitserve.loader.hf_model import gguf_name_maps_built_once
from splitserve.loader.resolve import default_model_path
from tests.helpers.gguf_files import tensor_types, write_gguf
from tests.helpers.hf_reference import assert_greedy_match, hf_greedy, load_hf_model
from tests.helpers.parity import build, generate_and_check, llm
from tests.helpers.quant_layouts import write_quantized_checkpoint

MAX_TOKENS = 12
PROMPTS = [[5, 7, 9, 11, 13], [100, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 11000], [42] * 3]
MOE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    initializer_range=0.5, bos_token_id=1, eos_token_id=2, max_position_embeddings=512, tie_word_embeddings=False,
)  # fmt: skip


def _config(kind: str, vocab_size: int):
    import transformers

    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **MOE, vocab_size=vocab_size, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=64, norm_topk_prob=True,
        )  # fmt: skip
    return transformers.Qwen2MoeConfig(
        **MOE, vocab_size=vocab_size, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, norm_topk_prob=False,
    )  # fmt: skip


def _make_checkpoint(directory: str, kind: str, tokenizer) -> str:
    build(_config(kind, len(tokenizer)), seed=3).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def checkpoint(tmp_path, smollm_tokenizer):
    """A tiny MoE checkpoint of `kind` with the default model's tokenizer and its whole vocabulary
    (a GGUF carries that tokenizer)."""
    return lambda kind: _make_checkpoint(str(tmp_path / kind), kind, smollm_tokenizer)


def _gguf_and_refs(directory, kind: str, qtype: str, tokenizer) -> tuple[str, list]:
    """The tiny `kind` checkpoint as a `qtype` .gguf, and transformers' greedy references on it."""
    checkpoint = _make_checkpoint(str(directory / kind), kind, tokenizer)
    path = write_gguf(checkpoint, str(directory / "moe.gguf"), qtype, default_model_path())
    reference = _gguf_reference(path)  # read once: parsing the file's metadata (a whole vocabulary) takes seconds
    return path, [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def qwen3_q8_0(tmp_path_factory, smollm_tokenizer) -> tuple[str, list]:
    """The Qwen3-MoE Q8_0 file and its references, shared by the two tests that read it: writing it
    and reading its metadata back (a whole vocabulary) take about 15 s."""
    return _gguf_and_refs(tmp_path_factory.mktemp("qwen3_q8_0"), "qwen3_moe", "Q8_0", smollm_tokenizer)


def _gguf_reference(path: str):
    """transformers' model of a .gguf (its own reader dequantizes and unstacks the experts), with
    the experts' sizes of the file (splitserve's config reader)."""
    import transformers

    from splitserve.loader.gguf_cache import read_gguf_config

    directory, name = os.path.split(path)
    config = read_gguf_config(directory, name)
    with gguf_name_maps_built_once():
        return transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, config=config, dtype=torch.float32
        ).eval()


def _check(engine, refs) -> None:
    generate_and_check(engine, refs, prompts=PROMPTS, max_tokens=MAX_TOKENS)


# In its blocks, a GGUF model's decode-sized products round the activations to 8 bits (as llama.cpp
# does; tests/parity/test_gguf_quantized.py): these tiny random models' logits reach tens, so the
# logprobs move by tenths and tokens whose two best candidates are that close may differ.
BLOCKS_LOGPROB_ATOL, BLOCKS_TIE_GAP = 0.5, 0.5


def _check_in_blocks(engine, refs) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out, ref in zip(outputs, refs):
        completion = out.outputs[0]
        logprobs = [lp[tok].logprob for lp, tok in zip(completion.logprobs, completion.token_ids)]
        assert_greedy_match(completion.token_ids, logprobs, ref, BLOCKS_LOGPROB_ATOL, BLOCKS_TIE_GAP)


@pytest.mark.slow
@pytest.mark.parametrize("kind,qtype", [("qwen3_moe", "Q8_0"), ("qwen2_moe", "Q4_0")], ids=["qwen3-q8_0", "qwen2-q4_0"])
def test_gguf_moe_in_its_blocks_and_dequantized(request, tmp_path, smollm_tokenizer, kind, qtype):
    """Dequantized (--quantization none), the file generates what transformers generates from it.
    In its blocks, every expert's products read its own blocks: the layer's output is the
    dequantized layer's up to the 8-bit rounding of the activations; with Q8_0 (the closest
    rounding) whole generations agree too."""
    if (kind, qtype) == ("qwen3_moe", "Q8_0"):
        path, refs = request.getfixturevalue("qwen3_q8_0")
    else:
        path, refs = _gguf_and_refs(tmp_path, kind, qtype, smollm_tokenizer)
    types = tensor_types(path)
    assert types["blk.0.ffn_gate_exps.weight"] == qtype and types["blk.0.ffn_gate_inp.weight"] == "F32"
    dequantized = llm(path, quantization="none")
    _check(dequantized, refs)
    quantized = llm(path)  # --quantization gguf, the default for a quantized .gguf on CPU
    blocks, dense = _first_moe(quantized), _first_moe(dequantized)
    assert blocks.quantized is not None and blocks.w13.numel() == 0  # no dense copy of the experts
    x = torch.randn(64, blocks.hidden_size, generator=torch.Generator().manual_seed(0))
    for rows in (1, 3, 16, 64):  # decode-sized batches (8-bit activations) to prompt-sized ones (tiles)
        ours, theirs = blocks(x[:rows]), dense(x[:rows])
        assert (ours - theirs).norm() / theirs.norm() < 0.03, rows
    if qtype == "Q8_0":
        _check_in_blocks(quantized, refs)
    # the whole layer in one C++ call (moe_experts_gguf) against the per-expert Linears it replaces
    assert blocks._gguf_blocks(x) is not None
    one_call = [blocks(x[:rows]) for rows in (1, 3, 16, 64)]
    blocks._blocks = False
    assert all(torch.equal(a, blocks(x[: a.shape[0]])) for a in one_call)


@pytest.mark.slow
def test_gguf_moe_with_expert_parallelism(qwen3_q8_0):
    path, refs = qwen3_q8_0
    _check_in_blocks(llm(path, tensor_parallel_size=2, enable_expert_parallel=True), refs)


@pytest.mark.slow
def test_gguf_experts_split_inside_a_block_are_refused(qwen3_q8_0):
    """tp=4 without expert parallelism splits each expert's 64 channels into 16 per rank: the down
    projection's input then cuts a Q8_0 block (32 values, as Q4_0's) in two."""
    path, _ = qwen3_q8_0
    with pytest.raises(Exception, match="can only be split between its 32-value blocks"):
        llm(path, tensor_parallel_size=4)


def _round_trip(weight: torch.Tensor, method: str) -> torch.Tensor:
    """What a per-row weight_only_int8 / fp8 weight multiplies by, as float32."""
    w = weight.float()
    if method == "weight_only_int8":
        scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
        return torch.round(w / scale).clamp(-127, 127) * scale
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


@pytest.mark.parametrize("method", ["weight_only_int8", "fp8"])
def test_experts_quantized_while_loading(checkpoint, smollm_tokenizer, method):
    """Every decoder matrix (attention, experts, the shared expert and its gate) quantized per row;
    the routers, norms, embeddings and head stay as they are."""
    path = checkpoint("qwen2_moe")
    reference = build(_config("qwen2_moe", len(smollm_tokenizer)), seed=3)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if ".layers." in name and param.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                param.copy_(_round_trip(param, method))
    refs = [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
    engine = llm(path, quantization=method)
    assert _first_moe(engine).quantized is not None
    _check(engine, refs)


def _four_bit_checkpoint(checkpoint, tmp_path, kind: str, method: str, act_order: bool = False):
    """The tiny `kind` checkpoint with every decoder linear (each expert's, the shared expert's) in
    `method`'s 4-bit layout, and transformers' model carrying the same weights dequantized."""
    from safetensors.torch import save_file

    path = checkpoint(kind)
    reference_state = write_quantized_checkpoint(
        path, str(tmp_path / method), method, group_size=32, act_order=act_order
    )
    # transformers 5 stacks the experts on load: the dequantized weights go in through a checkpoint of their own
    save_file(reference_state, os.path.join(path, "model.safetensors"))
    return str(tmp_path / method), load_hf_model(path)


FOUR_BIT = [("qwen2_moe", "awq", False), ("qwen3_moe", "gptq", True), ("qwen3_moe", "compressed-tensors", False)]


@pytest.mark.parametrize("kind,method,act_order", FOUR_BIT, ids=["qwen2-awq", "qwen3-gptq-act-order", "qwen3-ct"])
def test_four_bit_moe_checkpoints_match_transformers(checkpoint, tmp_path, kind, method, act_order):
    """AutoAWQ's, AutoGPTQ's and llm-compressor's per-expert layouts load into the experts' int4 Linears
    and generate what transformers generates with the dequantized weights; the routers and the one-row
    shared-expert gate stay unquantized, as these tools leave them."""
    path, reference = _four_bit_checkpoint(checkpoint, tmp_path, kind, method, act_order)
    engine = llm(path)
    moe = _first_moe(engine)
    assert moe.whole_tensors and type(moe.quantized[0][0].quant_method).__name__ == "Int4Method"
    _check(engine, [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS])


@pytest.mark.slow
def test_four_bit_moe_checkpoint_split_over_tensor_parallel_ranks(checkpoint, tmp_path):
    """Each rank unpacks every expert's matrices and keeps its share of the intermediate channels (the
    down projection's groups of input columns), or whole experts with expert parallelism."""
    path, reference = _four_bit_checkpoint(checkpoint, tmp_path, "qwen3_moe", "awq")
    refs = [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
    for flags in ({}, {"enable_expert_parallel": True}):
        engine = llm(path, tensor_parallel_size=2, **flags)
        _check(engine, refs)
        engine.llm_engine.shutdown()


@pytest.mark.parametrize("kind,quant_type", [("qwen2_moe", "awq"), ("qwen3_moe", "gptq")])
def test_quantize_tool_makes_moe_checkpoints(checkpoint, tmp_path, kind, quant_type):
    """`splitserve quantize` of a mixture-of-experts model: every expert (and the shared expert) in 4
    bits, each calibrated on the tokens routed to it, the routers and the shared-expert gate as they
    were; the engine serves it as transformers does with those weights dequantized."""
    from safetensors.torch import load_file

    from tests.helpers.quantize import dequantized_model, run_tool

    source = checkpoint(kind)
    rng = random.Random(2)
    calibration = tmp_path / "ids.txt"
    calibration.write_text("\n".join(" ".join(str(rng.randrange(3, 1024)) for _ in range(64)) for _ in range(4)))
    argv = ["-i", source, "-o", str(tmp_path / quant_type), "--quant-type", quant_type, "--group-size", "32"]
    out = run_tool(*argv, "-t", "fp32", "--tokenids-path", str(calibration))
    tensors = load_file(os.path.join(out, "model.safetensors"))
    experts = {n.rsplit(".", 1)[0] for n in tensors if ".experts." in n}
    assert len(experts) == 3 * 3 * (4 if kind == "qwen2_moe" else 8)  # layers x projections x experts
    assert all(f"{e}.qweight" in tensors and f"{e}.weight" not in tensors for e in experts)
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    if kind == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert.down_proj.qweight" in tensors
        assert "model.layers.0.mlp.shared_expert_gate.weight" in tensors
    reference = dequantized_model(out, source)
    _check(llm(out), [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS])


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_unfused_experts_compute_what_the_fused_ones_do(checkpoint, kind):
    """The quantizer's per-expert Linears (quantization/moe_experts.py) in place of transformers' 3D
    experts leave the model's function as it was, so calibration sees the model's own activations."""
    from splitserve.quantization.moe_experts import unfuse_experts

    model = load_hf_model(checkpoint(kind))
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        before = model(ids).logits
        assert unfuse_experts(model) == 3
        after = model(ids).logits
    assert model.model.layers[0].mlp.experts[1].down_proj.weight.shape == (64, 64)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-4)


def test_quantize_tool_refuses_eight_bit_moe_checkpoints(checkpoint, tmp_path):
    from tests.helpers.quantize import run_tool

    with pytest.raises(ValueError, match="no expert layout; use awq or gptq"):
        run_tool("-i", checkpoint("qwen3_moe"), "-o", str(tmp_path / "int8"), "--quant-type", "weight_only_int8")


def test_other_quantized_moe_checkpoints_are_refused_with_the_reason(tmp_path, checkpoint):
    path = checkpoint("qwen3_moe")
    fp8 = tmp_path / "fp8"
    write_quantized_checkpoint(path, str(fp8), "fp8")
    with pytest.raises(ValueError, match="fp8 checkpoints of mixture-of-experts models are not supported yet"):
        llm(str(fp8))


def _first_moe(engine):
    from splitserve.layers.moe import FusedMoE

    model = engine.llm_engine.engine_core.executor.runner.model
    return next(m for m in model.modules() if isinstance(m, FusedMoE))
