"""The Triton attention backend against the torch reference on the same caches and batches, and
the backend selection rules. Without CUDA the kernels run in Triton's CPU interpreter (slow:
shapes are small and cases few); bfloat16 runs only on CUDA (the interpreter mangles it)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Read when a kernel is defined, i.e. when triton_attn is imported below.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from splitserve.executor.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from splitserve.executor.attention.cpu_backend import CPUAttentionBackend  # noqa: E402
from splitserve.executor.attention.torch_ref import (  # noqa: E402
    TorchAttentionBackend,
    write_kv,
    write_quantized_kv,
)
from splitserve.executor.attention.triton_attn import TritonAttentionBackend  # noqa: E402
from splitserve.executor.attention.triton_decode import num_decode_splits  # noqa: E402
from splitserve.layers.attention import Attention  # noqa: E402
from splitserve.quantization.kv_cache import SCALE_DTYPE, kv_cache_spec  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_BLOCKS = 112
KV_HEADS = 2
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (seq_len, query_len) per request, decodes first.
DECODES = [(1, 1), (17, 1), (40, 1), (800, 1)]  # 800: several splits (see test_decode_only)
FRESH, PREFIX_HIT, MIDDLE_CHUNK = (37, 37), (52, 20), (63, 40)  # context 0, 32 (whole blocks), 23
LONG_PROMPT, LONG_CHUNK = (150, 150), (230, 130)  # several query tiles; context 0 and 100
PREFILLS = [FRESH, PREFIX_HIT, MIDDLE_CHUNK, LONG_PROMPT, LONG_CHUNK]
MIXED = DECODES[1:3] + [LONG_PROMPT, PREFIX_HIT, MIDDLE_CHUNK, LONG_CHUNK]


def _layer(
    group: int, head_dim: int, dtype: torch.dtype, window: int | None, cache_dtype: str, block_size: int
) -> Attention:
    layer = Attention(KV_HEADS * group, KV_HEADS, head_dim, head_dim**-0.5, window)
    spec = kv_cache_spec(cache_dtype, dtype)
    shape = (2, KV_HEADS, NUM_BLOCKS, block_size, head_dim)
    layer.kv_cache = torch.zeros(shape, dtype=spec.storage_dtype, device=DEVICE)
    if spec.quantized:
        layer.kv_scales = torch.zeros(*shape[:-1], spec.num_scale_fields, dtype=SCALE_DTYPE, device=DEVICE)
    return layer


def _step(layer: Attention, requests: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """Fill the cache with each request's context (seq_len - query_len tokens) through random,
    scattered block tables, and return the step's (q, k, v, meta) for the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    bs = layer.kv_cache.shape[3]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-seq_len // bs))] for seq_len, _ in requests]

    def slots(table, positions):
        return torch.tensor([table[p // bs] * bs + p % bs for p in positions], dtype=torch.long, device=DEVICE)

    for table, (seq_len, query_len) in zip(tables, requests):
        context = seq_len - query_len
        k, v, slot_mapping = (
            randn(context, KV_HEADS, layer.head_dim),
            randn(context, KV_HEADS, layer.head_dim),
            slots(table, range(context)),
        )
        if layer.kv_scales is None:
            write_kv(layer.kv_cache[0], layer.kv_cache[1], k, v, slot_mapping)
        else:
            write_quantized_kv(layer.kv_cache, layer.kv_scales, k, v, slot_mapping)
    tokens = sum(n for _, n in requests)
    q = randn(tokens, layer.num_heads, layer.head_dim)
    k, v = randn(tokens, KV_HEADS, layer.head_dim), randn(tokens, KV_HEADS, layer.head_dim)
    query_start_loc = [0]
    for _, n in requests:
        query_start_loc.append(query_start_loc[-1] + n)
    seq_lens = [s for s, _ in requests]
    width = max(map(len, tables))
    meta = AttentionMetadata(
        backend=None,
        num_decodes=sum(1 for _, n in requests if n == 1),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.cat([slots(t, range(s - n, s)) for t, (s, n) in zip(tables, requests)]),
        block_size=bs,
    )
    return q, k, v, meta


def _check(requests, dtype=torch.float32, group=2, head_dim=32, window=None, cache_dtype="auto", block_size=16):
    """Triton and torch outputs on the same step agree, and both leave the same cache behind."""
    layer = _layer(group, head_dim, dtype, window, cache_dtype, block_size)
    q, k, v, meta = _step(layer, requests, dtype)
    reference = _layer(group, head_dim, dtype, window, cache_dtype, block_size)
    reference.kv_cache.copy_(layer.kv_cache)
    if layer.kv_scales is not None:
        reference.kv_scales.copy_(layer.kv_scales)
    out = TritonAttentionBackend().forward(layer, q, k, v, meta)
    expected = TorchAttentionBackend().forward(reference, q, k, v, meta)
    assert out.dtype == dtype and out.shape == q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    assert torch.equal(layer.kv_cache.view(torch.uint8), reference.kv_cache.view(torch.uint8))


# --- kernels against the reference -------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,group,head_dim,window,block_size",
    [
        (torch.float32, 1, 16, None, 16),
        (torch.float16, 4, 64, None, 16),
        (torch.float32, 2, 32, 100, 16),
        (torch.float32, 8, 128, None, 128),  # blocks longer than a tile of keys
    ],
)
def test_decode_only(dtype, group, head_dim, window, block_size):
    if window is None:  # the 800-token request really splits, and the others get empty splits
        assert num_decode_splits(800, len(DECODES) * KV_HEADS, 132) == 3
    _check(DECODES, dtype, group, head_dim, window, block_size=block_size)


@pytest.mark.parametrize(
    "dtype,group,head_dim,window,block_size",
    [
        (torch.float32, 2, 16, None, 16),
        (torch.float16, 1, 32, None, 32),
        (torch.float32, 4, 64, 48, 16),
    ],
)
def test_prefill_only(dtype, group, head_dim, window, block_size):
    _check(PREFILLS, dtype, group, head_dim, window, block_size=block_size)


@pytest.mark.parametrize(
    "dtype,group,head_dim,window",
    [
        (torch.float32, 4, 32, None),
        (torch.float16, 2, 64, 24),
        (torch.float32, 1, 48, 20),  # head_dim padded to 64 with masks
        (torch.float16, 2, 256, None),
    ],
)
def test_mixed_batch(dtype, group, head_dim, window):
    _check(MIXED, dtype, group, head_dim, window)


@pytest.mark.parametrize(
    "cache_dtype,dtype,window",
    [
        ("int8", torch.float16, None),
        ("fp8_e4m3", torch.float32, None),
        ("fp8_e5m2", torch.float32, 24),
        # float16 overflowed q . x' (values up to 57344) and rounded p s (s ~ 1e-5) to few bits
        ("fp8_e5m2", torch.float16, None),
    ],
)
def test_quantized_cache(cache_dtype, dtype, window):
    if cache_dtype == "fp8_e4m3" and DEVICE.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton has float8 e4m3 only from compute capability 8.9")
    _check(MIXED, dtype, 2, 32, window, cache_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 is garbage in Triton's CPU interpreter")
@pytest.mark.parametrize("cache_dtype,window", [("auto", None), ("auto", 24), ("int8", None)])
def test_bfloat16(cache_dtype, window):
    _check(DECODES + PREFILLS, torch.bfloat16, 4, 128, window, cache_dtype)


def test_step_tensors_are_built_once():
    layer = _layer(2, 16, torch.float32, None, "auto", 16)
    q, k, v, meta = _step(layer, [(5, 1), FRESH], torch.float32)
    backend = TritonAttentionBackend()
    first = backend.forward(layer, q, k, v, meta)
    built = dict(meta.scratch)
    assert built
    second = backend.forward(layer, q, k, v, meta)  # the next layer of the same step
    assert all(meta.scratch[key] is tensor for key, tensor in built.items()) and len(meta.scratch) == len(built)
    torch.testing.assert_close(first, second)


def test_int4_cache_is_refused():
    layer = _layer(2, 16, torch.float32, None, "int4", 16)
    q, k, v = torch.zeros(1, 4, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16)
    meta = AttentionMetadata(
        None,
        1,
        [0, 1],
        [1],
        torch.ones(1, dtype=torch.int32, device=DEVICE),
        torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
        torch.zeros(1, dtype=torch.long, device=DEVICE),
        16,
    )
    with pytest.raises(ValueError, match="int4"):
        TritonAttentionBackend().forward(layer, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), meta)


def test_num_decode_splits():
    assert num_decode_splits(100, 4, 132) == 1  # short: one split whatever the batch
    assert num_decode_splits(100_000, 2, 132) == 32  # capped
    assert num_decode_splits(4096, 8, 132) == 16  # 8 * 16 programs fill 132 SMs
    assert num_decode_splits(4096, 256, 132) == 1  # the batch fills them alone


# --- selection ---------------------------------------------------------------------------------
@pytest.fixture
def no_backend_env(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_ATTENTION_BACKEND", raising=False)
    return monkeypatch


def test_default_backend_per_device(no_backend_env, caplog):
    assert isinstance(get_attention_backend(torch.device("cpu")), CPUAttentionBackend)
    assert isinstance(get_attention_backend(torch.device("cuda")), TritonAttentionBackend)
    with caplog.at_level("INFO", logger="splitserve.executor.attention.selector"):
        assert isinstance(get_attention_backend(torch.device("cuda"), "int4"), TorchAttentionBackend)
    assert "int4" in caplog.text


def test_fp8_e4m3_needs_sm89(no_backend_env):
    no_backend_env.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert isinstance(get_attention_backend(torch.device("cuda"), "fp8_e4m3"), TorchAttentionBackend)
    assert isinstance(get_attention_backend(torch.device("cuda"), "fp8_e5m2"), TritonAttentionBackend)
    no_backend_env.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert isinstance(get_attention_backend(torch.device("cuda"), "fp8"), TritonAttentionBackend)


def test_cuda_without_triton_gets_torch(no_backend_env, caplog):
    no_backend_env.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with caplog.at_level("INFO", logger="splitserve.executor.attention.selector"):
        assert isinstance(get_attention_backend(torch.device("cuda")), TorchAttentionBackend)
    assert "not installed" in caplog.text
    no_backend_env.setenv("SPLITSERVE_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match="not installed"):
        get_attention_backend(torch.device("cuda"))


def test_env_var_overrides(no_backend_env):
    no_backend_env.setenv("SPLITSERVE_ATTENTION_BACKEND", "torch")
    assert isinstance(get_attention_backend(torch.device("cuda")), TorchAttentionBackend)
    assert type(get_attention_backend(torch.device("cpu"))) is TorchAttentionBackend
    no_backend_env.setenv("SPLITSERVE_ATTENTION_BACKEND", "cpu")
    assert isinstance(get_attention_backend(torch.device("cpu")), CPUAttentionBackend)
    with pytest.raises(ValueError, match="CPU"):
        get_attention_backend(torch.device("cuda"))
    no_backend_env.setenv("SPLITSERVE_ATTENTION_BACKEND", "triton")
    no_backend_env.setenv("TRITON_INTERPRET", "1")
    assert isinstance(get_attention_backend(torch.device("cpu"), "int8"), TritonAttentionBackend)
    with pytest.raises(ValueError, match="int4"):
        get_attention_backend(torch.device("cuda"), "int4")
    no_backend_env.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        get_attention_backend(torch.device("cpu"))
    no_backend_env.setenv("SPLITSERVE_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="torch"):
        get_attention_backend(torch.device("cuda"))
