"""splitserve's Triton element-wise kernels (RMSNorm with and without the residual add, rotary,
SiLU-and-mul) against the torch code they replace, and the routing in splitserve.kernels (CUDA
tensors only). Without CUDA the kernels run in Triton's CPU interpreter (slow: few tokens per
case); bfloat16 runs only on CUDA (the interpreter computes it wrongly)."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Read when a kernel is defined, i.e. when triton_ops is imported below.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from splitserve import kernels  # noqa: E402
from splitserve.kernels import triton_ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_CUDA_ONLY = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bfloat16 is computed wrongly by Triton's CPU interpreter"
)
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=[_CUDA_ONLY, pytest.mark.gpu])]
# Against the torch code: float32 to float32 rounding; 16-bit: a rounding step of the dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _randn(*shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _close(actual, expected, dtype, factor=1.0):
    tol = TOLERANCE[dtype] * factor
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# --- the torch references (splitserve.kernels' torch path) -----------------------------------------
def _ref_rms_norm(x, weight, eps, residual=None):
    if residual is not None:
        x = residual = x + residual
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype), residual


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _ref_rotary(x, cos, sin):
    return x * cos + _rotate_half(x) * sin


def _ref_rotary_fp32(x, cos, sin):
    """The kernel's own contract: float32 math, one rounding."""
    return _ref_rotary(x.float(), cos.float(), sin.float()).to(x.dtype)


def _ref_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _cos_sin(num_tokens, head_dim, dtype, seed=0):
    """[T, 1, D] in the model dtype, laid out as RotaryEmbedding.cos_sin hands them over."""
    gen = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).float()
    emb = torch.cat([positions[:, None] * inv_freq[None, :]] * 2, dim=-1)
    return emb.cos().to(dtype).to(DEVICE)[:, None, :], emb.sin().to(dtype).to(DEVICE)[:, None, :]


# --- RMSNorm -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 1024])
def test_rms_norm(dtype, hidden):
    x = _randn(3, hidden, dtype=dtype, scale=3, seed=1)
    weight = _randn(hidden, dtype=dtype, seed=2)
    out, res = triton_ops.rms_norm(x, weight, 1e-6)
    assert res is None and out.shape == x.shape and out.dtype == dtype
    _close(out, _ref_rms_norm(x, weight, 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_updates_it_in_place(dtype):
    hidden = 576
    wide = _randn(4, hidden + 40, dtype=dtype, scale=2, seed=3)
    x = wide[:, 8 : 8 + hidden]  # strided rows
    weight = _randn(hidden, dtype=dtype, seed=4)
    residual = _randn(4, hidden, dtype=dtype, seed=5)
    ref_out, ref_res = _ref_rms_norm(x, weight, 1e-5, residual.clone())
    before = wide.clone()
    out, res = triton_ops.rms_norm(x, weight, 1e-5, residual)
    assert res is residual
    torch.testing.assert_close(residual, ref_res, atol=0, rtol=0)  # one rounded add: exact
    _close(out, ref_out, dtype)
    torch.testing.assert_close(wide, before, atol=0, rtol=0)  # x is only read


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_of_rows_longer_than_a_block(monkeypatch, dtype, with_residual):
    """The chunked two-pass path (rows over MAX_ROW_BLOCK), with a partial last chunk."""
    monkeypatch.setattr(triton_ops, "MAX_ROW_BLOCK", 128)
    x = _randn(3, 576, dtype=dtype, seed=6)
    weight = _randn(576, dtype=dtype, seed=7)
    residual = _randn(3, 576, dtype=dtype, seed=8) if with_residual else None
    ref_out, ref_res = _ref_rms_norm(x, weight, 1e-6, None if residual is None else residual.clone())
    out, res = triton_ops.rms_norm(x, weight, 1e-6, residual)
    _close(out, ref_out, dtype)
    if with_residual:
        torch.testing.assert_close(res, ref_res, atol=0, rtol=0)


def test_rms_norm_of_a_16384_wide_row():
    x = _randn(2, 16384, dtype=torch.float16, seed=9)
    weight = _randn(16384, dtype=torch.float16, seed=10)
    residual = _randn(2, 16384, dtype=torch.float16, seed=11)
    ref_out, ref_res = _ref_rms_norm(x, weight, 1e-6, residual.clone())
    out, res = triton_ops.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)
    _close(out, ref_out, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_rms_norm_per_head_on_a_qkv_view(dtype, head_dim):
    """Qwen3's q_norm / k_norm: [T, H, D] views into the fused qkv output, rows T * H."""
    T, hq, hk = 3, 4, 2
    qkv = _randn(T, (hq + 2 * hk) * head_dim, dtype=dtype, seed=12)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q, k = q.view(T, hq, head_dim), k.view(T, hk, head_dim)
    weight = _randn(head_dim, dtype=dtype, seed=13)
    before = qkv.clone()
    for x in (q, k):
        out, _ = triton_ops.rms_norm(x, weight, 1e-6)
        assert out.shape == x.shape and out.is_contiguous()
        _close(out, _ref_rms_norm(x, weight, 1e-6)[0], dtype)
    torch.testing.assert_close(qkv, before, atol=0, rtol=0)


def test_rms_norm_of_layouts_that_need_a_copy():
    """Leading dims that cannot be merged into rows, and a non-unit last stride: copied, and the
    residual still updated in place."""
    d = 48
    x = _randn(3, 2, 4, d, dtype=torch.float32, seed=14).transpose(0, 1)  # [2, 3, 4, d], dims 0, 1 unmergeable
    residual = _randn(3, 2, 4, d, dtype=torch.float32, seed=15).transpose(0, 1)
    weight = _randn(d, dtype=torch.float32, seed=16)
    ref_out, ref_res = _ref_rms_norm(x, weight, 1e-6, residual.clone())
    out, res = triton_ops.rms_norm(x, weight, 1e-6, residual)
    assert res is residual
    torch.testing.assert_close(residual, ref_res, atol=0, rtol=0)
    _close(out, ref_out, torch.float32)
    y = _randn(d, 5, dtype=torch.float32, seed=17).t()  # last stride 5
    _close(triton_ops.rms_norm(y, weight, 1e-6)[0], _ref_rms_norm(y, weight, 1e-6)[0], torch.float32)


def test_rms_norm_with_a_float32_weight_promotes_like_torch():
    x = _randn(2, 96, dtype=torch.float16, seed=18)
    weight = _randn(96, dtype=torch.float32, seed=19)
    out, _ = triton_ops.rms_norm(x, weight, 1e-6)
    ref = _ref_rms_norm(x, weight, 1e-6)[0]
    assert out.dtype == ref.dtype == torch.float32
    _close(out, ref, torch.float32)


# --- rotary --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 80, 256])
def test_rotary_in_place_on_qkv_views(dtype, head_dim):
    T, hq, hk = 5, 4, 2
    qkv = _randn(T, (hq + 2 * hk) * head_dim, dtype=dtype, scale=2, seed=20)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q, k = q.view(T, hq, head_dim), k.view(T, hk, head_dim)
    assert q.stride(0) == qkv.shape[1]
    cos, sin = _cos_sin(T, head_dim, dtype, seed=21)
    ref_q, ref_k, v_before = _ref_rotary(q, cos, sin), _ref_rotary(k, cos, sin), v.clone()
    exact_q, exact_k = _ref_rotary_fp32(q, cos, sin), _ref_rotary_fp32(k, cos, sin)
    out_q, out_k = triton_ops.rotary(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(v, v_before, atol=0, rtol=0)
    # the kernel rounds once, the torch code after every op: one more rounding step apart
    _close(q, ref_q, dtype, factor=2)
    _close(k, ref_k, dtype, factor=2)
    _close(q, exact_q, dtype)
    _close(k, exact_k, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_over_several_head_blocks(monkeypatch, dtype):
    """More heads than a program takes (odd counts, partial blocks of q and of k), strided heads."""
    monkeypatch.setattr(triton_ops, "ROTARY_ELEMENTS", 128)  # 2 heads of 64 per program
    T, hq, hk, d = 3, 5, 3, 64
    buf = _randn(T, 10, d + 16, dtype=dtype, seed=22)  # heads 16 apart beyond head_dim
    q, k = buf[:, :hq, :d], buf[:, hq : hq + hk, :d]
    # random cos / sin, halves unequal: the kernel must use each half where rotate-half does
    cos, sin = _randn(T, 1, d, dtype=dtype, seed=23), _randn(T, 1, d, dtype=dtype, seed=24)
    exact_q, exact_k = _ref_rotary_fp32(q, cos, sin), _ref_rotary_fp32(k, cos, sin)
    before = buf.clone()
    triton_ops.rotary(q, k, cos, sin)
    _close(q, exact_q, dtype)
    _close(k, exact_k, dtype)
    untouched = torch.ones_like(buf, dtype=torch.bool)
    untouched[:, : hq + hk, :d] = False
    assert torch.equal(buf[untouched], before[untouched])


# --- SiLU and mul ---------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [1536, 72])
def test_silu_and_mul(dtype, intermediate):
    wide = _randn(3, 2 * intermediate + 24, dtype=dtype, scale=4, seed=24)
    wide[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # saturating gates
    x = wide[:, : 2 * intermediate]  # strided rows
    out = triton_ops.silu_and_mul(x)
    assert out.shape == (3, intermediate) and out.dtype == dtype
    ref = _ref_silu_and_mul(x)
    exact = _ref_silu_and_mul(x.float()).to(dtype)
    assert torch.isfinite(out.float()).all()
    _close(out, ref, dtype, factor=2)  # torch rounds silu(gate) before the product
    _close(out, exact, dtype)


# --- routing in splitserve.kernels ----------------------------------------------------------------------
class _NoCalls:
    def __getattr__(self, name):
        raise AssertionError(f"triton_ops.{name} called for a CPU tensor")


def test_cpu_tensors_never_reach_triton(monkeypatch):
    monkeypatch.setitem(kernels._state, "ops", None)  # the torch path (no C++ build needed)
    monkeypatch.setitem(kernels._state, "gpu", _NoCalls())
    x, w = torch.randn(3, 64), torch.randn(64)
    kernels.rms_norm(x, w, 1e-6)
    kernels.rms_norm(x, w, 1e-6, torch.randn(3, 64))
    kernels.apply_rotary(torch.randn(3, 2, 64), torch.randn(3, 1, 64), *_cos_sin(3, 64, torch.float32))
    kernels.silu_and_mul(torch.randn(3, 128))


def test_cpu_tensors_do_not_import_triton_ops(monkeypatch):
    monkeypatch.setitem(kernels._state, "ops", None)
    monkeypatch.delitem(kernels._state, "gpu", raising=False)
    assert not kernels._use_gpu_kernel(torch.randn(2, 8))
    kernels.silu_and_mul(torch.randn(2, 8))
    assert "gpu" not in kernels._state


def test_gpu_kernels_switch(monkeypatch, caplog):
    monkeypatch.delitem(kernels._state, "gpu", raising=False)
    monkeypatch.delenv("SPLITSERVE_GPU_KERNELS", raising=False)
    assert kernels.gpu_ops() is triton_ops
    monkeypatch.setenv("SPLITSERVE_GPU_KERNELS", "0")
    monkeypatch.delitem(kernels._state, "gpu")
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        assert kernels.gpu_ops() is None
        assert kernels.gpu_ops() is None
    assert sum("SPLITSERVE_GPU_KERNELS=0" in r.getMessage() for r in caplog.records) == 1


def test_without_triton_cuda_runs_torch(monkeypatch, caplog):
    monkeypatch.delitem(kernels._state, "gpu", raising=False)
    monkeypatch.delenv("SPLITSERVE_GPU_KERNELS", raising=False)
    monkeypatch.delattr(kernels, "triton_ops", raising=False)  # triton_ops is imported afresh ...
    monkeypatch.delitem(sys.modules, "splitserve.kernels.triton_ops", raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)  # ... and its `import triton` fails
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        assert kernels.gpu_ops() is None
    assert any("triton cannot be imported" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_routing_conditions_on_model_layouts(monkeypatch, dtype):
    """The kernels' entry points with the GPU gate forced open for CPU tensors (interpreter): the
    layouts a decoder layer hands over (fused qkv views, Qwen3's per-head norm, RotaryEmbedding's
    cos/sin, the residual stream) take the Triton path and agree with the torch path."""
    from types import SimpleNamespace

    from splitserve.layers.rotary import RotaryEmbedding

    if DEVICE.type == "cuda":
        pytest.skip("covered by test_cuda_tensors_take_triton")
    T, hq, hk, d, hidden = 3, 4, 2, 64, 96
    calls = []

    class Recorder:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(triton_ops, name)

    monkeypatch.setitem(kernels._state, "ops", None)
    qkv = _randn(T, (hq + 2 * hk) * d, dtype=dtype, seed=30)
    x, residual = _randn(T, hidden, dtype=dtype, seed=31), _randn(T, hidden, dtype=dtype, seed=32)
    w_head, w_hidden = _randn(d, dtype=dtype, seed=33), _randn(hidden, dtype=dtype, seed=34)
    gate_up = _randn(T, 2 * 160, dtype=dtype, seed=35)
    rope = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), d, 64)
    cos_sin = rope.cos_sin(torch.tensor([0, 7, 63]), dtype)

    def layer_steps(qkv, residual):
        q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k = q.view(T, hq, d), k.view(T, hk, d)
        q, k = kernels.rms_norm(q, w_head, 1e-6)[0], kernels.rms_norm(k, w_head, 1e-6)[0]
        q, k = kernels.apply_rotary(q, k, *cos_sin)
        q2, k2 = qkv[:, : hq * d].view(T, hq, d), qkv[:, hq * d : (hq + hk) * d].view(T, hk, d)
        q2, k2 = kernels.apply_rotary(q2, k2, *cos_sin)  # rotary straight on the strided views
        normed, residual = kernels.rms_norm(x, w_hidden, 1e-6, residual)
        return q, k, q2, k2, normed, residual.clone(), kernels.silu_and_mul(gate_up)

    reference = layer_steps(qkv.clone(), residual.clone())
    monkeypatch.setitem(kernels._state, "gpu", Recorder())
    monkeypatch.setattr(kernels, "_use_gpu_kernel", lambda t: kernels.gpu_ops() is not None)
    fused = layer_steps(qkv.clone(), residual.clone())
    assert calls == ["rms_norm", "rms_norm", "rotary", "rotary", "rms_norm", "silu_and_mul"]
    for got, ref in zip(fused, reference):
        _close(got, ref, dtype, factor=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_take_triton(monkeypatch):
    calls = []

    class Recorder:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(triton_ops, name)

    monkeypatch.setitem(kernels._state, "gpu", Recorder())
    x, w = _randn(3, 64, dtype=torch.bfloat16), _randn(64, dtype=torch.bfloat16)
    kernels.rms_norm(x, w, 1e-6, x.clone())
    cos, sin = _cos_sin(3, 64, torch.bfloat16)
    kernels.apply_rotary(_randn(3, 2, 64, dtype=torch.bfloat16), _randn(3, 1, 64, dtype=torch.bfloat16), cos, sin)
    kernels.silu_and_mul(_randn(3, 128, dtype=torch.bfloat16))
    assert calls == ["rms_norm", "rotary", "silu_and_mul"]
