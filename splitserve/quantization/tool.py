"""The offline quantizer behind `splitserve quantize` (entrypoints/quantize_cli.py): quantize a
Hugging Face model or a .gguf file into a Hugging Face directory the engine (and other engines)
can load: weight-only int8, SmoothQuant W8A8, or 4-bit AWQ / GPTQ in the checkpoint layouts of
AutoAWQ ("gemm") and AutoGPTQ.

Calibration runs transformers' float32 model on the CPU. Embeddings and lm_head stay unquantized;
what is not quantized is stored in the `-t` dtype."""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from splitserve.quantization import algorithms, clipping, gptq, moe_experts, smoothquant
from splitserve.quantization.calibration import collect_input_stats
from splitserve.quantization.packing import (
    Int4Weight,
    pack_awq,
    pack_gptq,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)
from splitserve.quantization.sequential import quantize_sequentially

logger = logging.getLogger(__name__)

# GPTQ's dampening, as a share of the Hessian's mean diagonal, added to its diagonal (docs/quantization.md).
# Calibrated on one pass of the float model (--no-sequential), AutoGPTQ's 0.01 fitted the built-in corpus
# too closely: on SmolLM2, text it had not seen came out 54-67% less likely than the base (worse than plain
# rounding) against 17-24% with 1.0. Layer by layer (the default), 0.1 does best: on the default model's
# held-out prose and code, 20.955 / 7.585 against 21.109 / 7.689 with 1.0 at group 32, 22.741 / 8.286
# against 22.798 / 8.533 at group 64 (0.01: 21.317 / 7.586 and 22.837 / 8.252).
GPTQ_DAMP_PERCENT = 0.1
GPTQ_DAMP_PERCENT_ONE_PASS = 1.0  # --no-sequential


def default_damp_percent(sequential: bool) -> float:
    return GPTQ_DAMP_PERCENT if sequential else GPTQ_DAMP_PERCENT_ONE_PASS


# GPTQ's defaults by group size, measured on the default model's held-out prose and code (perplexity,
# base 19.326 / 6.907; docs/quantization.md). At group 64, AWQ's scales folded in first and each
# group's clipped range searched: 21.011 / 7.599, against 22.483 / 7.891 with the search alone and
# 22.741 / 8.286 with neither. At group 32 neither helps (20.955 / 7.585 plain; 21.527 / 7.602 with the
# search, 21.328 / 7.557 with both): that base's weights are llama.cpp Q4_1 blocks of 32, a grid that
# each group of 32's full range stays close to. So both are on from group 64 (and per channel).
def default_clip_search(group_size: int) -> bool:
    return group_size <= 0 or group_size >= 64


def default_awq_scales(group_size: int, sequential: bool) -> bool:
    """--awq-scales works layer by layer; on by default where the clipping search is."""
    return sequential and default_clip_search(group_size)


def _group_inputs(config, tp_size: int) -> dict[str, int]:
    """The input sizes (per rank) that a 4-bit format's groups must divide, by what they are."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_rank = " per rank" if tp_size > 1 else ""
    inputs = {
        "hidden_size (the input of q/k/v/gate/up_proj)": hidden,
        f"o_proj's input size{per_rank} ({heads} heads x {head_dim} / {tp_size})": heads * head_dim // tp_size,
    }
    for name in _intermediate_sizes(config):
        inputs[f"down_proj's input size{per_rank} ({name} / {tp_size})"] = getattr(config, name) // tp_size
    return inputs


def _intermediate_sizes(config) -> list[str]:
    """The config's intermediate sizes that quantized linears have: the dense MLP's, or in a mixture-of-
    experts model, the experts' and the shared expert's (a model's dense layers: moe_experts.MODEL_TYPES
    have none unless mlp_only_layers names some)."""
    if not moe_experts.is_moe(config):
        return ["intermediate_size"]
    names = ["moe_intermediate_size", "shared_expert_intermediate_size"]
    if getattr(config, "mlp_only_layers", None):
        names.append("intermediate_size")
    return [n for n in names if getattr(config, n, 0)]


def default_group_size(config, tp_size: int, preferred: int = 128) -> int:
    """The largest group size up to `preferred` (of 128, 64, 32, 16, 8) that divides every quantized
    layer's input; logged when it is not `preferred`. `preferred` when none does (check_shapes says why)."""
    inputs = _group_inputs(config, max(tp_size, 1))
    for size in (128, 64, 32, 16, 8):
        if size <= preferred and all(value % size == 0 for value in inputs.values()):
            if size != preferred:
                name, value = next((n, v) for n, v in inputs.items() if v % preferred)
                logger.info(
                    "Group size %d: the default %d does not divide %s %d; %d is the largest that divides "
                    "every quantized layer's input (give --group-size to choose another).",
                    size,
                    preferred,
                    name,
                    value,
                    size,
                )
            return size
    return preferred


def check_shapes(config, quant_type: str, group_size: int, tp_size: int) -> None:
    """Refuse a model whose shapes the method's layout cannot hold, or that cannot be split
    over `tp_size` ranks: heads, KV heads and intermediate size split evenly; 4-bit formats pack
    eight output channels per int32 and need whole groups in each rank's share of the input of
    the row-parallel layers (o_proj, down_proj)."""
    if tp_size < 1:
        raise ValueError(f"-tp {tp_size}: the tensor-parallel size must be at least 1.")
    moe_experts.check_moe(config, quant_type)
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    sizes = [(n, getattr(config, n)) for n in _intermediate_sizes(config)]
    for name, value in [("num_attention_heads", heads), ("num_key_value_heads", kv_heads), *sizes]:
        if value % tp_size:
            raise ValueError(f"{name} {value} is not divisible by -tp {tp_size}.")
    if quant_type not in ("awq", "gptq"):
        return
    per_rank = " per rank" if tp_size > 1 else ""
    inputs = _group_inputs(config, tp_size)
    for name, value in inputs.items():
        if value % group_size:
            fits = [g for g in (64, 32, 16) if g < group_size and all(v % g == 0 for v in inputs.values())]
            hint = f"pass --group-size {fits[0]}" if fits else "no usual group size fits"
            raise ValueError(f"{name} {value} is not divisible by --group-size {group_size}; {hint}.")
    outputs = {
        "q_proj": heads * head_dim // tp_size,
        "k_proj/v_proj": kv_heads * head_dim // tp_size,
        **{f"gate_proj/up_proj ({name})": value // tp_size for name, value in sizes},
        "o_proj/down_proj": hidden,
    }
    for name, value in outputs.items():
        if value % 8:
            raise ValueError(
                f"{name}'s output size{per_rank} {value} is not a multiple of 8, which the "
                f"{quant_type} layout packs into each int32."
            )


def quantize_model(
    model: torch.nn.Module,
    quant_type: str,
    sequences: list[list[int]] | None,
    *,
    alpha: float | None,
    group_size: int,
    sym: bool,
    desc_act: bool,
    sequential: bool = False,
    awq_scales: bool = False,
    damp_percent: float = GPTQ_DAMP_PERCENT,
    clip_search: bool = False,
) -> dict[str, dict[str, torch.Tensor]]:
    """Calibrate (if the method needs it), transform the model in place as the method says, and
    return the checkpoint tensors of every quantized linear: {name: {suffix: tensor}}. With
    `sequential` (awq, gptq), layer by layer on the quantized earlier layers' outputs (sequential.py);
    with `awq_scales` (gptq, sequential), AWQ's scales are folded into each layer before GPTQ rounds it."""
    layers = algorithms.decoder_groups(model)
    options = dict(
        group_size=group_size, sym=sym, desc_act=desc_act, damp_percent=damp_percent, clip_search=clip_search
    )
    if sequences is not None and quant_type == "gptq":
        _warn_short_calibration(sequences, layers)
    if sequential and sequences is not None and quant_type in ("awq", "gptq"):
        logger.info("Calibrating layer by layer on %d sequences (%d tokens)", len(sequences), sum(map(len, sequences)))

        seen: dict = {}

        def quantize_layer(groups, collect):
            stats, clips = collect(), {}
            seen.update(stats)
            if quant_type == "awq":
                clips = algorithms.awq_scale_layer(groups, stats, group_size)[1]
            elif awq_scales:  # GPTQ on the rescaled weights, with the Hessians of their rescaled inputs
                algorithms.awq_scale_layer(groups, stats, group_size, clip=False, rescale_stats=True)
            plains = {}
            for group in groups:
                plains.update(_quantize_group(group, quant_type, stats, clips=clips, **options))
            return plains

        plains = quantize_sequentially(model, layers, sequences, quantize_layer)
        moe_experts.log_unreached(seen, moe_experts.expert_sites(layers))
        return {name: _pack(quant_type, plain) for name, plain in plains.items()}

    stats, clips = None, {}
    if sequences is not None:
        # One pass of the float model. SmoothQuant's and AWQ's scalings keep the float model's
        # function, so its activations stay the right ones (divided by s, which the algorithms
        # account for). GPTQ's Hessians are therefore those of the float model's inputs, not of
        # the already quantized earlier layers' (that is `sequential`).
        logger.info("Calibrating on %d sequences (%d tokens)", len(sequences), sum(map(len, sequences)))
        # GPTQ and AWQ's clipping need every linear's input; SmoothQuant only those it can rescale.
        sites = {
            g.site: next(iter(g.linears.values()))
            for groups in layers
            for g in groups
            if quant_type in ("gptq", "awq") or g.prev is not None
        }
        stats = collect_input_stats(
            model,
            sites,
            sequences,
            gram=quant_type in ("gptq", "awq"),
            folds=smoothquant.SEARCH_FOLDS if quant_type == "smooth_quant" and alpha is None else 1,
        )
        moe_experts.log_unreached(stats, moe_experts.expert_sites(layers))
    if quant_type == "smooth_quant":
        _log_strengths(smoothquant.smooth_model(model, stats, sequences, alpha), alpha)
    elif quant_type == "awq":
        ratios, clips = algorithms.awq_scale_model(model, stats, group_size)
        logger.info("AWQ scaled %d linear groups; mean exponent %.2f", len(ratios), sum(ratios) / max(len(ratios), 1))

    result = {}
    for groups in tqdm(layers, desc=f"Quantizing ({quant_type})", unit="layer"):
        for group in groups:
            plains = _quantize_group(group, quant_type, stats, clips=clips, **options)
            result.update({name: _pack(quant_type, plain) for name, plain in plains.items()})
    return result


def _warn_short_calibration(sequences: list[list[int]], layers: list[list[algorithms.InputGroup]]) -> None:
    tokens = sum(map(len, sequences))
    widest = max(m.in_features for groups in layers for g in groups for m in g.linears.values())
    if tokens < widest:
        logger.warning(
            "GPTQ: %d calibration tokens for inputs of up to %d channels make rank-deficient "
            "Hessians, which it may overfit; give more data with --tokenids-path.",
            tokens,
            widest,
        )


def _log_strengths(chosen: dict[str, float], alpha: float | None) -> None:
    """The mean strength each kind of group took, e.g. `down_proj 0.46`."""
    if alpha is not None:
        logger.info("Smoothed %d linear groups with strength %.2f (-sq)", len(chosen), alpha)
        return
    by_kind: dict[str, list[float]] = {}
    for site, strength in chosen.items():
        by_kind.setdefault(site.rsplit(".", 1)[-1], []).append(strength)
    means = ", ".join(f"{kind} {sum(v) / len(v):.2f}" for kind, v in by_kind.items())
    logger.info(
        "Smoothed %d linear groups; mean strength (-sq auto: searched up to %.2f) by input: %s",
        len(chosen),
        smoothquant.AUTO_MAX_STRENGTH,
        means,
    )


def _quantize_group(
    group: algorithms.InputGroup,
    quant_type: str,
    stats,
    *,
    group_size: int,
    sym: bool,
    desc_act: bool,
    damp_percent: float,
    clip_search: bool,
    clips: dict[str, torch.Tensor],
) -> dict[str, Int4Weight | tuple[torch.Tensor, torch.Tensor]]:
    """The plain quantized form of each linear of the group: an Int4Weight (awq, gptq) or int8
    levels and row scales."""
    if quant_type == "gptq":
        # The linears of a group share one Hessian (their input), and GPTQ treats rows independently.
        hessian = 2.0 * stats[group.site].second_moment()  # GPTQ's H = 2 X^T X / n
        stacked = gptq.gptq_quantize(
            group.weight(),
            hessian,
            group_size,
            sym=sym,
            desc_act=desc_act,
            damp_percent=damp_percent,
            clip_search=clip_search,
        )
        parts = gptq.split_rows(stacked, [m.out_features for m in group.linears.values()])
        return dict(zip(group.linears, parts))
    result = {}
    for name, linear in group.linears.items():
        weight = linear.weight.detach().float()
        if quant_type == "awq" and name in clips:
            result[name] = clipping.quantize_int4_clipped(weight, group_size, clips[name])
        elif quant_type == "awq":
            result[name] = quantize_int4_groupwise(weight, group_size, sym=False)
        else:
            result[name] = quantize_int8_per_channel(weight)
    return result


def _pack(quant_type: str, plain) -> dict[str, torch.Tensor]:
    if quant_type == "gptq":
        return pack_gptq(plain)
    if quant_type == "awq":
        return pack_awq(plain)
    q, scale = plain
    return {"weight": q, "weight_scale": scale}
