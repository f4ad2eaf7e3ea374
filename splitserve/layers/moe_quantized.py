"""The quantized experts of a mixture-of-experts layer (layers/moe.py's FusedMoE): one pair of Linears
per expert held by this rank (gate/up stacked, down) with the model's linear method. Two sources:

- weights quantized while loading (weight_only_int8, fp8) or a GGUF file's blocks: FusedMoE cuts each
  expert's tensor to this rank's share (tensor parallelism splits the intermediate channels) and
  hands it to the Linear as its `weight`;
- a quantized checkpoint (CHECKPOINT_METHODS: AutoAWQ's and AutoGPTQ's per-expert `experts.N.gate_proj.
  qweight` / `qzeros` / `scales` / `g_idx`, llm-compressor's W4A16 `weight_packed` ...): each tensor
  goes whole to its expert's Linear, whose method unpacks the full matrix and keeps this rank's share
  (`ExpertLinear.checkpoint_slices`), as a dense layer's method does. Each method checks that every
  tensor it needs arrived, per expert and projection.
"""

from __future__ import annotations

import torch

from splitserve.layers.basic import Linear

# Quantized checkpoint formats whose experts load here (4-bit weights with group scales); the other
# checkpoint methods (fp8, int8, SmoothQuant) have no expert layout yet.
CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors")


class ExpertLinear(Linear):
    """One expert's quantized matrix (gate/up stacked, or down), with the slices of the checkpoint's
    full matrix that this rank holds. The expert layer accounts for what the checkpoint filled
    (FusedMoE.checkpoint_shards), so this Linear names nothing itself."""

    def __init__(self, input_size: int, output_sizes: list[int], dtype, quant_method, full_input, full_outputs, share):
        super().__init__(input_size, output_sizes, dtype=dtype, quant_method=quant_method)
        self.full_input_size, self.full_output_sizes = full_input, list(full_outputs)
        self._share = share

    def checkpoint_shards(self, name: str) -> list[int]:
        return []

    def checkpoint_slices(self, shard: int) -> tuple[slice, slice]:
        return self._share


def whole_tensors(quant_config) -> bool:
    """Whether the experts' checkpoint tensors go whole to the Linears (a quantized checkpoint) rather
    than cut by the expert layer (weights quantized while loading, GGUF blocks)."""
    return quant_config.from_checkpoint and quant_config.method in CHECKPOINT_METHODS


def expert_linears(moe, quant_config, prefix: str, dtype: torch.dtype) -> list[ExpertLinear]:
    """[gate/up, down] for one expert of `moe` (its hidden size, this rank's intermediate channels)."""
    h, i = moe.hidden_size, moe.intermediate
    split = whole_tensors(quant_config) and not moe.expert_parallel and moe.tp_size > 1
    full_i, start = (i * moe.tp_size, moe.tp_rank * i) if split else (i, 0)
    share, every_row = slice(start, start + i), slice(0, h)
    gate_up, down = (quant_config.linear_method(f"{prefix}.{name}") for name in ("gate_up_proj", "down_proj"))
    return [
        ExpertLinear(h, [i, i], dtype, gate_up, h, [full_i, full_i], (share, every_row)),
        ExpertLinear(i, [h], dtype, down, full_i, [h], (every_row, share)),
    ]


def tensor_names(quant_config) -> tuple[str, ...]:
    """The per-expert checkpoint tensors (besides `weight`) that a quantized checkpoint's method loads."""
    if not whole_tensors(quant_config):
        return ()
    method = quant_config.linear_method("experts")
    return tuple(method.required + method.optional) if method is not None else ()
