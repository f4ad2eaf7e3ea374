"""splitserve's GGUF kernels (splitserve/kernels/gguf_products.cpp) against the gguf package's numpy
dequantize: dequantization and embedding rows exactly, products against x @ dequantize(w).T."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from splitserve import kernels
from splitserve.kernels import cpu_features
from splitserve.kernels import gguf as gguf_kernels

pytestmark = pytest.mark.usefixtures("parallel_kernels")  # two threads, whatever the worker runs

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
IDS = [t.name for t in TYPES]


@pytest.fixture(scope="module")
def ops():
    built = kernels.cpu_ops()
    assert built is not None, "the CPU kernels did not build (see the warning logged above)"
    return built


def _k(qtype) -> int:
    """Seven blocks of 32 (an odd number of chunks: the kernels' pairs end on a single one), or
    three K-quant super-blocks."""
    return 7 * 32 if gguf.GGML_QUANT_SIZES[qtype][0] == 32 else 3 * 256


def _weight(qtype, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, row_bytes] uint8: random weights quantized by the gguf package where it can (the 32-value
    types), else random blocks with sane scales (finite float16 d and dmin; any bytes make valid
    6-bit K-quant scales and mins, and int8 Q6_K scales)."""
    rng = np.random.default_rng(seed)
    try:
        return torch.from_numpy(gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype))
    except NotImplementedError:
        pass
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    scale = lambda: (rng.random((n, k // values, 1)) * 2e-3).astype(np.float16).view(np.uint8)  # noqa: E731
    if qtype == Q.Q6_K:
        blocks[..., 208:210] = scale()  # d last, after 128 + 64 bytes of codes and 16 scales
    else:
        blocks[..., 0:2], blocks[..., 2:4] = scale(), scale()  # d, dmin first
    return torch.from_numpy(blocks.reshape(n, -1))


def _reference(w: torch.Tensor, qtype, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(w.numpy(), qtype).reshape(n, k).copy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_dequantize_equals_the_gguf_package(ops, qtype, dtype):
    n, k = 37, _k(qtype)
    w = _weight(qtype, n, k)
    out = ops.gguf_dequantize(w, int(qtype), n, k, dtype)
    assert out.dtype == dtype and out.shape == (n, k)
    torch.testing.assert_close(out, _reference(w, qtype, n, k).to(dtype), atol=0, rtol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_embedding_rows_equal_the_gguf_package(ops, qtype):
    vocab, k = 50, _k(qtype)
    w = _weight(qtype, vocab, k, seed=1)
    ids = torch.tensor([[3, 49, 0], [3, 17, 17]])  # repeats, both ends of the vocabulary
    out = gguf_kernels.gguf_embedding(ids, w, int(qtype), k, torch.bfloat16)
    assert out.shape == (2, 3, k)
    expected = _reference(w, qtype, vocab, k).to(torch.bfloat16)[ids]
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def _integer_path(m: int, dtype: torch.dtype, native_bf16: bool) -> bool:
    """Whether gguf_mm takes the 8-bit integer path (gguf_products.cpp's kDequantizeFromRows[Bf16])."""
    return m < (8 if dtype == torch.bfloat16 and native_bf16 else 16)


def _check_product(out, x, w_ref, exact: bool):
    """out against x @ w_ref.T in float64. Exact paths (float32 x through float32 tiles): as
    F.linear, to 1e-5 of the outputs' root mean square (rms). The 8-bit path rounds x to a step of
    d = max|x| / 127 per 32 values: an error up to d / 2, uniform, d / sqrt(12) rms, which for
    Gaussian x (max of 32 about 2.1 sigma) is 0.5% of x's rms, and so about 0.5% of the outputs'
    rms; we allow 1.5% rms and 5% for the largest (the tail of a few hundred outputs, plus bfloat16's
    rounding of outputs up to ~4 rms at 2^-9, and bfloat16 tiles' rounding of the weights)."""
    ref = x.double() @ w_ref.double().T
    err, rms = (out.double() - ref), ref.pow(2).mean().sqrt()
    if exact:
        assert err.abs().max() <= 1e-5 * rms
    else:
        assert err.pow(2).mean().sqrt() <= 0.015 * rms
        assert err.abs().max() <= 0.05 * rms


@pytest.mark.parametrize("m", [1, 3, 7, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_product_matches_the_dequantized_weights(ops, qtype, dtype, m):
    """M = 1, 3, 7: the integer path with 1, 3 and 4 + 3 rows of x per weight row; 16 and 40 the
    tiles (float32 or, with native bf16, bfloat16) except 16 where float32 x stops at 16."""
    n, k = 45, _k(qtype)
    w = _weight(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = gguf_kernels.gguf_mm(x, w, int(qtype), n, k)
    assert out.dtype == dtype and out.shape == (m, n)
    native = cpu_features.native_bf16()
    _check_product(out, x, _reference(w, qtype, n, k), dtype == torch.float32 and not _integer_path(m, dtype, native))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q6_K], ids=["Q4_1", "Q8_0", "Q6_K"])
def test_the_integer_path_gives_each_row_the_same_result_at_every_row_count(ops, qtype, dtype):
    """path=1 (batch-invariant numerics' generated tokens): integers for any M, blocks or repacked,
    and a row's result does not depend on how many rows come with it; path=2 gives the tiles at any M."""
    n, k = 48, _k(qtype)
    w = _weight(qtype, n, k, seed=3)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(9)).to(dtype)
    native = cpu_features.native_bf16()
    weights = [(w, int(qtype))]
    repacked = gguf_kernels.repack(w, int(qtype), n, k)
    if repacked is not None:
        weights.append(repacked)
    for weight, wtype in weights:
        alone = torch.cat([ops.gguf_mm(x[i : i + 1].contiguous(), weight, wtype, n, k, native, 1) for i in range(40)])
        for m in (1, 2, 3, 5, 8, 16, 25, 40):
            assert torch.equal(ops.gguf_mm(x[:m].contiguous(), weight, wtype, n, k, native, 1), alone[:m]), (wtype, m)
        _check_product(
            ops.gguf_mm(x[:2].contiguous(), weight, wtype, n, k, native, 2), x[:2], _reference(w, qtype, n, k), False
        )


@pytest.mark.parametrize("native_bf16", [False, True])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=["Q4_1", "Q6_K"])
def test_bfloat16_x_with_and_without_native_bf16(ops, qtype, native_bf16):
    """The flag from Python picks bfloat16 or float32 tiles (and the switch point): both are right
    wherever they run (without native bf16 the bfloat16 matmul is emulated, slower, not wrong)."""
    n, k = 70, _k(qtype)
    w = _weight(qtype, n, k, seed=5)
    for m in (6, 12, 20):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        _check_product(ops.gguf_mm(x, w, int(qtype), n, k, native_bf16), x, _reference(w, qtype, n, k), False)


def test_smollm2_shapes_and_float16_and_batched_input(ops):
    """SmolLM2-135M's down projection (K=1536 -> 576) in Q8_0 with x [2, 3, K] float16 (computed in
    float32); then 576 -> 4000 in Q4_0 for 40 rows of x, more than one tile (1792 rows of float32
    at K=576) per thread."""
    w = _weight(Q.Q8_0, 576, 1536)
    x = torch.randn(2, 3, 1536, generator=torch.Generator().manual_seed(0)).half()
    out = gguf_kernels.gguf_mm(x, w, int(Q.Q8_0), 576, 1536)
    assert out.shape == (2, 3, 576) and out.dtype == torch.float16
    _check_product(out.view(6, 576).float(), x.view(6, 1536).float(), _reference(w, Q.Q8_0, 576, 1536), False)
    w = _weight(Q.Q4_0, 4000, 576)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(1))
    _check_product(gguf_kernels.gguf_mm(x, w, int(Q.Q4_0), 4000, 576), x, _reference(w, Q.Q4_0, 4000, 576), True)


REPACK_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def _repacked(w: torch.Tensor, qtype, n: int, k: int) -> tuple[torch.Tensor, int]:
    repacked = gguf_kernels.repack(w, int(qtype), n, k)
    assert repacked is not None
    assert repacked[0].shape == (n // 16, 16 * w.shape[1]) and repacked[1] == int(qtype) + gguf_kernels.REPACKED
    return repacked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", REPACK_TYPES, ids=[t.name for t in REPACK_TYPES])
def test_repacked_weights_dequantize_to_the_same_values(ops, qtype, dtype):
    """Interleaving moves bytes only: every row dequantizes exactly as before (and as the gguf package)."""
    n, k = 48, _k(qtype)
    w = _weight(qtype, n, k, seed=3)
    rw, rtype = _repacked(w, qtype, n, k)
    assert not torch.equal(rw.view(-1), w.view(-1))  # the bytes did move
    expected = _reference(w, qtype, n, k).to(dtype)
    torch.testing.assert_close(gguf_kernels.gguf_dequantize(rw, rtype, n, k, dtype), expected, atol=0, rtol=0)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 23, 24, 40, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", REPACK_TYPES, ids=[t.name for t in REPACK_TYPES])
def test_repacked_product_matches_the_dequantized_weights(ops, qtype, dtype, m):
    """The 16-row integer path (1 .. 4 x rows per pass: M = 1, 2, 3, 4 + 1, 4 x 2, and up to 63
    float32 rows) and the tiles dequantized from the repacked layout (float32 from 64 rows; bfloat16
    with native bf16 from 24, which gguf_mm's row padding makes 17): as close to x @ W.T as the
    blocks' own paths."""
    n, k = 64, _k(qtype)
    w = _weight(qtype, n, k, seed=m)
    rw, rtype = _repacked(w, qtype, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = gguf_kernels.gguf_mm(x, rw, rtype, n, k)
    assert out.dtype == dtype and out.shape == (m, n)
    tiles = m >= (512 if qtype == Q.Q8_0 else 24 if dtype == torch.bfloat16 and cpu_features.native_bf16() else 64)
    _check_product(out, x, _reference(w, qtype, n, k), dtype == torch.float32 and tiles)


@pytest.mark.parametrize("qtype", REPACK_TYPES, ids=[t.name for t in REPACK_TYPES])
def test_repacked_single_row_is_the_blocks_integer_product(ops, qtype):
    """One x row (single-stream decode): the same 8-bit x and integer sums as the blocks' path,
    summed in another order, so equal to float32 rounding, on SmolLM2's widest shape."""
    n, k = 1536, 576
    w = _weight(qtype, n, k, seed=11)
    rw, rtype = _repacked(w, qtype, n, k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
    blocks, repacked = ops.gguf_mm(x, w, int(qtype), n, k, False), ops.gguf_mm(x, rw, rtype, n, k, False)
    torch.testing.assert_close(repacked, blocks, atol=1e-5 * blocks.abs().max().item(), rtol=1e-5)


def test_what_is_not_repacked(ops):
    """Types without a repacked kernel and row counts off the 16-row groups stay as they are; the
    op itself says why it refuses them, and checks a repacked weight's shape."""
    w8 = _weight(Q.Q6_K, 32, 256)
    assert gguf_kernels.repack(w8, int(Q.Q6_K), 32, 256) is None
    w4 = _weight(Q.Q4_1, 40, 64)
    assert gguf_kernels.repack(w4, int(Q.Q4_1), 40, 64) is None
    with pytest.raises(RuntimeError, match="is not repacked here"):
        ops.gguf_repack(w8, int(Q.Q6_K), 32, 256)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        ops.gguf_repack(w4, int(Q.Q4_1), 40, 64)
    rw, rtype = _repacked(w4[:32].contiguous(), Q.Q4_1, 32, 64)
    with pytest.raises(RuntimeError, match=r"must be \[2, 640\] bytes"):
        ops.gguf_mm(torch.randn(1, 64), rw[:, :600].contiguous(), rtype, 32, 64, False)
    with pytest.raises(RuntimeError, match="a repacked weight has a multiple of 16 rows"):
        ops.gguf_dequantize(rw, rtype, 30, 64, torch.float32)


def test_inputs_are_checked(ops):
    w = _weight(Q.Q8_0, 4, 64)
    x = torch.randn(2, 64)
    cases = [
        (lambda: ops.gguf_mm(x, w, int(Q.Q2_K), 4, 64), "has no kernel here"),
        (lambda: ops.gguf_mm(x[:, :48].contiguous(), w, int(Q.Q8_0), 4, 48), "not a multiple of Q8_0's block"),
        (lambda: ops.gguf_mm(x, w[:, :60].contiguous(), int(Q.Q8_0), 4, 64), r"must be \[4, 68\] bytes"),
        (lambda: ops.gguf_mm(x, w.view(torch.int8), int(Q.Q8_0), 4, 64), "uint8 tensor of raw blocks"),
        (lambda: ops.gguf_mm(x, w.t().contiguous().t(), int(Q.Q8_0), 4, 64), "must be contiguous"),
        (lambda: ops.gguf_mm(x.long(), w, int(Q.Q8_0), 4, 64), "float32 or bfloat16"),
        (lambda: ops.gguf_mm(x[:, :32], w, int(Q.Q8_0), 4, 64), r"x must be \[M, K\] with K = 64"),
        (lambda: ops.gguf_dequantize(w, int(Q.Q8_0), 4, 64, torch.int32), "float32, bfloat16 or float16"),
        (lambda: ops.gguf_embedding(torch.tensor([4]), w, int(Q.Q8_0), 64, torch.float32), r"lie in \[0, 4\)"),
        (lambda: ops.gguf_embedding(torch.tensor([1], dtype=torch.int32), w, int(Q.Q8_0), 64, torch.float32), "int64"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


def test_reference_path_when_the_kernels_are_off(monkeypatch, caplog):
    """SPLITSERVE_CPU_KERNELS=0 (no ops) and types without a kernel: the gguf package's dequantize
    and F.linear, logged once per reason."""
    monkeypatch.setitem(kernels._state, "ops", None)
    monkeypatch.setattr(gguf_kernels, "_logged", set())
    w = _weight(Q.Q5_1, 8, 64)
    x = torch.randn(3, 64)
    with caplog.at_level(logging.INFO, logger="splitserve.kernels.gguf"):
        for _ in range(2):
            out = gguf_kernels.gguf_mm(x, w, int(Q.Q5_1), 8, 64)
            emb = gguf_kernels.gguf_embedding(torch.tensor([7, 0]), w, int(Q.Q5_1), 64, torch.float32)
    reference = _reference(w, Q.Q5_1, 8, 64)
    torch.testing.assert_close(out, F.linear(x, reference), atol=0, rtol=0)
    torch.testing.assert_close(emb, reference[[7, 0]], atol=0, rtol=0)
    off = [r for r in caplog.records if "C++ CPU kernels are off" in r.getMessage()]
    assert len(off) == 1
    monkeypatch.undo()
    q2k = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4, 84), dtype=np.uint8))
    q2k[:, 80:84] = torch.from_numpy(np.full((4, 2), 1e-3, dtype=np.float16).view(np.uint8))  # d, dmin
    torch.testing.assert_close(
        gguf_kernels.gguf_dequantize(q2k, int(Q.Q2_K), 4, 256), _reference(q2k, Q.Q2_K, 4, 256), atol=0, rtol=0
    )


@pytest.mark.slow  # rebuilds the kernels and reruns this module in a subprocess
@pytest.mark.skipif(
    cpu_features.requested_isa() == "avx2" or cpu_features.isa() != "avx512",
    reason="this run is the AVX2 build already (or the machine has no AVX-512 to leave out)",
)
def test_the_avx2_build_passes_these_tests_too():
    """On an AVX-512 machine, the same tests again with the kernels built without AVX-512 (256-bit
    code unpacking, maddubs dot products, float32 tiles), as AVX2-only machines run them."""
    env = {**os.environ, cpu_features.ISA_ENV: "avx2"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout


@pytest.mark.parametrize("qtype", REPACK_TYPES, ids=[t.name for t in REPACK_TYPES])
def test_embedding_rows_of_a_repacked_head_are_the_blocks_rows(ops, qtype):
    """A tied LM head repacked for its products still serves token lookups, row for row."""
    n, k = 64, _k(qtype)
    w = _weight(qtype, n, k, seed=4)
    rw, rtype = _repacked(w, qtype, n, k)
    ids = torch.tensor([0, 17, 63, 17, 5])
    for dtype in (torch.float32, torch.bfloat16):
        expected = gguf_kernels.gguf_embedding(ids, w, int(qtype), k, dtype)
        assert torch.equal(gguf_kernels.gguf_embedding(ids, rw, rtype, k, dtype), expected)
    with pytest.raises(RuntimeError, match="token ids must lie in"):
        ops.gguf_embedding(torch.tensor([64]), rw, rtype, k, torch.float32)
