"""The CPU KV cache's memory: mapped lazily (zero, and not resident, until written), and the
resident count that the engine reports as splitserve:kv_cache_resident_bytes."""

from __future__ import annotations

import torch

from splitserve.executor.kv_memory import kv_memory_use, kv_zeros


def test_cpu_cache_is_zero_and_becomes_resident_only_where_written():
    shape = (2, 3, 64, 16, 64)  # [2, heads, blocks, block_size, head_dim]: 3 MiB of bfloat16
    cache = kv_zeros(shape, torch.bfloat16, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    allocated, resident = kv_memory_use([cache])
    assert allocated == 2 * 3 * 64 * 16 * 64 * 2
    assert resident == 0
    cache[0, 0, :4] = 1.0  # the first four blocks of one head's keys
    _, resident = kv_memory_use([cache])
    assert 0 < resident < allocated // 2
    assert cache[0, 0, 4:].count_nonzero() == 0 and cache[1].count_nonzero() == 0
    assert cache.sum() == 4 * 16 * 64


def test_cpu_cache_outlives_its_mapping_object():
    cache = kv_zeros((4, 1024), torch.float32, torch.device("cpu"))
    view = cache[1:3]
    del cache
    view.fill_(2.0)
    assert view.sum() == 2 * 1024 * 2.0
