"""Matrix products, dequantization and embedding lookups with GGUF quantized weights kept in their
blocks, as they lie in the .gguf file.

Layout: a weight of N output rows and K input values is a uint8 tensor [N, row_bytes], row n holding
the blocks of row n in file order, row_bytes = K / block_values * block_bytes (gguf.GGML_QUANT_SIZES:
32 values per block for Q4_0 .. Q8_0, 256 for the K-quants, so K must be a multiple of that).
The C++ kernels (gguf_formats.h: the block layouts) take the types in KERNEL_TYPES.

Which path runs:
- CPU tensors, C++ kernels built: gguf_products.cpp, gguf_dequantize.cpp. gguf_mm of a few rows
  (fewer than 8 for bfloat16 x on a CPU with native bf16, else 16) quantizes x to 8 bits per 32
  values and multiplies in integers, reading each weight row once for all rows of x: its results
  differ from x @ W.T by that rounding of x, about 0.5% of the outputs' root mean square. More rows
  go through dequantized tiles and at::mm (bfloat16 tiles with native bf16 and bfloat16 x, else
  float32): as exact as F.linear.
  Q4_0, Q4_1 and Q8_0 weights of a multiple of 16 rows can be repacked (repack(): 16 rows interleaved, one
  per vector lane, as llama.cpp's CPU backend repacks them); the model's loader does so on the CPU.
  gguf_dequantize and gguf_embedding equal the gguf package's dequantize, rounded once to dtype.
- Otherwise the reference: the gguf package's numpy dequantize, then F.linear or indexing. It runs
  where the C++ kernels are off (SPLITSERVE_CPU_KERNELS=0, or their build failed), for tensors on
  other devices and for types without a kernel, and says so in the log, once for each reason.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from splitserve.kernels import batch_invariant, cpu_features, cpu_ops, row_buckets

logger = logging.getLogger(__name__)

# ggml type id -> name, for the types the C++ kernels compute with (gguf_formats.h).
KERNEL_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# Added to the type id of a weight that repack() interleaved (gguf_repack.h's kRepacked), for the
# types it repacks; such a weight is [N / REPACK_ROWS, REPACK_ROWS * row_bytes].
REPACKED = 256
REPACK_TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
REPACK_ROWS = 16
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_INTEGER, _TILES = 1, 2  # gguf_mm's path (gguf_products.cpp): by row count when not given
_logged: set[str] = set()


def gguf_mm(x: torch.Tensor, w: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """x [..., K] @ dequantize(w).T -> [..., N] in x's dtype; w [N, row_bytes] uint8 of ggml type
    qtype. float32 and bfloat16 x go to the kernel as they are, float16 through float32."""
    ops = _kernel_ops(w, qtype)
    if ops is None:
        return F.linear(x, dequantize_reference(w, qtype, n, k).to(x.dtype))
    flat = x.reshape(-1, k)
    compute = flat if flat.dtype in _KERNEL_DTYPES else flat.float()
    native_bf16 = cpu_features.native_bf16()
    if batch_invariant.enabled():
        out = _invariant_mm(ops, compute, w, qtype, n, k, native_bf16)
    else:
        if compute.dtype == torch.bfloat16 and native_bf16:  # the tiles of larger batches go through oneDNN
            compute = row_buckets.padded_rows(compute)
        out = ops.gguf_mm(compute.contiguous(), w, qtype, n, k, native_bf16)[: flat.shape[0]]
    return out.to(x.dtype).view(*x.shape[:-1], n)


def _invariant_mm(ops, x: torch.Tensor, w: torch.Tensor, qtype: int, n: int, k: int, native_bf16: bool):
    """Batch-invariant numerics: generated tokens' rows take the integer path and prompt tokens' rows
    the dequantized tiles (rows padded as every invariant product is), whatever their numbers."""
    start = batch_invariant.prompt_rows(x.shape[0])
    parts = []
    if start:
        parts.append(ops.gguf_mm(x[:start].contiguous(), w, qtype, n, k, native_bf16, _INTEGER))
    if start < x.shape[0]:
        prompt = x[start:]
        padded = row_buckets.padded_rows(prompt.contiguous(), w)
        parts.append(ops.gguf_mm(padded, w, qtype, n, k, native_bf16, _TILES)[: prompt.shape[0]])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: list[torch.Tensor],
    qtype_gate_up: int,
    down: list[torch.Tensor],
    qtype_down: int,
    first_expert: int,
    intermediate: int,
) -> torch.Tensor:
    """A mixture-of-experts layer's experts on GGUF blocks in one C++ call (moe_experts.cpp): the sum
    over each token's chosen experts (ids [T, k], weights [T, k]) among those held here (local expert
    e is expert first_expert + e) of weight * down(silu_and_mul(gate_up(x)))."""
    return cpu_ops().moe_experts_gguf(
        x.contiguous(), ids, weights, gate_up, qtype_gate_up, down, qtype_down, first_expert, intermediate,
        cpu_features.native_bf16(),
    )  # fmt: skip


def gguf_dequantize(w: torch.Tensor, qtype: int, n: int, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] in dtype (float32, bfloat16 or float16): w [N, row_bytes] uint8 dequantized."""
    ops = _kernel_ops(w, qtype)
    if ops is None:
        return dequantize_reference(w, qtype, n, k).to(dtype)
    return ops.gguf_dequantize(w, qtype, n, k, dtype)


def gguf_embedding(ids: torch.Tensor, w: torch.Tensor, qtype: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows ids (any shape, int64) of w [V, row_bytes] uint8, dequantized: [*ids.shape, K] in dtype."""
    ops = _kernel_ops(w, qtype)
    if ops is None:
        rows = w[ids.reshape(-1).to(w.device)]
        return dequantize_reference(rows, qtype, rows.shape[0], k).to(dtype).view(*ids.shape, k)
    return ops.gguf_embedding(ids.reshape(-1).long().contiguous(), w, qtype, k, dtype).view(*ids.shape, k)


def repack(w: torch.Tensor, qtype: int, n: int, k: int) -> tuple[torch.Tensor, int] | None:
    """(weight, type id) of w interleaved 16 rows at a time for decode's products, or None where
    it stays as it is: a type without a repacked kernel, rows not a multiple of 16, a tensor off the
    CPU or no C++ kernels. The repacked weight goes to gguf_mm and gguf_dequantize with its new
    type id, and has as many bytes."""
    if qtype not in REPACK_TYPES or n % REPACK_ROWS or w.device.type != "cpu" or cpu_ops() is None:
        return None
    return cpu_ops().gguf_repack(w.contiguous(), qtype, n, k), qtype + REPACKED


def dequantize_reference(w: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """[N, K] float32 on w's device, by the gguf package's numpy dequantize: the reference the C++
    kernels are tested against, and the path for what they do not take."""
    import gguf

    values = gguf.quants.dequantize(w.cpu().numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(values.reshape(n, k)).to(w.device)


def has_kernel(qtype: int) -> bool:
    """Whether the C++ kernels multiply by blocks of this ggml type (as stored, or repacked)."""
    return qtype >= REPACKED or qtype in KERNEL_TYPES


def _kernel_ops(w: torch.Tensor, qtype: int):
    """torch.ops.splitserve_cpu where the C++ kernels take this weight, else None (logged once per reason)."""
    if qtype >= REPACKED:  # only ever made by the kernels, on the CPU
        return cpu_ops()
    if qtype not in KERNEL_TYPES:
        reason = f"GGUF type {qtype} has no C++ kernel"
    elif w.device.type != "cpu":
        reason = f"GGUF weights on {w.device.type} have no kernel"
    elif cpu_ops() is None:
        reason = "the C++ CPU kernels are off (SPLITSERVE_CPU_KERNELS=0) or did not build"
    else:
        return cpu_ops()
    if reason not in _logged:
        _logged.add(reason)
        logger.info("%s: GGUF weights are dequantized by the gguf package (numpy) at every use instead.", reason)
    return None
