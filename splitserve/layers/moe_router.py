"""A mixture-of-experts layer's router: how each model turns the router's logits into every token's
top-k experts and their weights (layers/moe.py's FusedMoE computes the logits and runs the experts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RouterRule:
    """How a model's router turns logits into each token's experts and weights.

    `scoring`: "softmax" (softmax over all experts, then top-k) or "topk_softmax" (top-k of the
    logits, then softmax over those k: Granite). `renormalize`: divide the top-k weights by their
    sum (Mixtral always, Qwen with norm_topk_prob, ERNIE with a floor of `norm_min`). `biased`: a
    per-expert correction added to the probabilities to choose the experts only (ERNIE 4.5's
    e_score_correction_bias). `weights_in_float`: the weights stay float32 when they scale the
    experts' outputs (Mixtral), instead of being cast to the model dtype first (Qwen, ERNIE, Granite).
    `logits_in_float`: the router's product in float32 (ERNIE 4.5)."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    norm_min: float = 0.0
    biased: bool = False
    weights_in_float: bool = False
    logits_in_float: bool = False


def choose_experts(
    rule: RouterRule, logits: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) from the router's logits [T, E] by `rule`; `bias`: the
    per-expert correction of a biased rule (ERNIE 4.5), which chooses the experts but does not weigh
    them. The weights come in `dtype` unless the rule keeps them in float32."""
    if rule.scoring == "topk_softmax":
        top, ids = logits.float().topk(rule.top_k, dim=-1)
        return top.softmax(dim=-1).to(dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    choice = probs + bias if bias is not None else probs
    _, ids = choice.topk(rule.top_k, dim=-1)
    weights = probs.gather(-1, ids)
    if rule.renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total.clamp(min=rule.norm_min) if rule.norm_min else total)
    return (weights if rule.weights_in_float else weights.to(dtype)), ids
