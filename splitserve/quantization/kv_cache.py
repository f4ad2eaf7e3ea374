"""The quantized KV cache (`--kv-cache-dtype`): how a layer's cache stores each cached vector, and
the quantize / dequantize functions the attention backend calls when it writes and reads blocks.

A cached vector is one token's K (or V) in one KV head: head_dim values. Each gets its own scale
(per token, per KV head), computed when it is written: no calibration is needed, and a token with
large activations (an attention sink, an outlier) costs precision only to itself, so long contexts
stay as accurate as short ones.

- int8: symmetric, s = absmax / 127, q = round(x / s) in -127..127;                x ~ q * s.
- fp8_e4m3 / fp8_e5m2: s = absmax / finfo.max, q = x / s rounded to float8, so the largest
  value lands on the format's largest finite one;                                    x ~ q * s.
- int4: asymmetric, s = (max - min) / 15, levels q = round((x - min) / s) in 0..15;  x ~ q * s + min.
  The zero point is kept as the value of level 0 (min) rather than as an integer level, so that
  dequantizing is one multiply-add. Two levels share a byte along head_dim: element i in the low
  nibble, element i + head_dim / 2 in the high one, so that unpacking writes two contiguous
  halves instead of interleaving (a quarter of the time on CPU).

Scales (and int4's min) are float32: float16 would flush fp8_e5m2's scales (absmax / 57344) to
subnormals for ordinary activations and lose their precision, and they cost little next to the
data (one or two fields per head_dim values).

Each quantized format has its own storage dtype (int8, float8_e4m3fn, float8_e5m2, uint8), so
the functions below are told the format by the dtype of the tensor they store into or read from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.config import KV_CACHE_DTYPES

SCALE_DTYPE = torch.float32
_TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero vector: 0 / tiny is 0
_INT4_MAX = 15
# The largest level of each symmetric format: its absmax maps there.
_SYMMETRIC_MAX = {
    torch.int8: 127.0,
    torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,
    torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max,
}


@dataclass(frozen=True)
class KVCacheSpec:
    """How one cached vector of head_dim values is stored: data [packed_head_dim] in
    storage_dtype plus num_scale_fields float32 fields (0: unquantized; 1: scale; 2: scale, min)."""

    name: str  # the canonical --kv-cache-dtype: auto, int8, fp8_e4m3, fp8_e5m2, int4
    storage_dtype: torch.dtype
    values_per_element: int = 1  # int4 packs two values into one uint8
    num_scale_fields: int = 0

    @property
    def quantized(self) -> bool:
        return self.num_scale_fields > 0

    @property
    def element_size(self) -> int:
        return self.storage_dtype.itemsize

    def packed_head_dim(self, head_dim: int) -> int:
        if head_dim % self.values_per_element:
            raise ValueError(
                f"kv_cache_dtype={self.name!r} packs {self.values_per_element} values per byte and "
                f"needs a head_dim divisible by that; this model's is {head_dim}."
            )
        return head_dim // self.values_per_element

    def bytes_per_vector(self, head_dim: int) -> int:
        """Bytes one token's K (or V) in one KV head takes, scales included."""
        return self.packed_head_dim(head_dim) * self.element_size + self.num_scale_fields * SCALE_DTYPE.itemsize

    def describe(self) -> str:
        """For the KV cache log line: 'bfloat16', 'int8 + float32 scales', ..."""
        if not self.quantized:
            return str(self.storage_dtype).removeprefix("torch.")
        return f"{self.name} + float32 {'scales' if self.num_scale_fields == 1 else 'scales and mins'}"


_QUANTIZED_SPECS = {
    "int8": KVCacheSpec("int8", torch.int8, num_scale_fields=1),
    "fp8_e4m3": KVCacheSpec("fp8_e4m3", torch.float8_e4m3fn, num_scale_fields=1),
    "fp8_e5m2": KVCacheSpec("fp8_e5m2", torch.float8_e5m2, num_scale_fields=1),
    "int4": KVCacheSpec("int4", torch.uint8, values_per_element=2, num_scale_fields=2),
}
_ALIASES = {"fp8": "fp8_e4m3"}  # as in vLLM


def kv_cache_spec(cache_dtype: str, model_dtype: torch.dtype) -> KVCacheSpec:
    """The spec of a --kv-cache-dtype; 'auto' stores the model's dtype unquantized."""
    if cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {cache_dtype!r}.")
    if cache_dtype == "auto":
        return KVCacheSpec("auto", model_dtype)
    return _QUANTIZED_SPECS[_ALIASES.get(cache_dtype, cache_dtype)]


# --- quantize / dequantize ---------------------------------------------------------------------
def quantize_kv(x: torch.Tensor, storage_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (data [..., packed_head_dim] in storage_dtype, scales [..., fields] float32)."""
    x = x.to(SCALE_DTYPE)
    if storage_dtype == torch.uint8:
        return _quantize_int4(x)
    qmax = _SYMMETRIC_MAX[storage_dtype]
    scale = (x.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=_TINY)
    q = x / scale
    if storage_dtype == torch.int8:
        q = q.round_()
    # x / s can exceed qmax by a rounding error: e4m3fn has no infinity and would give NaN.
    return q.clamp_(-qmax, qmax).to(storage_dtype), scale


def _quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / _INT4_MAX).clamp(min=_TINY)
    levels = ((x - lo) / scale).round_().clamp_(0, _INT4_MAX).to(torch.uint8)
    return pack_int4(levels), torch.cat((scale, lo), dim=-1)


def dequantize_kv(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(data [..., packed_head_dim], scales [..., fields]) -> [..., head_dim] in dtype, computed in
    float32 and rounded once."""
    x = stored_values(data, SCALE_DTYPE).mul_(scales[..., :1])
    if data.dtype == torch.uint8:
        x.add_(scales[..., 1:])
    return x.to(dtype)


def stored_values(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What data stores before its scale is applied, exactly, as dtype (bfloat16, float16 or
    float32 hold every int8 / int4 level and fp8 value): x = values * scale (+ min for int4).
    Decode attention takes these and applies the per-token scales to its scores and probabilities,
    head_dim times fewer multiplies than dequantizing every element."""
    if data.dtype == torch.uint8:
        half = data.shape[-1]
        out = torch.empty(*data.shape[:-1], 2 * half, dtype=dtype, device=data.device)
        out[..., :half] = data & 0xF
        out[..., half:] = data >> 4
        return out
    if data.dtype in FP8_AS_BFLOAT16:
        return fp8_as_bfloat16(data).to(dtype)
    return data.to(dtype)


# fp8 dtype -> (left shift, mask, power of two) that turn its bits into a bfloat16 of the same
# value: the sign goes to bit 15, exponent and mantissa to the top of bfloat16's, which reads them
# with bias 127 instead of 7 (e4m3) or 15 (e5m2), subnormals included; 2^(127 - bias) restores it.
FP8_AS_BFLOAT16 = {
    torch.float8_e4m3fn: (4, 0x87F0 - 0x10000, 2.0**120),
    torch.float8_e5m2: (5, 0x8FE0 - 0x10000, 2.0**112),
}


def fp8_as_bfloat16(data: torch.Tensor) -> torch.Tensor:
    """The exact values of fp8 data as bfloat16, by moving bits: CPU casts from float8 are scalar
    code, five times slower than these four vectorized passes (which work on any device). Never
    fed NaN or inf: quantize_kv stores neither. The int8 view sign-extends; the mask drops that."""
    shift, mask, power = FP8_AS_BFLOAT16[data.dtype]
    bits = data.view(torch.int8).to(torch.int16)
    bits.bitwise_left_shift_(shift).bitwise_and_(mask)
    return bits.view(torch.bfloat16).mul_(power)  # times a power of two: exact


def pack_int4(levels: torch.Tensor) -> torch.Tensor:
    """[..., 2n] levels 0..15 -> [..., n] uint8: element i in the low nibble, i + n in the high one."""
    levels = levels.to(torch.uint8)
    half = levels.shape[-1] // 2
    return levels[..., :half] | (levels[..., half:] << 4)
