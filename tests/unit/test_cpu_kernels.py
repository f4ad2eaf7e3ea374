"""splitserve's C++ CPU kernels against the torch code they replace (which stays in
splitserve.kernels as the reference, and in the torch attention backend)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from splitserve import kernels
from splitserve.executor.attention.backend import AttentionMetadata
from splitserve.executor.attention.torch_ref import TorchAttentionBackend, _decode
from splitserve.kernels import cpu_features

pytestmark = pytest.mark.usefixtures("parallel_kernels")  # two threads, whatever the worker runs


@pytest.fixture(scope="module")
def ops():
    built = kernels.cpu_ops()
    assert built is not None, "the CPU kernels did not build (see the warning logged above)"
    return built


def _reference(monkeypatch, fn, *args):
    """Run a splitserve.kernels function down its torch path."""
    monkeypatch.setitem(kernels._state, "ops", None)
    out = fn(*args)
    monkeypatch.undo()
    return out


def _close(a, b, dtype):
    # bfloat16 / float16: the fused kernels round at the same points as the torch ops, but exp and
    # sums may differ in the last float32 bit, which can flip one rounding step.
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add(ops, monkeypatch, dtype):
    torch.manual_seed(0)
    x = torch.randn(37, 96, dtype=dtype) * 3
    weight = torch.randn(96, dtype=dtype)
    residual = torch.randn(37, 96, dtype=dtype)
    _close(kernels.rms_norm(x, weight, 1e-6)[0], _reference(monkeypatch, kernels.rms_norm, x, weight, 1e-6)[0], dtype)
    ref_out, ref_res = _reference(monkeypatch, kernels.rms_norm, x, weight, 1e-6, residual.clone())
    res = residual.clone()
    out, new_res = kernels.rms_norm(x, weight, 1e-6, res)
    assert new_res is res  # updated in place
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)  # one rounded add: exact
    _close(out, ref_out, dtype)


def test_rms_norm_of_strided_3d_input(ops, monkeypatch):
    """Qwen3's q/k norm: [T, H, D] views into the fused qkv output."""
    qkv = torch.randn(5, 3 * 64, dtype=torch.bfloat16)
    q = qkv[:, :128].view(5, 2, 64)
    weight = torch.randn(64, dtype=torch.bfloat16)
    _close(
        kernels.rms_norm(q, weight, 1e-6)[0],
        _reference(monkeypatch, kernels.rms_norm, q, weight, 1e-6)[0],
        torch.bfloat16,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_qkv_views(ops, monkeypatch, dtype):
    torch.manual_seed(1)
    T, hq, hk, d = 11, 4, 2, 32
    qkv = torch.randn(T, (hq + 2 * hk) * d, dtype=dtype)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(T, hq, d), k.view(T, hk, d)
    angles = torch.rand(T, 1, d // 2) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    ref_q, ref_k = _reference(monkeypatch, kernels.apply_rotary, q, k, cos, sin)
    out_q, out_k = kernels.apply_rotary(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr()
    torch.testing.assert_close(out_q, ref_q, atol=0, rtol=0)
    torch.testing.assert_close(out_k, ref_k, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(ops, monkeypatch, dtype):
    torch.manual_seed(2)
    x = torch.randn(19, 2 * 72, dtype=dtype) * 4
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # saturating gates
    _close(kernels.silu_and_mul(x), _reference(monkeypatch, kernels.silu_and_mul, x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_lanes_round_as_the_scalar_loop(ops, dtype):
    """The element-wise kernels take whole vectors of a row (16 or 8 lanes) and finish the row one
    value at a time; both must give the same bits. Rows of 21 values (an AVX-512 vector and a tail
    of 5, or two AVX2 vectors and the same tail) hold the same five values at 0-4 and 16-20: zeros of
    both signs (a negated +0 must stay -0), values whose products are bfloat16 and float16
    denormals, large and ordinary ones."""
    five = torch.tensor([0.0, -0.0, 3e-39, -1.7e-5, 9.5])
    g = torch.Generator().manual_seed(4)

    def row(width: int, head: torch.Tensor = five) -> torch.Tensor:
        x = torch.randn(width, generator=g) * 2
        x[0:5], x[16:21] = head, head
        return x

    def same(out: torch.Tensor) -> None:
        a, b = out[..., 0:5].contiguous(), out[..., 16:21].contiguous()
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(a.view(bits), b.view(bits)), (a, b)

    x = torch.stack([row(21) for _ in range(3)]).to(dtype)
    weight = row(21).to(dtype)
    same(kernels.rms_norm(x, weight, 1e-6)[0])
    residual = torch.stack([row(21) for _ in range(3)]).to(dtype)
    out, new_residual = kernels.rms_norm(x, weight, 1e-6, residual)
    same(out), same(new_residual)
    gate_up = torch.cat([torch.stack([row(21) for _ in range(3)]) * 4, torch.stack([row(21) for _ in range(3)])], 1)
    same(kernels.silu_and_mul(gate_up.to(dtype)))
    # rotary: half = 21, so each half of a head is a vector and a tail; cos and sin the same way,
    # with signs that make x1 * cos - x2 * sin a sum of two signed zeros at 0 and 1
    q, k = (torch.stack([torch.cat([row(21), row(21)]) for _ in range(h)])[None].to(dtype) for h in (2, 1))
    cos_five, sin_five = torch.tensor([-0.6, -0.6, 0.8, 1.0, -1.0]), torch.tensor([0.8, 0.8, -0.6, 1e-3, 0.5])
    cos = torch.cat([row(21, cos_five), row(21, cos_five)])[None].to(dtype)
    sin = torch.cat([row(21, sin_five), row(21, sin_five)])[None].to(dtype)
    kernels.apply_rotary(q, k, cos, sin)
    for t in (q, k):
        same(t[..., :21]), same(t[..., 21:])


def _decode_meta(seq_lens, block_size, num_blocks, gen):
    """A decode-only batch over random, non-contiguous blocks."""
    tables, free = [], torch.randperm(num_blocks, generator=gen).tolist()
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append([free.pop() for _ in range(need)])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return AttentionMetadata(
        backend=TorchAttentionBackend(),
        num_decodes=len(seq_lens),
        query_start_loc=list(range(len(seq_lens) + 1)),
        seq_lens=list(seq_lens),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long),
        block_size=block_size,
    )


class _Layer:
    def __init__(self, hq, hkv, d, window, kv_cache):
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.scale, self.sliding_window = d**-0.5, window
        self.kv_cache, self.kv_scales = kv_cache, None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,window", [(4, 4, 16, None), (9, 3, 64, None), (8, 2, 32, 7), (4, 2, 128, 40)])
def test_decode_attention_matches_torch_reference(ops, dtype, hq, hkv, d, window):
    gen = torch.Generator().manual_seed(hq * d)
    bs, num_blocks = 16, 40
    seq_lens = [1, 16, 17, 45, 130]
    cache = torch.randn(2, hkv, num_blocks, bs, d, generator=gen).to(dtype)
    layer = _Layer(hq, hkv, d, window, cache)
    meta = _decode_meta(seq_lens, bs, num_blocks, gen)
    # q as the model hands it over: a view into the fused qkv rows, with one more (prefill) row after
    # the decodes that the kernel must leave alone.
    B = len(seq_lens)
    qkv = torch.randn(B + 1, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q = qkv[:, : hq * d].view(B + 1, hq, d)
    assert kernels.paged_kv_supported(q, cache, None)
    out = torch.full_like(q, 7.0).contiguous()
    kernels.decode_attention(out, q, cache, meta.block_tables, meta.seq_lens_tensor, B, layer.scale, window)
    assert (out[B] == 7.0).all()
    out, ref = out[:B], _decode(layer, q[:B], meta)
    # In 16-bit dtypes the reference rounds its scores and probabilities to the dtype; the kernel
    # keeps them in float32.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


PREFILL_SHAPES = [(4, 4, 16, None), (9, 3, 64, None), (8, 2, 80, None), (4, 2, 128, 40), (6, 1, 64, 7)]


@pytest.fixture(params=["vector", "brgemm"])
def prompt_path(request, ops):
    """Prompt attention's products in its own vector loops, then through oneDNN's block kernels
    (float32; bfloat16 pairs where bfloat16 is native: on AMX tiles on a CPU with AMX), whatever
    the build chose."""
    brgemm = request.param == "brgemm"
    old = kernels.set_prompt_attention_brgemm(brgemm, brgemm)
    yield request.param
    kernels.set_prompt_attention_brgemm(*old)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,window", PREFILL_SHAPES)
def test_prefill_attention_matches_torch_reference(ops, prompt_path, dtype, hq, hkv, d, window):
    """A step of two decodes (left alone) and prompts with and without cached context (chunked
    prefill, prefix hits): lengths around the kernel's tiles of 64 query tokens and 32 keys (64
    keys and 64 rows in the block kernels: 70 and 150 query tokens, 160 keys)."""
    from splitserve.executor.attention.torch_ref import write_kv

    gen = torch.Generator().manual_seed(hq * d + (window or 0))
    bs, num_blocks = 16, 64
    q_lens = [1, 1, 1, 5, 37, 13, 16, 70, 150]
    seq_lens = [9, 40, 1, 5, 37, 33, 64, 70, 160]  # cached context = seq_len - q_len
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in seq_lens]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    slots = [t[p // bs] * bs + p % bs for t, n, ql in zip(tables, seq_lens, q_lens) for p in range(n - ql, n)]
    T = starts[-1]
    meta = AttentionMetadata(
        backend=TorchAttentionBackend(),
        num_decodes=2,
        query_start_loc=starts,
        seq_lens=seq_lens,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots),
        block_size=bs,
    )
    cache = torch.randn(2, hkv, num_blocks, bs, d, generator=gen).to(dtype)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=gen).to(dtype)  # strided views, as the model's
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(T, hkv, d)
    write_kv(cache[0], cache[1], k, v, meta.slot_mapping)
    layer = _Layer(hq, hkv, d, window, cache)
    ref = torch.zeros(T, hq, d, dtype=dtype)
    TorchAttentionBackend().prefill(layer, q, k, v, meta, ref)
    out = torch.full((T, hq, d), 7.0, dtype=dtype)
    kernels.prefill_attention(
        out, q, cache, block_tables, meta.seq_lens_tensor, torch.tensor(starts), 2, layer.scale, window
    )
    assert (out[:2] == 7.0).all()
    # In 16-bit dtypes the reference rounds its scores and probabilities to the dtype at other points.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[2:].float(), ref[2:].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_torch_reference(ops, dtype):
    from splitserve.executor.attention.torch_ref import write_kv

    gen = torch.Generator().manual_seed(9)
    hkv, d, bs, blocks, T = 3, 64, 16, 10, 21
    qkv = torch.randn(T, 5 * hkv * d, generator=gen).to(dtype)  # k and v as strided views, like the model's
    k, v = qkv[:, hkv * d : 2 * hkv * d].view(T, hkv, d), qkv[:, 2 * hkv * d : 3 * hkv * d].view(T, hkv, d)
    slots = torch.randperm(blocks * bs, generator=gen)[:T]
    ref = torch.zeros(2, hkv, blocks, bs, d, dtype=dtype)
    write_kv(ref[0], ref[1], k, v, slots)
    cache = torch.zeros_like(ref)
    kernels.write_kv(cache, k, v, slots)
    torch.testing.assert_close(cache, ref, atol=0, rtol=0)


def test_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CPU_KERNELS", "0")
    monkeypatch.setitem(kernels._state, "ops", kernels._build())
    assert kernels.cpu_ops() is None
    x = torch.randn(3, 8)
    out, _ = kernels.rms_norm(x, torch.ones(8), 1e-6)  # the torch path
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_cpu_backend_matches_torch_backend_on_a_mixed_batch(ops, kv_dtype):
    """Decodes through the kernel (an int8 cache keeps the reference's decode), a prefill chunk
    with cached context through the shared reference code; the caches they leave are equal."""
    from splitserve.executor.attention.cpu_backend import CPUAttentionBackend
    from splitserve.quantization.kv_cache import SCALE_DTYPE, kv_cache_spec

    hq, hkv, d, bs, num_blocks = 6, 2, 32, 16, 24
    spec = kv_cache_spec(kv_dtype, torch.float32)
    seq_lens, q_lens = [20, 33, 40], [1, 1, 8]  # two decodes, then 8 new tokens after 32 cached
    tables = [[3, 7, 0], [1, 9, 4], [11, 2, 15]]  # padded rows, as the model runner pads them
    slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables[:2], seq_lens[:2])]
    slots += [tables[2][p // bs] * bs + p % bs for p in range(32, 40)]
    T = sum(q_lens)
    results = []
    for backend in (TorchAttentionBackend(), CPUAttentionBackend()):
        cache = torch.randn(2, hkv, num_blocks, bs, d, generator=torch.Generator().manual_seed(4))
        layer = _Layer(hq, hkv, d, None, cache.to(spec.storage_dtype) if spec.quantized else cache)
        if spec.quantized:
            layer.kv_scales = torch.rand(
                2, hkv, num_blocks, bs, 1, dtype=SCALE_DTYPE, generator=torch.Generator().manual_seed(6)
            )
        meta = AttentionMetadata(
            backend=backend,
            num_decodes=2,
            query_start_loc=[0, 1, 2, 10],
            seq_lens=seq_lens,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            slot_mapping=torch.tensor(slots),
            block_size=bs,
        )
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(T, h, d, generator=g) for h in (hq, hkv, hkv))
        results.append((backend.forward(layer, q, k, v, meta), layer.kv_cache))
    (ref, ref_cache), (out, out_cache) = results
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_cache, ref_cache, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sampling_matches_the_torch_sampler(ops, monkeypatch, dtype):
    """Same uniforms (global RNG reseeded), same tokens: greedy rows exactly, sampled rows except
    where a uniform lands within rounding of a boundary of the cumulative distribution."""
    from splitserve.executor.sampler import Sampler, SamplingMetadata

    logits = (torch.randn(256, 1000, generator=torch.Generator().manual_seed(7)) * 3).to(dtype)
    temps = torch.tensor([0.0, 0.5, 1.0, 1.7] * 64)
    meta = SamplingMetadata(temperature=temps, all_greedy=False)
    torch.manual_seed(11)
    fused_out = Sampler()(logits, meta)
    monkeypatch.setitem(kernels._state, "ops", None)
    torch.manual_seed(11)
    reference_out = Sampler()(logits, meta)
    fused, reference = fused_out.token_ids, reference_out.token_ids
    greedy = temps == 0
    assert torch.equal(fused[greedy], reference[greedy])
    assert (fused == reference).float().mean() >= 0.98
    # Each token's logprob under the raw logits, whatever the temperature (cumulative_logprob's terms).
    expected = torch.log_softmax(logits.float(), -1).gather(-1, fused[:, None]).squeeze(1)
    torch.testing.assert_close(fused_out.sampled_logprobs, expected, atol=2e-4, rtol=1e-4)
    same = fused == reference
    torch.testing.assert_close(reference_out.sampled_logprobs[same], expected[same], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_greedy_takes_the_first_maximum(ops, dtype):
    """The row maximum comes from a vectorised pass and its position from a scan: ties, banned
    (-inf) tokens and a maximum in the last column give torch.argmax's first index."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 49152, generator=g).to(dtype)
    logits[0, [7, 300, 49000]] = 9.0  # ties
    logits[1, :] = float("-inf")
    logits[1, [12345, 40000]] = -2.0
    logits[2, -1] = 50.0
    logits[3, 0] = 50.0
    logits[4] = logits[4].round()  # many ties in bfloat16 and float32
    tokens, logprobs = kernels.sample(logits, torch.zeros(6), torch.rand(6, generator=g))
    assert tokens.tolist() == logits.float().argmax(-1).tolist()
    expected = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected, atol=2e-4, rtol=1e-4)


def test_fused_sampling_follows_the_distribution(ops):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    logits = probs.log().expand(20000, 5).contiguous()  # the last token can never be drawn
    tokens, _ = kernels.sample(logits, torch.ones(20000), torch.rand(20000, generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(tokens, minlength=5).float() / 20000
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


@pytest.mark.parametrize("temperature", [1e30, float("inf")])
def test_sampling_at_an_enormous_temperature_never_picks_a_banned_token(ops, monkeypatch, temperature):
    """Found by schemathesis: temperature 1.5e308 (inf in float32) made banned (-inf) tokens NaN, and
    a guided request sampled a token outside its grammar. Both samplers keep banned tokens out."""
    from splitserve.executor.sampler import Sampler, SamplingMetadata

    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(3))
    logits[:, ::2] = float("-inf")  # the even tokens are banned
    meta = SamplingMetadata(temperature=torch.full((64,), temperature), all_greedy=False)
    for fused in (True, False):
        if not fused:
            monkeypatch.setitem(kernels._state, "ops", None)
        out = Sampler()(logits, meta)
        assert torch.all(out.token_ids % 2 == 1), fused
        assert torch.all(torch.isfinite(out.sampled_logprobs)), fused


@pytest.mark.slow  # rebuilds the kernels and reruns this module in a subprocess
@pytest.mark.heavy
@pytest.mark.skipif(
    cpu_features.requested_isa() == "avx2" or cpu_features.isa() != "avx512",
    reason="this run is the AVX2 build already (or the machine has no AVX-512 to leave out)",
)
def test_the_avx2_build_passes_these_tests_too():
    """On an AVX-512 machine, the same tests again with the kernels built without AVX-512, so that
    the AVX2 code paths (the ones AVX2-only machines run) are tested wherever the suite runs."""
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


def test_kernels_are_built_for_the_isa_asked_for(ops):
    flags = cpu_features.cpu_flags()
    if cpu_features.requested_isa() == "avx2":
        assert cpu_features.isa() in ("avx2", "generic") and not cpu_features.native_bf16()
    elif {"avx512f", "avx512bw", "avx512vl"} <= flags:
        assert cpu_features.isa() == "avx512"
    assert cpu_features.native_bf16() == (cpu_features.isa() == "avx512" and bool({"avx512_bf16", "amx_bf16"} & flags))


@pytest.mark.parametrize(
    "flags,setting,granted,expected",
    [
        ({"avx512_bf16", "amx_bf16", "amx_tile"}, "auto", True, (True, True, "on AMX tiles")),
        ({"avx512_bf16", "amx_bf16", "amx_tile"}, "auto", False, (True, False, "Linux did not grant AMX")),
        ({"avx512_bf16", "amx_bf16", "amx_tile"}, "0", True, (False, False, "SPLITSERVE_CPU_ATTENTION_BRGEMM=0")),
        ({"avx512_bf16"}, "auto", False, (True, False, "no AMX on this CPU")),
        ({"avx512_bf16"}, "1", False, (True, True, "no AMX here: bfloat16 in oneDNN's AVX512-BF16 code")),
        (set(), "1", False, (True, False, "no native bfloat16")),
        (None, "auto", False, (False, False, "no AVX2")),
    ],
)
def test_prompt_attention_takes_onednn_block_kernels_for_float32_and_where_the_cpu_has_amx(
    monkeypatch, flags, setting, granted, expected
):
    import torch._C._cpu as torch_cpu

    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}
    listed = frozenset() if flags is None else frozenset(avx512 | flags)  # None: a CPU without AVX2
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: listed)
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch_cpu, "_init_amx", lambda: granted)
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", "native")
    monkeypatch.setenv("SPLITSERVE_CPU_ATTENTION_BRGEMM", setting)
    float32, bfloat16, why = cpu_features.brgemm_attention()
    assert (float32, bfloat16) == expected[:2] and expected[2] in why, (float32, bfloat16, why)


def test_a_built_library_is_loaded_again_only_while_it_is_the_same(ops, tmp_path):
    """Later starts load the library a previous one built without torch's build machinery, but only
    while it is the file that was built from these sources and flags."""
    flags = ["-O3", "-march=native"]
    assert kernels._stamp_path("splitserve_cpu_ops", flags) != kernels._stamp_path("splitserve_cpu_ops", flags[:1])
    library = tmp_path / "lib.so"
    library.write_bytes(b"not a library")
    stamp = tmp_path / "stamp"
    stamp.write_text(f"{library}\n{kernels._identity(str(library))}\n")
    os.utime(library, ns=(0, 10**9))  # rebuilt since the stamp was written
    assert not kernels._load_built(str(stamp))
    assert not kernels._load_built(str(tmp_path / "missing"))
    stamp.write_text(f"{tmp_path / 'gone.so'}\n1 2\n")
    assert not kernels._load_built(str(stamp))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_takes_every_16_bit_gate(ops, dtype):
    """16-bit gates take their rounded SiLU from a table of all 65536 values (elementwise.cpp),
    gathered a vector at a time: every bit pattern, up = 1 (a product that rounds to itself), against
    torch's float32 SiLU rounded once. The kernel's exp may differ from torch's in the last float32
    bit, which can flip a rounding: at most one unit in the last place, for very few values; past
    |gate| = 80 its exp saturates (cpu_simd.h), where SiLU is 0 or the gate itself. A row of 65536
    is whole vectors; a second row of 65536 + 5 runs the scalar tail over the first five patterns."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    for g in (gate, torch.cat([gate, gate[:5]])):
        out = kernels.silu_and_mul(torch.cat([g, torch.ones_like(g)])[None])[0]
        ref = torch.nn.functional.silu(g.float()).to(dtype)
        assert torch.equal(out.isnan(), ref.isnan())
        ordinary = g.abs() < 80
        got, want = out[ordinary].view(torch.int16).int(), ref[ordinary].view(torch.int16).int()
        differ = got != want
        assert differ.float().mean() < 1e-3, differ.sum()
        assert ((got - want).abs()[differ] <= 1).all()
        saturated = ~ordinary & ~g.isnan()
        torch.testing.assert_close(out[saturated].float(), ref[saturated].float(), atol=1e-30, rtol=0, equal_nan=True)
