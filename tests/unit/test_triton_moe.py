"""The Triton fused-MoE kernels (splitserve/kernels/triton_moe.py) and how a MoE layer picks its GPU
backend (splitserve/layers/moe_backends.py). Without CUDA the kernels run in Triton's CPU
interpreter, with 16-row/column blocks and small shapes (odd sizes, experts no token chose); the
interpreter widens 16-bit tiles to float32 before its dot products (it multiplies bfloat16
wrongly), so on the CPU bfloat16 checks everything but the GPU's bfloat16 dot itself, which the
gpu-marked tests at the end check on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Read when a kernel is defined, i.e. when triton_moe is imported below.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the fused-MoE kernels are Triton kernels")

from splitserve.kernels import triton_moe  # noqa: E402
from splitserve.layers import moe_backends  # noqa: E402
from splitserve.layers.moe import FusedMoE, RouterRule, moe_capturable  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = triton_moe.MoEConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=1, num_stages=1)
# Against float32 math on the same (rounded) inputs: float32 rounding; bfloat16: a few rounding steps.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _ids(tokens: int, k: int, experts: int, seed: int = 0, unused: int = 1) -> torch.Tensor:
    """[tokens, k] distinct experts per token; the last `unused` experts get no token."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts - unused, generator=gen)[:k] for _ in range(tokens)]).to(DEVICE)


def _randn(*shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


# --- alignment ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,k,experts,block_m", [(1, 1, 4, 16), (3, 2, 5, 4), (17, 2, 8, 16), (40, 2, 6, 8)])
def test_alignment_sorts_every_pair_once_into_single_expert_blocks(tokens, k, experts, block_m):
    ids = _ids(tokens, k, experts, seed=tokens)
    pairs = tokens * k
    sorted_ids, block_experts, total, counts = triton_moe.moe_align(ids, experts, block_m)
    blocks = -(-(pairs + experts * (block_m - 1)) // block_m)
    assert sorted_ids.shape == (blocks * block_m,) and block_experts.shape == (blocks,)
    assert counts.tolist() == torch.bincount(ids.reshape(-1).cpu(), minlength=experts).tolist()
    padded = [-(-c // block_m) * block_m for c in counts.tolist()]
    assert total.tolist() == [sum(padded)]
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    assert (sorted_ids[total.item() :] == pairs).all() and (block_experts[total.item() // block_m :] == -1).all()
    flat = ids.reshape(-1).cpu()
    rows = sorted_ids.cpu().view(blocks, block_m)
    for b in range(total.item() // block_m):
        members = rows[b][rows[b] < pairs]
        assert len(members) > 0, "a block in use holds at least one pair"
        assert (flat[members.long()] == block_experts[b].item()).all(), "one expert per block"
        assert members.tolist() == sorted(members.tolist()), "pairs in order within an expert"
        assert (rows[b][len(members) :] == pairs).all(), "padding (the sentinel) after an expert's pairs"
    assert counts[-1] == 0 and experts - 1 not in block_experts.tolist()


def test_alignment_has_no_value_dependent_shapes():
    """Under fake tensors (shapes only) every step runs: no .item(), no bincount, so a CUDA graph can
    capture it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ids = torch.tensor([[0, 1], [1, 3], [3, 0]])
    with FakeTensorMode() as mode:
        sorted_ids, block_experts, total, counts = triton_moe.moe_align(mode.from_tensor(ids), 4, 16)
        assert sorted_ids.shape == (5 * 16,)  # ceil((6 + 4 * 15) / 16) blocks of 16
        assert block_experts.shape == (5,) and total.shape == (1,)
        assert counts.shape == (4,)


# --- the grouped GEMM ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "tokens,k,experts,n,hidden", [(1, 1, 4, 24, 40), (3, 2, 5, 16, 16), (17, 2, 8, 33, 20), (17, 1, 6, 48, 17)]
)
def test_gemm_matches_a_loop_over_experts(tokens, k, experts, n, hidden, dtype):
    """Both projections' forms: rows gathered by token (pair // k) and rows by pair with the routing
    weight in the epilogue; one expert (the last) without tokens; N and K not multiples of the block."""
    ids = _ids(tokens, k, experts, seed=tokens + k)
    x = _randn(tokens, hidden, dtype=dtype, seed=1)
    w = _randn(experts, n, hidden, dtype=dtype, scale=0.3, seed=2)
    weights = torch.rand(tokens, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    alignment = triton_moe.moe_align(ids, experts, SMALL.block_m)[:3]
    by_token = torch.full((tokens * k, n), float("nan"), dtype=dtype, device=DEVICE)
    triton_moe.fused_moe_gemm(x, w, by_token, alignment, k, SMALL)
    rows = x.repeat_interleave(k, 0)  # row p is token p // k
    by_pair = torch.empty(tokens * k, n, dtype=dtype, device=DEVICE)
    triton_moe.fused_moe_gemm(rows, w, by_pair, alignment, 1, SMALL, topk_weights=weights)
    flat = ids.reshape(-1)
    expected = torch.stack([rows[p].float() @ w[flat[p]].float().T for p in range(tokens * k)])
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(by_token.float(), expected, atol=tol, rtol=tol)
    scaled = expected * weights.reshape(-1, 1)
    torch.testing.assert_close(by_pair.float(), scaled, atol=tol, rtol=tol)


# --- both projections ---------------------------------------------------------------------------------
def _reference_experts(x, weights, ids, w13, w2):
    """grouped_experts' semantics in plain torch, pair by pair: each product rounded to x's dtype,
    SiLU-and-mul, the weighted output rounded once, a token's k outputs summed."""
    tokens, k = ids.shape
    out = []
    for p, e in enumerate(ids.reshape(-1).tolist()):
        gate, up = (x[p // k].float() @ w13[e].float().T).to(x.dtype).float().chunk(2)
        h = (F.silu(gate) * up).to(x.dtype).float()
        out.append(((h @ w2[e].float().T).to(x.dtype).float() * weights.reshape(-1)[p].float()).to(x.dtype))
    return torch.stack(out).view(tokens, k, -1).sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tokens,k,experts,hidden,inter", [(1, 2, 4, 24, 8), (3, 1, 5, 20, 12), (17, 2, 8, 40, 24)])
def test_fused_experts_match_the_torch_reference(tokens, k, experts, hidden, inter, dtype):
    ids = _ids(tokens, k, experts, seed=7 * tokens)
    x = _randn(tokens, hidden, dtype=dtype, seed=4)
    w13 = _randn(experts, 2 * inter, hidden, dtype=dtype, scale=0.3, seed=5)
    w2 = _randn(experts, hidden, inter, dtype=dtype, scale=0.3, seed=6)
    weights = torch.rand(tokens, k, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    counts = torch.zeros(experts, dtype=torch.long, device=DEVICE)
    got = triton_moe.fused_experts(x, weights, ids, w13, w2, config=SMALL, expert_counts=counts)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    expected = _reference_experts(x, weights, ids, w13, w2).float()
    tol = TOLERANCE[dtype]  # of the largest output: the kernel rounds a weighted output once, torch twice
    torch.testing.assert_close(got.float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    assert counts.tolist() == torch.bincount(ids.reshape(-1).cpu(), minlength=experts).tolist()


def test_fused_experts_agree_with_grouped_experts():
    """Against the grouped-GEMM backend itself (torch._grouped_mm runs on the CPU too), float32."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no grouped GEMM")
    ids = _ids(9, 2, 6, seed=9)
    x, weights = _randn(9, 32, dtype=torch.float32, seed=10), torch.rand(9, 2).to(DEVICE)
    w13 = _randn(6, 32, 32, dtype=torch.float32, scale=0.2, seed=11)
    w2 = _randn(6, 32, 16, dtype=torch.float32, scale=0.2, seed=12)
    got = triton_moe.fused_experts(x, weights, ids, w13, w2, config=SMALL)
    expected, _ = moe_backends.grouped_experts(x, weights, ids, w13, w2)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# --- the layer's choice -------------------------------------------------------------------------------
def _layer(dtype=torch.bfloat16, quant_config=None, experts=4):
    layer = FusedMoE(experts, 32, 16, RouterRule(top_k=2), dtype, quant_config=quant_config)
    if quant_config is None:
        with torch.no_grad():
            for p in (layer.w13, layer.w2, layer.gate):
                p.normal_(0.0, 0.2)
    return layer


def test_cuda_layers_choose_triton_for_plain_experts_only(monkeypatch):
    from splitserve.quantization.config import QuantizationConfig

    cuda = torch.device("cuda")
    monkeypatch.setattr(moe_backends, "_grouped_gemm_on", lambda device: True)  # as on a Hopper GPU
    monkeypatch.delenv("SPLITSERVE_MOE_BACKEND", raising=False)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert _layer(dtype).backend(cuda, dtype) == "triton"
    quantized = _layer(quant_config=QuantizationConfig("weight_only_int8", from_checkpoint=False))
    assert quantized.backend(cuda, torch.bfloat16) == "loop"
    assert _layer().backend(torch.device("cpu"), torch.bfloat16) == "loop"  # the CPU keeps its own kernels
    monkeypatch.setenv("SPLITSERVE_MOE_BACKEND", "grouped_mm")
    assert _layer().backend(cuda, torch.bfloat16) == "grouped_mm" and _layer().grouped(cuda, torch.bfloat16)
    assert _layer(torch.float32).backend(cuda, torch.float32) == "loop"  # the grouped GEMM takes bfloat16 only
    monkeypatch.setenv("SPLITSERVE_MOE_BACKEND", "loop")
    assert _layer().backend(cuda, torch.bfloat16) == "loop"
    monkeypatch.setenv("SPLITSERVE_MOE_BACKEND", "auto")
    monkeypatch.setattr(moe_backends, "triton_moe", lambda: None)  # Triton not importable
    assert _layer().backend(cuda, torch.bfloat16) == "grouped_mm"


def test_a_triton_layer_is_capturable_and_computes_what_the_loop_does(monkeypatch):
    """FusedMoE.experts through fused_experts (the device check faked) against its own expert-by-expert
    loop, its device-side token counts, and moe_capturable."""
    layer = _layer(torch.float32, experts=5)
    x = _randn(7, 32, dtype=torch.float32, seed=13)
    weights, ids = layer.route(x)
    expected = layer.experts(x, weights, ids)  # the CPU: the loop
    monkeypatch.setattr(FusedMoE, "backend", lambda self, device, dtype: "triton")
    monkeypatch.setattr(moe_backends.triton_moe(), "default_config", lambda pairs, experts: SMALL)
    got = layer.experts(x, weights, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert layer.device_tokens_per_expert.tolist() == torch.bincount(ids.reshape(-1), minlength=5).tolist()
    assert moe_capturable(torch.nn.Sequential(layer), torch.device("cuda"), torch.float32)


# --- on a GPU -----------------------------------------------------------------------------------------
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@_NEEDS_CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_gpu_backends_agree(monkeypatch, tokens, dtype):
    """The default configs (decode and prefill blocks) on the GPU: triton, grouped_mm (where it runs)
    and the loop give the same sums, Granite-1B-A400M's expert shape (32 experts, top 8, 1024 / 512)."""
    layer = FusedMoE(32, 1024, 512, RouterRule(top_k=8, scoring="topk_softmax"), dtype).to("cuda")
    with torch.no_grad():
        for p in (layer.w13, layer.w2, layer.gate):
            p.normal_(0.0, 0.05)
    x = torch.randn(tokens, 1024, dtype=dtype, device="cuda")
    weights, ids = layer.route(x)
    results = {}
    for backend in ("triton", "grouped_mm", "loop"):
        monkeypatch.setenv("SPLITSERVE_MOE_BACKEND", backend)
        if layer.backend(x.device, dtype) == backend:
            results[backend] = layer.experts(x, weights, ids).float()
    assert "triton" in results and "loop" in results
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for backend, out in results.items():
        torch.testing.assert_close(out, results["loop"], atol=tol, rtol=tol, msg=backend)


@pytest.mark.gpu
@_NEEDS_CUDA
def test_gpu_fused_experts_replay_in_a_cuda_graph():
    """Captured once, replayed on other tokens' routes: the alignment and both launches follow the
    new values (nothing was read on the host at capture)."""
    ids = _ids(16, 2, 8, seed=14)
    x, weights = _randn(16, 256, dtype=torch.bfloat16, seed=15), torch.rand(16, 2, device="cuda")
    w13 = _randn(8, 256, 256, dtype=torch.bfloat16, scale=0.05, seed=16)
    w2 = _randn(8, 256, 128, dtype=torch.bfloat16, scale=0.05, seed=17)
    triton_moe.fused_experts(x, weights, ids, w13, w2)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.fused_experts(x, weights, ids, w13, w2)
    ids.copy_(_ids(16, 2, 8, seed=18))
    x.copy_(_randn(16, 256, dtype=torch.bfloat16, seed=19))
    graph.replay()
    expected = triton_moe.fused_experts(x, weights, ids, w13, w2)
    torch.testing.assert_close(out, expected)
