"""CPU matmul rows padded to bounded sizes (splitserve/kernels/row_buckets.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import row_buckets


def test_buckets_are_few_and_close_above():
    sizes = {row_bucket for row_bucket in map(row_buckets.row_bucket, range(1, 4097))}
    assert len(sizes) == 79
    assert row_buckets.row_bucket(2049) == 2064 and row_buckets.row_bucket(2065) == 2080  # a budget's tail
    for m in range(1, 5000):
        bucket = row_buckets.row_bucket(m)
        assert bucket >= m and row_buckets.row_bucket(bucket) == bucket
        assert bucket == m if m <= 16 else bucket - m < max(16, m / 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_pads_only_what_onednn_multiplies(dtype, monkeypatch):
    shapes = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: shapes.append(tuple(x.shape)) or real_linear(x, w, b))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 100, 64, generator=generator).to(dtype)
    weight, bias = torch.randn(48, 64, generator=generator).to(dtype), torch.randn(48).to(dtype)
    y = row_buckets.linear(x, weight, bias)
    assert y.shape == (3, 100, 48)
    torch.testing.assert_close(y, real_linear(x, weight, bias))
    assert shapes == ([(320, 64)] if dtype == torch.bfloat16 else [(3, 100, 64)])


def test_padded_rows_and_the_switch(monkeypatch):
    x = torch.ones(17, 8, dtype=torch.int8)
    padded = row_buckets.padded_rows(x)
    assert padded.shape == (32, 8) and torch.equal(padded[:17], x) and not padded[17:].any()
    assert row_buckets.padded_rows(x[:16]) is not None and row_buckets.padded_rows(x[:16]).shape == (16, 8)
    assert row_buckets.padded_rows(x.float()).shape == (17, 8)  # float32 goes through MKL: no cache
    monkeypatch.setattr(row_buckets, "ENABLED", False)  # SPLITSERVE_CPU_ROW_BUCKETS=0
    assert row_buckets.padded_rows(x) is x
