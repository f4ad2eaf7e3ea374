"""The quantized KV cache: round-trip error bounds of each format, int4 packing against a plain
reference, per-token scales over a long context of varied magnitudes, the attention backend
reading exactly the values it stored, and the PD connector moving quantized blocks and scales."""

from __future__ import annotations

import pytest
import torch

from splitserve.config import KV_CACHE_DTYPES, CacheConfig, KVTransferConfig
from splitserve.distributed.kv_transfer import transport as C
from splitserve.executor.attention.backend import AttentionMetadata
from splitserve.executor.attention.torch_ref import TorchAttentionBackend, write_kv, write_quantized_kv
from splitserve.layers.attention import Attention
from splitserve.quantization.kv_cache import dequantize_kv, kv_cache_spec, pack_int4, quantize_kv
from tests.helpers.kv_transfer import pull_params, pull_result

QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2", "int4"]


def _storage(name: str) -> torch.dtype:
    return kv_cache_spec(name, torch.float32).storage_dtype


def _roundtrip(x: torch.Tensor, name: str) -> torch.Tensor:
    return dequantize_kv(*quantize_kv(x, _storage(name)), torch.float32)


# --- specs and configuration ---------------------------------------------------------------------
def test_specs():
    assert kv_cache_spec("auto", torch.bfloat16).storage_dtype == torch.bfloat16
    assert not kv_cache_spec("auto", torch.bfloat16).quantized
    assert kv_cache_spec("fp8", torch.bfloat16) == kv_cache_spec("fp8_e4m3", torch.bfloat16)
    # head_dim 64: bfloat16 128 bytes; int8 / fp8 64 + a float32 scale; int4 32 + scale and min.
    sizes = {name: kv_cache_spec(name, torch.bfloat16).bytes_per_vector(64) for name in KV_CACHE_DTYPES}
    assert sizes == {"auto": 128, "int8": 68, "fp8": 68, "fp8_e4m3": 68, "fp8_e5m2": 68, "int4": 40}
    assert kv_cache_spec("int4", torch.bfloat16).packed_head_dim(64) == 32
    with pytest.raises(ValueError, match="head_dim"):
        kv_cache_spec("int4", torch.bfloat16).packed_head_dim(63)


def test_config_accepts_the_kv_cache_dtypes_and_names_them_otherwise():
    for name in KV_CACHE_DTYPES:
        CacheConfig(cache_dtype=name).verify()
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'int8', 'fp8'.*'fp16'"):
        CacheConfig(cache_dtype="fp16").verify()


# --- round trips -----------------------------------------------------------------------------------
def _vectors(seed: int = 0) -> torch.Tensor:
    """[tokens, heads, head_dim] with magnitudes that differ per token and per head."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10 ** (torch.rand(64, 4, 1, generator=gen) * 4 - 2)
    return torch.randn(64, 4, 32, generator=gen) * scale + torch.randn(64, 4, 1, generator=gen) * scale


def test_int8_error_is_at_most_half_a_step():
    x = _vectors()
    step = x.abs().amax(-1, keepdim=True) / 127
    data, scales = quantize_kv(x, torch.int8)
    assert data.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (64, 4, 1)
    assert data.abs().amax(-1).eq(127).all()  # each vector's absmax uses the whole range
    assert ((_roundtrip(x, "int8") - x).abs() <= step / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("name, mantissa_bits, min_exponent", [("fp8_e4m3", 3, -6), ("fp8_e5m2", 2, -14)])
def test_fp8_error_is_at_most_half_an_ulp(name, mantissa_bits, min_exponent):
    """Relative 2^-(m+1) for normal values; below the smallest normal, half the subnormal spacing."""
    x = _vectors(1)
    data, scales = quantize_kv(x, _storage(name))
    assert data.dtype == _storage(name)
    assert data.float().abs().amax(-1).eq(torch.finfo(data.dtype).max).all()  # absmax lands on the largest value
    error = (_roundtrip(x, name) - x).abs()
    bound = torch.maximum(x.abs() * 2.0 ** -(mantissa_bits + 1), scales * 2.0 ** (min_exponent - mantissa_bits - 1))
    assert (error <= bound * (1 + 1e-5)).all()


def test_int4_error_is_at_most_half_a_step():
    x = _vectors(2)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    data, scales = quantize_kv(x, torch.uint8)
    assert data.shape == (64, 4, 16) and scales.shape == (64, 4, 2)
    assert torch.equal(scales[..., 1:], lo)  # the min is stored as the zero point
    assert ((_roundtrip(x, "int4") - x).abs() <= (hi - lo) / 30 * (1 + 1e-5)).all()


@pytest.mark.parametrize("name", QUANTIZED)
def test_zero_and_extreme_vectors_stay_finite(name):
    x = torch.zeros(3, 2, 16)
    x[1] = 3e4  # beyond e4m3's range before scaling: x / s must be clamped, never NaN
    x[2, :, 0] = -1e-30
    out = _roundtrip(x, name)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], x[0])
    torch.testing.assert_close(out[1], x[1], rtol=0.1, atol=0)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_values_are_read_exactly(name):
    """dequantize_kv reads fp8 by moving bits rather than casting: check all 256 codes against the cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(_storage(name))
    codes = codes[torch.isfinite(codes.float())][None]  # one vector of every finite value
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_kv(codes, torch.ones(1, 1), dtype), codes.to(dtype))


def test_int4_packing_against_a_plain_reference():
    gen = torch.Generator().manual_seed(3)
    levels = torch.randint(0, 16, (5, 3, 8), generator=gen)
    packed = pack_int4(levels)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 4)
    for t in range(5):
        for h in range(3):
            for j in range(4):
                assert packed[t, h, j] == levels[t, h, j] + 16 * levels[t, h, j + 4]
    # Dequantizing, one element at a time: level * scale + min.
    x = torch.randn(5, 3, 8, generator=gen)
    data, scales = quantize_kv(x, torch.uint8)
    out = dequantize_kv(data, scales, torch.float32)
    for t in range(5):
        for h in range(3):
            scale, lo = scales[t, h].tolist()
            for i in range(8):
                byte = int(data[t, h, i % 4])
                level = byte & 0xF if i < 4 else byte >> 4
                assert out[t, h, i].item() == pytest.approx(level * scale + lo, rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("name, bound", [("int8", 0.025), ("fp8_e4m3", 0.05), ("fp8_e5m2", 0.1), ("int4", 0.25)])
def test_long_context_with_varied_magnitudes(name, bound):
    """4096 tokens whose magnitudes span six decades, with an outlier channel on some: every token
    keeps its relative accuracy, because each has its own scale (observed maxima: 0.019, 0.036,
    0.071, 0.18)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4096, 2, 64, generator=gen) * 10 ** (torch.rand(4096, 1, 1, generator=gen) * 6 - 3)
    x[::97, :, 5] *= 20
    relative = (_roundtrip(x, name) - x).norm(dim=-1) / x.norm(dim=-1)
    assert relative.max() < bound


# --- the attention backend reads exactly what it stored -------------------------------------------
BS, NUM_BLOCKS, HEADS, KV_HEADS, DIM = 4, 16, 4, 2, 16


def _layer(name: str, dtype: torch.dtype, sliding_window) -> Attention:
    spec = kv_cache_spec(name, dtype)
    layer = Attention(HEADS, KV_HEADS, DIM, DIM**-0.5, sliding_window)
    layer.kv_cache = torch.zeros(2, KV_HEADS, NUM_BLOCKS, BS, spec.packed_head_dim(DIM), dtype=spec.storage_dtype)
    layer.kv_scales = torch.zeros(2, KV_HEADS, NUM_BLOCKS, BS, spec.num_scale_fields) if spec.quantized else None
    return layer


@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("name", QUANTIZED)
def test_attention_reads_exactly_what_it_stored(name, sliding_window):
    """A step of three decodes and a prompt chunk over cached context, on a quantized cache, against
    the same step on an unquantized cache that holds the values the quantized one represents:
    equal up to float32 rounding (decode applies scales to scores and probabilities instead)."""
    gen = torch.Generator().manual_seed(5)
    tables = [[3, 7, 1], [0, 2, 9, 4], [5, 6], [8, 10, 11]]
    seq_lens, query_lens = [9, 14, 5, 12], [1, 1, 1, 5]
    quantized, reference = _layer(name, torch.float32, sliding_window), _layer("auto", torch.float32, sliding_window)

    def slots(table, positions):
        return torch.tensor([table[p // BS] * BS + p % BS for p in positions])

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    for table, seq_len, query_len in zip(tables, seq_lens, query_lens):  # the cached context
        context = seq_len - query_len
        k, v, slot_mapping = randn(context, KV_HEADS, DIM), randn(context, KV_HEADS, DIM), slots(table, range(context))
        write_quantized_kv(quantized.kv_cache, quantized.kv_scales, k, v, slot_mapping)
        write_kv(reference.kv_cache[0], reference.kv_cache[1], _roundtrip(k, name), _roundtrip(v, name), slot_mapping)
    tokens = sum(query_lens)
    q, k, v = randn(tokens, HEADS, DIM), randn(tokens, KV_HEADS, DIM), randn(tokens, KV_HEADS, DIM)
    slot_mapping = torch.cat([slots(t, range(n - m, n)) for t, n, m in zip(tables, seq_lens, query_lens)])
    width = max(map(len, tables))
    meta = AttentionMetadata(
        TorchAttentionBackend(),
        3,
        [0, 1, 2, 3, 8],
        seq_lens,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping,
        BS,
    )
    out = meta.backend.forward(quantized, q, k, v, meta)
    expected = meta.backend.forward(reference, q, _roundtrip(k, name), _roundtrip(v, name), meta)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# --- the PD connector -------------------------------------------------------------------------------
LAYERS = 2


def _quantized_cache(name: str, fill: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer (data, scales) of a cache, filled through the backend's own writers."""
    gen = torch.Generator().manual_seed(6)
    caches, scales = [], []
    for _ in range(LAYERS):
        layer = _layer(name, torch.float32, None)
        if fill:
            tokens = NUM_BLOCKS * BS
            k, v = torch.randn(tokens, KV_HEADS, DIM, generator=gen), torch.randn(tokens, KV_HEADS, DIM, generator=gen)
            if layer.kv_scales is None:
                write_kv(layer.kv_cache[0], layer.kv_cache[1], k, v, torch.arange(tokens))
            else:
                write_quantized_kv(layer.kv_cache, layer.kv_scales, k, v, torch.arange(tokens))
        caches.append(layer.kv_cache)
        scales.append(layer.kv_scales)
    return caches, scales


@pytest.fixture
def connectors():
    made = []

    def make(role: str, name: str, fill: bool) -> C.KVConnector:
        config = KVTransferConfig(role, "127.0.0.1", 0, lease_seconds=30)
        if name == "auto":
            connector = C.KVConnector(config, _quantized_cache("auto", fill)[0])
        else:
            connector = C.KVConnector(config, *_quantized_cache(name, fill), kv_cache_dtype=name)
        made.append(connector)
        return connector

    yield make
    for connector in made:
        connector.shutdown()


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_blocks_and_scales_arrive_intact(connectors, name):
    prefill, decode = connectors("prefill", name, True), connectors("decode", name, False)
    prefill.add_lease("p1", [5, 2, 7], num_pulls=1)
    decode.submit_pull("d1", pull_params(prefill), first_block=1, dest_block_ids=[0, 3])
    assert pull_result(decode).ok
    pairs = list(zip(prefill.kv_caches, decode.kv_caches)) + list(zip(prefill.kv_scales, decode.kv_scales))
    for src, dst in pairs:
        src, dst = src.view(torch.uint8), dst.view(torch.uint8)  # fp8 has no equality kernel on CPU
        assert torch.equal(dst[:, :, 0], src[:, :, 2]) and torch.equal(dst[:, :, 3], src[:, :, 7])
        assert torch.count_nonzero(dst[:, :, 1]) == 0
    spec = kv_cache_spec(name, torch.float32)
    assert decode.snapshot_stats().bytes_received == LAYERS * 2 * KV_HEADS * 2 * BS * spec.bytes_per_vector(DIM)


@pytest.mark.parametrize("prefill_dtype, decode_dtype", [("int8", "auto"), ("auto", "int8"), ("int8", "int4")])
def test_different_kv_cache_dtypes_are_refused(connectors, prefill_dtype, decode_dtype):
    prefill, decode = connectors("prefill", prefill_dtype, True), connectors("decode", decode_dtype, False)
    prefill.add_lease("p1", [1], num_pulls=1)
    decode.submit_pull("d1", pull_params(prefill), 0, [0])
    error = pull_result(decode).error
    assert f"KV cache is {prefill_dtype}, this instance's is {decode_dtype}" in error
    assert "same --kv-cache-dtype" in error
    assert torch.count_nonzero(decode.kv_caches[0].view(torch.uint8)) == 0
