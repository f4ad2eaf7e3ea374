"""Quantized weight formats: the reference quantizers, and packing to / unpacking from the
checkpoint layouts that the hub's AWQ and GPTQ models use.

Everything meets in one plain form, `Int4Weight`: integer levels q in [0, 15] of shape
[out, in], and per-group scale and integer zero point of shape [out, in // group_size], with
    w[o, i] = (q[o, i] - zero[o, g(i)]) * scale[o, g(i)],   g(i) = group of input channel i.
The checkpoint layouts are ways of packing that form into int32 words:

- AutoAWQ "gemm": qweight [in, out/8] int32, eight output columns per word in the nibble order
  AWQ_PACK_ORDER; qzeros [in/G, out/8] int32 packed the same way; scales [in/G, out] float16.
- GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq"): qweight [in/8, out] int32, eight input
  rows per word, lowest nibble first; qzeros [in/G, out/8] int32 holding zero - 1 (the format's
  historical offset), sequential nibbles; scales [in/G, out] float16; g_idx [in] int32, the group
  of each input channel (not monotonic when the model was quantized with desc_act / act-order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Nibble i of an AWQ word holds output column AWQ_PACK_ORDER[i] of its group of eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_NIBBLES = 8


@dataclass
class Int4Weight:
    q: torch.Tensor  # [out, in] integer levels 0..15 (any integer dtype)
    scale: torch.Tensor  # [out, in // group_size] float
    zero: torch.Tensor  # [out, in // group_size] integer zero points 0..15
    group_size: int
    g_idx: torch.Tensor | None = None  # [in] group of each input channel; None means i // group_size

    def groups(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.q.shape[1], device=self.q.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.groups()
        return ((self.q.float() - self.zero.float()[:, g]) * self.scale.float()[:, g]).to(dtype)


# --- reference quantizers ----------------------------------------------------------------------
def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, one scale per output row: (q int8 [out, in], scale float32 [out])."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int4_params(w: torch.Tensor, group_size: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Min/max (asymmetric) or absmax (symmetric, zero fixed at 8) scale and zero per group of
    `group_size` consecutive input channels: ([out, in/G] scale, [out, in/G] integer zero)."""
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not divisible by group_size {group_size}.")
    grouped = w.float().reshape(out_features, in_features // group_size, group_size)
    if sym:
        scale = grouped.abs().amax(dim=-1).clamp(min=1e-8) / 7.5
        zero = torch.full_like(scale, 8.0)
    else:
        lo = grouped.amin(dim=-1).clamp(max=0.0)
        hi = grouped.amax(dim=-1).clamp(min=0.0)
        scale = ((hi - lo) / 15.0).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
    return scale, zero


def quantize_int4(
    w: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    group_size: int | None = None,
) -> torch.Tensor:
    """Levels q [out, in] for given per-group scale / zero (g_idx, or consecutive groups)."""
    if g_idx is None:
        g_idx = torch.arange(w.shape[1], device=w.device) // group_size
    g = g_idx.long()
    return torch.round(w.float() / scale[:, g] + zero[:, g]).clamp(0, 15).to(torch.int32)


def fake_quantize_int4(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The weights int4 rounding gives back, float32 [out, in]: bit for bit what
    `Int4Weight(quantize_int4(w, scale, zero, group_size=...), ...).dequantize()` returns for
    consecutive groups, computed on the [out, groups, group_size] view, without the integer levels
    and the per-column gathers of scale and zero (the inner loop of AWQ's searches: 3x faster)."""
    out_features, in_features = w.shape
    grouped = w.float().reshape(out_features, scale.shape[1], -1)
    scale, zero = scale.float()[..., None], zero.float()[..., None]
    levels = torch.round(grouped / scale + zero).clamp_(0, 15)
    return ((levels - zero) * scale).reshape(out_features, in_features)


def quantize_int4_groupwise(w: torch.Tensor, group_size: int, sym: bool = False) -> Int4Weight:
    """Round-to-nearest int4 with per-group scales (no calibration)."""
    scale, zero = int4_params(w, group_size, sym)
    return Int4Weight(quantize_int4(w, scale, zero, group_size=group_size), scale, zero.to(torch.int32), group_size)


# --- packing helpers -----------------------------------------------------------------------------
def pack_cols(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[rows, cols] of 0..15 -> [rows, cols/8] int32; nibble i of word j holds column 8j + order[i]."""
    rows, cols = values.shape
    if cols % _NIBBLES:
        raise ValueError(f"{cols} columns cannot be packed eight to a word.")
    v = values.to(torch.int64).reshape(rows, cols // _NIBBLES, _NIBBLES)[:, :, list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    return _to_int32((v << shifts).sum(dim=-1))


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF  # [rows, words, 8] in nibble order
    inverse = [order.index(c) for c in range(_NIBBLES)]
    return nibbles[:, :, inverse].reshape(packed.shape[0], -1)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the same bits as int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


SEQUENTIAL = tuple(range(_NIBBLES))


# --- AutoAWQ gemm layout --------------------------------------------------------------------------
def pack_awq(weight: Int4Weight) -> dict[str, torch.Tensor]:
    if weight.g_idx is not None:
        raise ValueError("The AWQ layout has no g_idx: groups must be consecutive input channels.")
    return {
        "qweight": pack_cols(weight.q.t(), AWQ_PACK_ORDER),
        "qzeros": pack_cols(weight.zero.t(), AWQ_PACK_ORDER),
        "scales": weight.scale.t().to(torch.float16).contiguous(),
    }


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Weight:
    q = unpack_cols(qweight, AWQ_PACK_ORDER).t().contiguous()
    zero = unpack_cols(qzeros, AWQ_PACK_ORDER).t().contiguous()
    _check_shapes("AWQ", q, zero, scales.t(), group_size)
    return Int4Weight(q, scales.t().float().contiguous(), zero, group_size)


# --- GPTQ layout ------------------------------------------------------------------------------------
def pack_gptq(weight: Int4Weight) -> dict[str, torch.Tensor]:
    in_features = weight.q.shape[1]
    if in_features % _NIBBLES:
        raise ValueError(f"in_features {in_features} cannot be packed eight rows to a word.")
    g_idx = weight.groups().to(torch.int32)
    return {
        "qweight": _pack_rows(weight.q.t()),
        "qzeros": pack_cols((weight.zero.t() - 1) & 0xF, SEQUENTIAL),
        "scales": weight.scale.t().to(torch.float16).contiguous(),
        "g_idx": g_idx,
    }


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] -> [rows/8, cols] int32; nibble i of word r holds row 8r + i."""
    return pack_cols(values.t(), SEQUENTIAL).t().contiguous()


def unpack_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, group_size: int
) -> Int4Weight:
    q = unpack_cols(qweight.t().contiguous(), SEQUENTIAL).contiguous()  # [out, in]
    zero = ((unpack_cols(qzeros, SEQUENTIAL) + 1) & 0xF).t().contiguous()  # [out, in/G]
    _check_shapes("GPTQ", q, zero, scales.t(), group_size)
    in_features = q.shape[1]
    default = torch.arange(in_features, dtype=torch.int32) // group_size
    if g_idx is not None and not torch.equal(g_idx.to(torch.int32).cpu(), default):
        return Int4Weight(q, scales.t().float().contiguous(), zero, group_size, g_idx.to(torch.int32))
    return Int4Weight(q, scales.t().float().contiguous(), zero, group_size)


def _check_shapes(layout: str, q: torch.Tensor, zero: torch.Tensor, scale_t: torch.Tensor, group_size: int) -> None:
    out_features, in_features = q.shape
    groups = -(-in_features // group_size)
    if tuple(scale_t.shape) != (out_features, groups) or tuple(zero.shape) != (out_features, groups):
        raise ValueError(
            f"{layout} tensors do not agree: {out_features}x{in_features} weight with group_size "
            f"{group_size} needs {groups} groups, got scales {tuple(scale_t.shape[::-1])} and "
            f"zeros for {zero.shape[1]} groups."
        )
