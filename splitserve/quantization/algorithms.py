"""The calibrated quantization algorithms of `splitserve quantize`: the input groups and scale
folding that SmoothQuant (smoothquant.py) and AWQ share, and AWQ's activation-aware scale and
clipping searches (GPTQ's error-compensating rounding is gptq.py).

SmoothQuant and AWQ both rescale the input channels of a group of linears that read the same
input: W' = W diag(s), with 1/s folded into the op that produces that input, so that the float
model computes exactly the same function and only the quantization error changes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from splitserve.quantization.calibration import InputStats
from splitserve.quantization.clipping import rounding_error, search_clip_ratios
from splitserve.quantization.moe_experts import expert_mlps
from splitserve.quantization.packing import fake_quantize_int4, int4_params

AWQ_GRID = 20  # ratios 0, 0.05, ..., 0.95


@dataclass
class InputGroup:
    """Linears that read the same input, and `prev`, the op before them whose output is that input:
    an RMSNorm (scaled through its weight), a linear (through its output rows), or None when no
    exact fold exists."""

    kind: str  # "qkv", "o", "gate_up" or "down"
    linears: dict[str, nn.Linear]  # checkpoint name -> module
    prev: nn.Module | None
    # prev's output row feeding each input channel, where that is not channel j <- row j: with GQA
    # a v_proj row feeds the same channel of every query head of its KV group, so those channels
    # can only be rescaled together.
    source: torch.Tensor | None = None

    @property
    def site(self) -> str:
        """The name under which the group's shared input is recorded (its first linear's)."""
        return next(iter(self.linears))

    def weight(self) -> torch.Tensor:
        """The group's weights stacked along the output dim: [sum of out, in]."""
        return torch.cat([m.weight.detach().float() for m in self.linears.values()])

    def tied_max(self, values: torch.Tensor) -> torch.Tensor:
        """Per input channel [..., in]: the max over the channels fed by the same row of prev, so
        that scales computed from it fold exactly."""
        if self.source is None:
            return values
        index = self.source.expand_as(values)
        rows = values.new_full((*values.shape[:-1], self.prev.out_features), -torch.inf)
        return rows.scatter_reduce(-1, index, values, "amax").gather(-1, index)

    def prev_rows(self, s: torch.Tensor) -> torch.Tensor:
        """Tied per-input-channel scales [in] as scales of prev's output rows."""
        if self.source is None:
            return s
        return s.new_ones(self.prev.out_features).scatter(0, self.source, s)


def decoder_groups(model: nn.Module) -> list[list[InputGroup]]:
    """The input groups of each decoder layer of a Llama-style transformers model."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: not a Llama-style decoder.")
    source = _kv_source(model.config)
    result = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        result.append(
            [
                InputGroup("qkv", _named(i, attn, "self_attn", "q_proj", "k_proj", "v_proj"), layer.input_layernorm),
                InputGroup("o", _named(i, attn, "self_attn", "o_proj"), attn.v_proj, source),
                *_mlp_groups(i, layer),
            ]
        )
    return result


def _mlp_groups(i: int, layer: nn.Module) -> list[InputGroup]:
    """A dense MLP's gate/up (its input the post-attention norm's) and down groups; in a mixture-of-
    experts layer, each expert's and the shared expert's, whose gate/up input other readers share
    (the router, the other experts), so that it has no exact fold (moe_experts.py)."""
    mlp = layer.mlp
    if not hasattr(mlp, "experts"):
        # down_proj reads silu(gate) * up, which is linear in up_proj's output rows.
        return [
            InputGroup("gate_up", _named(i, mlp, "mlp", "gate_proj", "up_proj"), layer.post_attention_layernorm),
            InputGroup("down", _named(i, mlp, "mlp", "down_proj"), mlp.up_proj),
        ]
    groups = []
    for prefix, expert in expert_mlps(i, mlp):
        gate_up = {f"{prefix}.{n}": getattr(expert, n) for n in ("gate_proj", "up_proj")}
        groups += [
            InputGroup("gate_up", gate_up, None),
            InputGroup("down", {f"{prefix}.down_proj": expert.down_proj}, expert.up_proj),
        ]
    return groups


def _kv_source(config) -> torch.Tensor | None:
    """With GQA, the v_proj row behind each o_proj input channel: query head h reads KV head
    h // (heads / kv_heads), channel d of a head is row d of its KV head. None without GQA."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads == heads:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    channel = torch.arange(heads * head_dim)
    return channel // head_dim // (heads // kv_heads) * head_dim + channel % head_dim


def _named(layer: int, module: nn.Module, kind: str, *names: str) -> dict[str, nn.Linear]:
    return {f"model.layers.{layer}.{kind}.{n}": getattr(module, n) for n in names}


@torch.no_grad()
def fold_scales(group: InputGroup, s: torch.Tensor) -> None:
    """W <- W diag(s) for the group's linears and the input divided by s in `prev`: the float
    model's outputs do not change (s must be tied as `InputGroup.tied_max` ties channels)."""
    prev = group.prev
    if isinstance(prev, nn.Linear):
        rows = group.prev_rows(s)
        prev.weight.div_(rows[:, None].to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.div_(rows.to(prev.bias.dtype))
    else:
        prev.weight.div_(s.to(prev.weight.dtype))
    for linear in group.linears.values():
        linear.weight.mul_(s[None, :].to(linear.weight.dtype))


# --- AWQ ------------------------------------------------------------------------------------------
@dataclass
class AwqSearch:
    scale: torch.Tensor  # [in] the best s
    ratio: float  # its exponent a in s = mean|X|^a
    losses: list[float]  # the objective at each ratio of the grid, a = 0 first


def awq_objective(moment: torch.Tensor, weight: torch.Tensor, s: torch.Tensor, group_size: int) -> float:
    """Mean squared error between the float outputs x W^T and those of the scaled, fake-quantized
    weights, (x / s) Q(W diag(s))^T, over the calibration inputs x, whose second moment
    E[x^T x] is `moment` [in, in]."""
    scaled = weight * s
    error = fake_quantize_int4(scaled, *int4_params(scaled, group_size, sym=False)) / s - weight
    return ((error @ moment) * error).sum().item() / weight.shape[0]


def awq_search(
    moment: torch.Tensor, act_absmean: torch.Tensor, weight: torch.Tensor, group_size: int, grid: int = AWQ_GRID
) -> AwqSearch:
    """Grid search of s = mean|X|^a (normalized so that max(s) * min(s) = 1) minimizing
    `awq_objective`. a = 0 (s = 1, plain round-to-nearest) is on the grid, so the result is never
    worse than no scaling on this objective."""
    candidates, losses = [], []
    for k in range(grid):
        s = act_absmean.pow(k / grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        candidates.append(s)
        losses.append(awq_objective(moment, weight, s, group_size))
    best = min(range(grid), key=losses.__getitem__)
    return AwqSearch(candidates[best], best / grid, losses)


def awq_scale_model(
    model: nn.Module, stats: dict[str, InputStats], group_size: int, clip: bool = True
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`awq_scale_layer` for every decoder layer, on statistics of the float model's inputs."""
    ratios, clips = [], {}
    for groups in tqdm(decoder_groups(model), desc="AWQ scale and clip search", unit="layer"):
        layer_ratios, layer_clips = awq_scale_layer(groups, stats, group_size, clip)
        ratios += layer_ratios
        clips.update(layer_clips)
    return ratios, clips


def awq_scale_layer(
    groups: list[InputGroup],
    stats: dict[str, InputStats],
    group_size: int,
    clip: bool = True,
    rescale_stats: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Search and fold AWQ's scales for every group of one layer with an exact fold, then (with `clip`)
    search each linear's clipping (`awq_clip_search`) on the rescaled weights and inputs. Returns the
    chosen scale exponents, and the clipping ratios by linear name. With `rescale_stats`, each scaled
    group's `stats` then describe its new inputs x / s (`InputStats.divide`), as a pass of the rescaled
    layer over the calibration data would record them: a fold only changes its own group's input."""
    ratios, clips = [], {}
    for group in groups:
        moment = stats[group.site].second_moment()
        if group.prev is not None:
            found = awq_search(moment, group.tied_max(stats[group.site].absmean), group.weight(), group_size)
            fold_scales(group, found.scale)
            ratios.append(found.ratio)
            moment = moment / found.scale[:, None] / found.scale[None, :]  # the input is now x / s
            if rescale_stats:
                stats[group.site].divide(found.scale)
        if not clip:
            continue
        for name, linear in group.linears.items():
            # q/k are left unclipped (as AutoAWQ does): attention scores are sensitive to them.
            if not name.endswith(("q_proj", "k_proj")):
                clips[name] = awq_clip_search(linear.weight.detach().float(), moment, group_size)
    return ratios, clips


AWQ_CLIP_GRID = 20  # range shrinks 1.0, 0.975, ..., 0.525


def awq_clip_search(
    weight: torch.Tensor, moment: torch.Tensor, group_size: int, grid: int = AWQ_CLIP_GRID
) -> torch.Tensor:
    """AWQ's clipping: per output row and group, the range [min, max] shrunk to the one minimizing
    that group's share of the output error, e_g M_gg e_g^T (M the inputs' second moment; the
    cross-group terms are left out, as AutoAWQ's per-group search does). Rounding a few outliers
    harder buys a finer grid for the rest. Each end is searched as well as both together
    (clipping.search_clip_ratios). Returns the ratios [out, G, 2] (of the minimum, of the maximum)."""
    out_features, in_features = weight.shape
    groups = in_features // group_size
    blocks = moment.reshape(groups, group_size, groups, group_size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    grouped = weight.float().reshape(out_features, groups, group_size)

    def loss_of(ratios: torch.Tensor) -> torch.Tensor:  # [K, out, G, 2] -> [K, out, G]
        error = rounding_error(grouped, ratios)
        return torch.einsum("kogi,gij,kogj->kog", error, blocks, error)

    steps = [1.0 - k * 0.5 / grid for k in range(grid)]
    return search_clip_ratios(loss_of, (out_features, groups), steps)
