"""Quantized mixture-of-experts models against transformers on the same (dequantized) weights:
GGUF files written from tiny Qwen3-MoE and Qwen2-MoE checkpoints (experts stacked as llama.cpp
stores them) served in their blocks and dequantized, under expert parallelism too; and unquantized
checkpoints quantized while loading (weight_only_int8, fp8), every expert per row. Plus what is
refused, with the reason."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from splitserve import SamplingParams
from splitserve.loader.hf_model import gguf_name_maps_built_once
from splitserve.loader.resolve import default_model_path
from tests.helpers.gguf_files import tensor_types, write_gguf
from tests.helpers.hf_reference import assert_greedy_match, hf_greedy
from tests.helpers.parity import build, generate_and_check, llm

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


def test_quantized_moe_checkpoints_are_refused_with_the_reason(tmp_path, checkpoint):
    path = checkpoint("qwen3_moe")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True}
    awq = tmp_path / "awq"
    shutil.copytree(path, awq)
    with open(awq / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="awq checkpoints of mixture-of-experts models are not supported"):
        llm(str(awq))


def _first_moe(engine):
    from splitserve.layers.moe import FusedMoE

    model = engine.llm_engine.engine_core.executor.runner.model
    return next(m for m in model.modules() if isinstance(m, FusedMoE))
