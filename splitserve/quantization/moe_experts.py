"""Mixture-of-experts models in `splitserve quantize` (awq, gptq).

transformers 5 holds a layer's experts as two 3D parameters (gate_up_proj [E, 2I, H], down_proj
[E, H, I]) multiplied inside one module. The quantizer works on Linears, named as the per-expert
checkpoints name them (`mlp.experts.N.gate_proj`, the names AutoAWQ, AutoGPTQ and the engine use), so
`unfuse_experts` swaps each such module for per-expert Linears that compute the same function. Then
every expert is calibrated on the tokens the router sends it (its own inputs, its own Hessian), and
an expert that no calibration token reached is rounded plainly (the log counts them). The routers
and Qwen2-MoE's one-row shared-expert gate stay unquantized, as those tools leave them.

AWQ's scales fold exactly where the scaled input has one reader: each expert's down projection (its
up projection's rows). The experts' gate/up inputs come from the layer norm that the router and every
other expert also read, so they are rounded with AWQ's clipping search but no scale fold.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Model types whose checkpoints name the experts `mlp.experts.N.{gate,up,down}_proj` and whose MoE
# layers the engine loads from 4-bit checkpoints (models/moe.py).
MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
FOUR_BIT = ("awq", "gptq")


def is_moe(config) -> bool:
    return bool(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0))


def check_moe(config, quant_type: str) -> None:
    """Refuse what the quantizer cannot make of a mixture-of-experts model, saying what works instead."""
    if not is_moe(config):
        return
    if quant_type not in FOUR_BIT:
        raise ValueError(
            f"--quant-type {quant_type} of a mixture-of-experts model: its checkpoint format has no expert layout; "
            "use awq or gptq, or serve the unquantized model with --quantization weight_only_int8 or fp8 "
            "(every expert quantized while loading)."
        )
    if config.model_type not in MODEL_TYPES:
        raise ValueError(
            f"Quantizing {config.model_type} mixture-of-experts models is not supported (supported: "
            f"{', '.join(MODEL_TYPES)}); serve it with --quantization weight_only_int8 or fp8, or as a GGUF file."
        )


class _Expert(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (_linear(w) for w in (gate, up, down))


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    return linear


class UnfusedExperts(nn.ModuleList):
    """The experts of one layer as per-expert Linears; the forward of transformers' fused experts module
    (hidden states [T, H], each token's top-k expert ids and routing weights)."""

    def __init__(self, fused: nn.Module):
        inter = fused.down_proj.shape[2]
        super().__init__(_Expert(w13[:inter], w13[inter:], w2) for w13, w2 in zip(fused.gate_up_proj, fused.down_proj))
        act_fn = fused.act_fn
        self.act = lambda x: act_fn(x)  # a function, not a submodule: the list holds the experts only

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            tokens, slots = torch.where(top_k_index == e)
            if tokens.numel() == 0:
                continue
            x = hidden_states[tokens]
            h = expert.down_proj(self.act(expert.gate_proj(x)) * expert.up_proj(x))
            out.index_add_(0, tokens, (h * top_k_weights[tokens, slots, None]).to(out.dtype))
        return out


def unfuse_experts(model: nn.Module) -> int:
    """Replace every layer's fused experts module by UnfusedExperts; returns how many layers had one."""
    count = 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            layer.mlp.experts = UnfusedExperts(experts)
            count += 1
    return count


def expert_mlps(layer_index: int, mlp: nn.Module) -> list[tuple[str, nn.Module]]:
    """(checkpoint name prefix, module with gate_proj / up_proj / down_proj) for each expert of an MoE
    layer's MLP (after unfuse_experts) and its shared expert, if any."""
    prefix = f"model.layers.{layer_index}.mlp"
    found = [(f"{prefix}.experts.{e}", expert) for e, expert in enumerate(mlp.experts)]
    shared = getattr(mlp, "shared_expert", None)
    return found + ([(f"{prefix}.shared_expert", shared)] if shared is not None else [])


def expert_sites(layers: list) -> list[str]:
    """The input sites (the gate_proj names) of every expert of a model's input groups."""
    return [g.site for groups in layers for g in groups if g.kind == "gate_up" and ".experts." in g.site]


def log_unreached(stats: dict, sites: list[str]) -> None:
    """Say how many experts no calibration token reached (they are rounded plainly)."""
    unreached = [n for n in sites if stats[n].tokens == 0]
    if unreached:
        logger.warning(
            "%d of %d experts received no calibration token and are rounded without calibration (e.g. %s); "
            "more or more varied calibration text (--calib-data, --num-samples) reaches more of them.",
            len(unreached),
            len(sites),
            unreached[0].rsplit(".", 1)[0],
        )
