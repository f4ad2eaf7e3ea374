"""Mixture-of-experts decoder models: Qwen3-MoE, Qwen2-MoE (a gated shared expert), Mixtral, Granite MoE
(Granite's multipliers) and ERNIE 4.5 MoE (shared experts, a corrected router, MoE layers from
moe_layer_start_index every moe_layer_interval). Their attention is the Llama family's (ERNIE's its
own); their MLPs are SparseMoeBlocks (layers/moe.py's FusedMoE, plus any shared expert) in the MoE
layers and the dense MLP in the others. Each router's rule is its transformers model's.

Checkpoints name experts per expert (`mlp.experts.3.up_proj`, Mixtral's `experts.3.w3`) or as 3D
tensors (Granite's `input_linear` / `output_linear`, transformers 5's `experts.gate_up_proj`); both
load into FusedMoE's stacked w13 / w2.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from splitserve.distributed.parallel_state import get_parallel_rank
from splitserve.layers.basic import Linear
from splitserve.layers.moe import DOWN, GATE, UP, FusedMoE, RouterRule
from splitserve.layers.moe_quantized import CHECKPOINT_METHODS
from splitserve.models.ernie4_5 import Ernie4_5Attention, Ernie4_5MLP
from splitserve.models.llama import LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    """The MLP of an MoE layer: the routed experts, and the shared experts every token goes through
    (optionally scaled by a sigmoid gate, Qwen2-MoE)."""

    def __init__(self, config, dtype, quant_config, prefix: str, model: type[MoEForCausalLM]):
        super().__init__()
        checkpoint = quant_config is not None and quant_config.from_checkpoint and quant_config.method != "gguf"
        if checkpoint and quant_config.method not in CHECKPOINT_METHODS:
            raise ValueError(
                f"{quant_config.method} checkpoints of mixture-of-experts models are not supported yet (experts load "
                f"from {', '.join(CHECKPOINT_METHODS)} checkpoints): serve the unquantized checkpoint with "
                "--quantization weight_only_int8 or fp8 (experts quantized while loading), or a GGUF file."
            )
        self.experts = FusedMoE(
            model.num_experts(config),
            config.hidden_size,
            model.expert_intermediate_size(config),
            model.router_rule(config),
            dtype,
            expert_parallel=get_parallel_rank().expert_parallel,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )
        shared = model.shared_intermediate_size(config)
        self.shared_expert = (
            model.dense_mlp_cls(config, dtype, quant_config, f"{prefix}.shared_expert", shared) if shared else None
        )
        # A 4-bit checkpoint keeps the one-row shared-expert gate unquantized (no 4-bit layout packs one row).
        plain_gate = quant_config is None or checkpoint
        gate_method = None if plain_gate else quant_config.linear_method(f"{prefix}.shared_expert_gate")
        self.shared_expert_gate = (
            Linear(config.hidden_size, [1], dtype=dtype, quant_method=gate_method)
            if shared and model.gated_shared_expert
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama family with SparseMoeBlocks in its MoE layers. Subclasses say how their config names
    the experts and which layers are MoE, and how their checkpoints name the tensors."""

    dense_mlp_cls: type[LlamaMLP] = LlamaMLP
    gated_shared_expert = False

    def __init__(self, config, dtype: torch.dtype, max_position: int, quant_config=None):
        model = type(self)

        class _LayerMLP:  # picks, per layer, the sparse block or the dense MLP
            @staticmethod
            def for_layer(config, layer_idx, dtype, quant_config, prefix):
                if model.is_moe_layer(config, layer_idx):
                    return SparseMoeBlock(config, dtype, quant_config, prefix, model)
                return model.dense_mlp_cls(config, dtype, quant_config, prefix)

        self.mlp_cls = _LayerMLP
        super().__init__(config, dtype, max_position, quant_config)

    # --- what subclasses say -------------------------------------------------------------------
    @staticmethod
    def num_experts(config) -> int:
        return config.num_experts

    @staticmethod
    def expert_intermediate_size(config) -> int:
        return config.moe_intermediate_size

    @staticmethod
    def shared_intermediate_size(config) -> int:
        return 0

    @staticmethod
    def router_rule(config) -> RouterRule:
        return RouterRule(config.num_experts_per_tok, renormalize=bool(getattr(config, "norm_topk_prob", False)))

    @staticmethod
    def is_moe_layer(config, layer_idx: int) -> bool:
        return True

    # checkpoint name (group 1: the decoder layer, group 2: the expert) -> (FusedMoE parameter, which
    # projection, or None for a whole 3D tensor, the router's weight or its correction)
    # A per-expert name ends in `weight`, or in a quantized checkpoint's own tensor (qweight, scales ...):
    # FusedMoE takes that tensor by its name (`kind`).
    _EXPERT_NAMES = [
        (re.compile(r"(.*)\.mlp\.experts\.(\d+)\.gate_proj\.(?P<kind>\w+)$"), "w13", GATE),
        (re.compile(r"(.*)\.mlp\.experts\.(\d+)\.up_proj\.(?P<kind>\w+)$"), "w13", UP),
        (re.compile(r"(.*)\.mlp\.experts\.(\d+)\.down_proj\.(?P<kind>\w+)$"), "w2", DOWN),
        (re.compile(r"(.*)\.mlp\.experts\.gate_up_proj$"), "w13", None),
        (re.compile(r"(.*)\.mlp\.experts\.down_proj$"), "w2", None),
        (re.compile(r"(.*)\.mlp\.gate\.weight$"), "gate", None),
    ]

    def _targets(self, name: str) -> list[tuple[str, int | None]]:
        for pattern, param, projection in self._EXPERT_NAMES:
            match = pattern.match(name)
            if match:
                shard = None if projection is None else 3 * int(match.group(2)) + projection
                kind = match.groupdict().get("kind") or "weight"
                return [(f"{match.group(1)}.mlp.experts.{param if kind == 'weight' else kind}", shard)]
        return super()._targets(name)


def _qwen_moe_layer(config, layer_idx: int) -> bool:
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    )


class Qwen3MoeForCausalLM(MoEForCausalLM):
    is_moe_layer = staticmethod(_qwen_moe_layer)


class Qwen2MoeForCausalLM(MoEForCausalLM):
    is_moe_layer = staticmethod(_qwen_moe_layer)
    gated_shared_expert = True

    @staticmethod
    def shared_intermediate_size(config) -> int:
        return getattr(config, "shared_expert_intermediate_size", 0) or 0


class _LocalExperts:
    """Mixtral's and Granite-MoE's config names: num_local_experts experts of intermediate_size."""

    @staticmethod
    def num_experts(config) -> int:
        return config.num_local_experts

    @staticmethod
    def expert_intermediate_size(config) -> int:
        return config.intermediate_size


class MixtralForCausalLM(_LocalExperts, MoEForCausalLM):
    _EXPERT_NAMES = MoEForCausalLM._EXPERT_NAMES + [
        (re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w1\.(?P<kind>\w+)$"), "w13", GATE),
        (re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w3\.(?P<kind>\w+)$"), "w13", UP),
        (re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.w2\.(?P<kind>\w+)$"), "w2", DOWN),
        (re.compile(r"(.*)\.block_sparse_moe\.gate\.weight$"), "gate", None),
    ]

    @staticmethod
    def router_rule(config) -> RouterRule:
        return RouterRule(config.num_experts_per_tok, renormalize=True, weights_in_float=True)


class Ernie4_5_MoeForCausalLM(MoEForCausalLM):
    attention_cls = Ernie4_5Attention
    dense_mlp_cls = Ernie4_5MLP
    _EXPERT_NAMES = MoEForCausalLM._EXPERT_NAMES + [
        (re.compile(r"(.*)\.mlp\.moe_statics\.e_score_correction_bias$"), "e_score_correction_bias", None),
    ]

    def _targets(self, name: str) -> list[tuple[str, int | None]]:
        return super()._targets(name.replace(".mlp.shared_experts.", ".mlp.shared_expert."))

    @staticmethod
    def num_experts(config) -> int:
        return getattr(config, "num_experts", None) or config.moe_num_experts

    @staticmethod
    def shared_intermediate_size(config) -> int:
        return config.moe_intermediate_size * (getattr(config, "moe_num_shared_experts", 0) or 0)

    @staticmethod
    def router_rule(config) -> RouterRule:
        k = getattr(config, "num_experts_per_tok", None) or config.moe_k
        norm_min = float(getattr(config, "moe_norm_min", 1e-12))
        return RouterRule(k, renormalize=True, norm_min=norm_min, biased=True, logits_in_float=True)

    @staticmethod
    def is_moe_layer(config, layer_idx: int) -> bool:
        end = getattr(config, "moe_layer_end_index", -1)
        end = config.num_hidden_layers - 1 if end in (None, -1) else end
        return (layer_idx + 1) % config.moe_layer_interval == 0 and config.moe_layer_start_index <= layer_idx <= end


class GraniteMoeForCausalLM(_LocalExperts, MoEForCausalLM):
    """Granite's multipliers (embedding, residual, attention scale, logits) are the Llama family's
    config switches (models/llama.py); its router takes the top-k logits, then their softmax."""

    _EXPERT_NAMES = MoEForCausalLM._EXPERT_NAMES + [
        (re.compile(r"(.*)\.block_sparse_moe\.input_linear\.weight$"), "w13", None),
        (re.compile(r"(.*)\.block_sparse_moe\.output_linear\.weight$"), "w2", None),
        (re.compile(r"(.*)\.block_sparse_moe\.router\.layer\.weight$"), "gate", None),
    ]

    @staticmethod
    def router_rule(config) -> RouterRule:
        return RouterRule(config.num_experts_per_tok, scoring="topk_softmax")
