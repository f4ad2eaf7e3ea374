"""Tiny random-weight mixture-of-experts models for the parity tests (tests/parity/test_moe.py, and the
GPU check's tests/parity/test_gpu.py): Qwen3-MoE (with and without norm_topk_prob, top-1 and top-4),
Qwen2-MoE (a gated shared expert, a dense layer), Mixtral, Granite MoE (softmax over the top-k,
Granite's multipliers) and ERNIE 4.5 MoE (shared experts, a corrected router, MoE from layer 1)."""

from __future__ import annotations

import torch

from tests.helpers.parity import SHAPE, build

MOE = dict(SHAPE, num_key_value_heads=2)


def _qwen3(norm: bool, top_k: int):
    import transformers

    return transformers.Qwen3MoeConfig(
        **MOE, head_dim=16, num_experts=8, num_experts_per_tok=top_k, moe_intermediate_size=32,
        norm_topk_prob=norm, decoder_sparse_step=1, tie_word_embeddings=False,
    )  # fmt: skip


def _qwen2():
    import transformers

    return transformers.Qwen2MoeConfig(
        **MOE, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=True,
    )  # fmt: skip


def _mixtral():
    import transformers

    return transformers.MixtralConfig(
        **{**MOE, "intermediate_size": 48}, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False
    )


def _granite():
    import transformers

    return transformers.GraniteMoeConfig(
        **{**MOE, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2,
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5,
        tie_word_embeddings=True,
    )  # fmt: skip


def _ernie():
    import transformers

    return transformers.Ernie4_5_MoeConfig(
        **MOE, head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1,
        moe_layer_interval=1, moe_num_shared_experts=1, tie_word_embeddings=False,
    )  # fmt: skip


CONFIGS = {
    "qwen3_moe_norm_top2": lambda: _qwen3(True, 2),
    "qwen3_moe_top1": lambda: _qwen3(False, 1),
    "qwen3_moe_norm_top4": lambda: _qwen3(True, 4),
    "qwen2_moe_shared": _qwen2,
    "mixtral": _mixtral,
    "granite_moe": _granite,
    "ernie4_5_moe": _ernie,
}


def build_moe(name: str):
    """The named model of CONFIGS, with its seeded random weights."""
    model = build(CONFIGS[name](), seed=len(name))
    if name == "ernie4_5_moe":  # a correction that changes which experts are chosen
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.moe_statics.e_score_correction_bias.normal_(0.0, 0.3)
    return model
