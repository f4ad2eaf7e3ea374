"""Linears with their weights prepacked for oneDNN (kernels/packed_linear.py): in bfloat16 they give
exactly F.linear's results, at every row count and with a bias; in float32 (F.linear goes through
MKL there) the same up to the order of the sums. An engine packs its dense bfloat16 and float32
linears and LM head on CPU, and SPLITSERVE_CPU_PACKED_WEIGHTS=0 packs nothing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from splitserve import LLM
from splitserve.kernels import cpu_features, packed_linear
from splitserve.layers.basic import Linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
# oneDNN reorders bfloat16 weights only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: not on an AVX2 host
BF16_PACKS = torch.backends.mkldnn.is_available() and packed_linear.can_pack(torch.zeros(16, 16, dtype=torch.bfloat16))
needs_bf16_packing = pytest.mark.skipif(not BF16_PACKS, reason="oneDNN cannot reorder bfloat16 weights on this CPU")


@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear_bit_for_bit(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(320, 192, generator=g).bfloat16()
    bias = torch.randn(320, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, 192, generator=g).bfloat16()
    packed = packed_linear.pack(weight)
    assert torch.equal(packed_linear.linear(x, packed, bias), F.linear(x, weight, bias))
    # leading dimensions are kept
    assert torch.equal(packed_linear.linear(x.view(1, rows, 192), packed, bias), F.linear(x, weight, bias)[None])


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_equals_f_linear_up_to_the_order_of_the_sums(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(320, 192, generator=g)
    bias = torch.randn(320, generator=g) if with_bias else None
    x = torch.randn(rows, 192, generator=g)
    packed = packed_linear.pack(weight)
    y = packed_linear.linear(x, packed, bias)
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-4)


def test_bfloat16_and_float32_cpu_matrices_are_packed():
    # bfloat16 where the CPU has what oneDNN's reorder needs (the AVX2 build of the kernels does not change that)
    flags = cpu_features.cpu_flags()
    assert BF16_PACKS == ({"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags) or bool(
        os.environ.get("ONEDNN_MAX_CPU_ISA")
    )
    assert packed_linear.can_pack(torch.zeros(4, 8, dtype=torch.bfloat16)) == BF16_PACKS
    assert packed_linear.can_pack(torch.zeros(4, 8))
    assert not packed_linear.can_pack(torch.zeros(4, 8, dtype=torch.float16))
    assert not packed_linear.can_pack(torch.zeros(8, dtype=torch.bfloat16))


def _model(llm: LLM):
    return llm.llm_engine.engine_core.executor.runner.model


@pytest.mark.parametrize(
    ("dtype", "env", "packed"),
    [("bfloat16", "1", True), ("bfloat16", "0", False), ("float32", "1", True), ("float32", "0", False)],
)
def test_an_engine_packs_its_dense_linears(tiny_models, monkeypatch, dtype, env, packed):
    packed = packed and (dtype == "float32" or BF16_PACKS)  # bfloat16 stays dense where oneDNN cannot reorder it
    monkeypatch.setenv(packed_linear.ENV, env)
    llm = LLM(tiny_models["llama"], dtype=dtype, max_model_len=64, use_tqdm_on_load=False)
    model = _model(llm)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all((m.packed_weight is not None) == packed for m in linears)
    assert all((m.weight is None) == packed for m in linears)  # the packed copy replaces the dense one
    assert (model.compute_logits_embedding().packed_weight is not None) == packed
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0
