"""GGUF's 4-bit block types as the W4A16 kernel's operands, for CUDA (kernels/triton_int4.py).

Q4_0, Q4_1 and Q4_K hold, for every 32 weights, 4-bit levels and an affine map: Q4_0 w = d (q - 8);
Q4_1 w = d q + m; Q4_K, in super-blocks of 256, w = d sc_j q - dmin m_j for its eight sub-blocks
(6-bit sc_j and m_j). Each is (q - zero) * scale with scale and zero per 32 weights, so the levels
are kept exactly and the products need no dequantized copy: 4.5 to 5 bits per weight read per
token instead of 16. scale and zero are float32 (a Q4_1 zero, -m / d, is not a 16-bit number). A
block whose scale is 0 while its weights are not (its map has no (q - zero) * scale form) makes the
whole matrix unconvertible (None). Computed with torch ops on the weights' device at load.
"""

from __future__ import annotations

import torch

from splitserve.quantization.packing import Int4Weight

Q4_0, Q4_1, Q4_K = 2, 3, 12  # ggml type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q4_K: 144}
BLOCK_WEIGHTS = {Q4_0: 32, Q4_1: 32, Q4_K: 256}


def convertible(qtype: int) -> bool:
    return qtype in BLOCK_BYTES


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> [...] float32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] levels: the low nibbles are weights 0-15, the high ones 16-31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def to_int4(w: torch.Tensor, qtype: int, n: int, k: int) -> Int4Weight | None:
    """[N, row bytes] uint8 blocks of `qtype` -> Int4Weight (group 32, float32 scale and zero), or None."""
    blocks = w.view(n, k // BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype])
    if qtype == Q4_0:
        levels = _nibbles(blocks[..., 2:])
        scale = _f16(blocks[..., :2])
        zero = torch.full_like(scale, 8.0)
    elif qtype == Q4_1:
        levels = _nibbles(blocks[..., 4:])
        scale, minimum = _f16(blocks[..., :2]), _f16(blocks[..., 2:4])
        if bool(((scale == 0) & (minimum != 0)).any()):
            return None
        zero = torch.where(scale == 0, torch.zeros_like(scale), -minimum / scale)
    else:
        d, dmin = _f16(blocks[..., :2]), _f16(blocks[..., 2:4])
        sc, mn = _q4k_scales(blocks[..., 4:16])
        scale, offset = d[..., None] * sc, dmin[..., None] * mn  # [N, super-blocks, 8]
        if bool(((scale == 0) & (offset != 0)).any()):
            return None
        zero = torch.where(scale == 0, torch.zeros_like(scale), offset / scale)
        qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)
        levels = torch.cat([qs & 0xF, qs >> 4], dim=3)  # chunk c: sub-blocks 2c (low) and 2c + 1 (high)
    return Int4Weight(levels.reshape(n, k), scale.reshape(n, -1), zero.reshape(n, -1), 32)


def _q4k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of a Q4_K super-block -> its eight 6-bit scales and mins, float32 [..., 8]."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()
