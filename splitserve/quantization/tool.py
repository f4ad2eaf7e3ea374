"""`splitserve quantize`: quantize a Hugging Face model or a .gguf file offline into a Hugging Face
directory the engine (and other engines) can load: weight-only int8, SmoothQuant W8A8, or 4-bit
AWQ / GPTQ in the checkpoint layouts of AutoAWQ ("gemm") and AutoGPTQ.

Calibration runs transformers' float32 model on the CPU. Embeddings and lm_head stay unquantized;
what is not quantized is stored in the `-t` dtype."""
from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
from tqdm.auto import tqdm

from splitserve.quantization import algorithms
from splitserve.quantization.calibration import builtin_sequences, collect_input_stats, read_token_ids
from splitserve.quantization.packing import pack_awq, pack_gptq, quantize_int4_groupwise, quantize_int8_per_channel

logger = logging.getLogger(__name__)

QUANT_TYPES = ("weight_only_int8", "smooth_quant", "awq", "gptq")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
DEFAULT_SMOOTHING = 0.8
DEFAULT_GROUP_SIZE = 128
GPTQ_DAMP_PERCENT = 0.01


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input", required=True, help="Hugging Face model directory or .gguf file")
    parser.add_argument("-o", "--output", required=True, help="directory to write the quantized model to")
    parser.add_argument("--quant-type", "--quant_type", "-quant_type", dest="quant_type", required=True,
                        choices=QUANT_TYPES, metavar="TYPE", help=f"quantization method: {', '.join(QUANT_TYPES)}")
    parser.add_argument("-t", "--dtype", default="bf16", choices=list(DTYPES), metavar="DTYPE",
                        help="bf16 (default), fp16 or fp32 (or bfloat16, float16, float32): storage dtype of "
                             "what stays unquantized (embeddings, norms, lm_head, biases)")
    parser.add_argument("-tp", "--tp-size", "--tp_size", dest="tp_size", type=int, default=1,
                        help="check that the result can be served with this tensor-parallel size")
    parser.add_argument("-sq", "--smoothquant", type=float, default=None,
                        help=f"SmoothQuant smoothing strength alpha in [0, 1] (default {DEFAULT_SMOOTHING}; "
                             "smooth_quant only)")
    parser.add_argument("--tokenids-path", "--tokenids_path", "-token", dest="tokenids_path",
                        help="calibration token ids, one sequence per line, separated by whitespace or commas "
                             "(lines longer than --seq-len are cut); default: a built-in text")
    parser.add_argument("--multi-query-mode", action="store_true",
                        help="accepted for TensorRT-LLM compatibility; the KV heads come from the config")
    parser.add_argument("--group-size", type=int, default=None,
                        help=f"input channels per scale for awq / gptq (default {DEFAULT_GROUP_SIZE})")
    parser.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                        help="gptq: symmetric levels (zero point fixed at 8; default) or asymmetric")
    parser.add_argument("--desc-act", action=argparse.BooleanOptionalAction, default=None,
                        help="gptq: quantize columns in order of decreasing activation energy (act-order)")
    parser.add_argument("--num-samples", type=int, default=128, help="most calibration sequences")
    parser.add_argument("--seq-len", type=int, default=512, help="most tokens per calibration sequence")


def main(ns: argparse.Namespace) -> str:
    """Quantize as `ns` says; returns the output directory."""
    from splitserve.loader.hf_model import load_hf_model
    from splitserve.loader.resolve import load_hf_config, split_gguf
    from splitserve.tokenizer import get_tokenizer

    start = time.perf_counter()
    source, output = _check_paths(ns.input, ns.output)
    _check_options(ns)
    config = load_hf_config(source)
    group_size = ns.group_size or DEFAULT_GROUP_SIZE
    check_shapes(config, ns.quant_type, group_size, ns.tp_size)
    if ns.multi_query_mode:
        logger.info("--multi-query-mode: the model's %d KV heads are read from its config.",
                    getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    tokenizer = get_tokenizer(source)
    sequences = None
    if ns.quant_type != "weight_only_int8":
        if ns.tokenids_path:
            sequences = read_token_ids(ns.tokenids_path, config.vocab_size, ns.seq_len, ns.num_samples)
        else:
            sequences = builtin_sequences(tokenizer, config.vocab_size, ns.seq_len, ns.num_samples)
    model = load_hf_model(*split_gguf(source), torch.float32)
    logger.info("Loaded %s (%d decoder layers) in %.1f s", source, config.num_hidden_layers,
                time.perf_counter() - start)

    began = time.perf_counter()
    alpha = DEFAULT_SMOOTHING if ns.smoothquant is None else ns.smoothquant
    sym = True if ns.sym is None else ns.sym
    linears = quantize_model(model, ns.quant_type, sequences, alpha=alpha, group_size=group_size, sym=sym,
                             desc_act=bool(ns.desc_act))
    logger.info("Quantized %d linear layers with %s in %.1f s", len(linears), ns.quant_type,
                time.perf_counter() - began)

    qc = quantization_config(ns.quant_type, alpha=alpha, group_size=group_size, sym=sym,
                             desc_act=bool(ns.desc_act), tp_size=ns.tp_size)
    size = write_checkpoint(model, tokenizer, output, DTYPES[ns.dtype], linears, qc)
    logger.info("Wrote %s (%.1f MB) in %.1f s in all", output, size / 1e6, time.perf_counter() - start)
    return output


def _check_paths(source: str, output: str) -> tuple[str, str]:
    source = os.path.abspath(os.path.expanduser(source))
    if not os.path.exists(source):
        raise FileNotFoundError(f"Input {source} does not exist: give a Hugging Face model directory or a .gguf file.")
    if os.path.isfile(source) and not source.endswith(".gguf"):
        raise ValueError(f"Input {source} is a file but not a .gguf file.")
    output = os.path.abspath(os.path.expanduser(output))
    if output == (source if os.path.isdir(source) else os.path.dirname(source)):
        raise ValueError(f"The output directory {output} is the input's directory; choose another one.")
    return source, output


def _check_options(ns: argparse.Namespace) -> None:
    """Refuse impossible values; warn about options the chosen method ignores."""
    if ns.num_samples < 1 or ns.seq_len < 1:
        raise ValueError("--num-samples and --seq-len must be at least 1.")
    if ns.smoothquant is not None and not 0.0 <= ns.smoothquant <= 1.0:
        raise ValueError(f"-sq {ns.smoothquant}: the smoothing strength must be within [0, 1].")
    if ns.group_size is not None and (ns.group_size < 8 or ns.group_size % 8):
        raise ValueError(f"--group-size {ns.group_size}: must be a positive multiple of 8 (usually 32, 64 or 128).")
    ignored = []
    if ns.smoothquant is not None and ns.quant_type != "smooth_quant":
        ignored.append("-sq (smooth_quant only; AWQ searches its own scales)")
    if ns.group_size is not None and ns.quant_type not in ("awq", "gptq"):
        ignored.append("--group-size (awq and gptq only)")
    if ns.sym is not None and ns.quant_type != "gptq":
        ignored.append("--sym/--no-sym (gptq only; awq is always asymmetric)")
    if ns.desc_act is not None and ns.quant_type != "gptq":
        ignored.append("--desc-act (gptq only)")
    if ns.tokenids_path and ns.quant_type == "weight_only_int8":
        ignored.append("--tokenids-path (weight_only_int8 needs no calibration)")
    for option in ignored:
        logger.warning("Ignoring %s.", option)


def check_shapes(config, quant_type: str, group_size: int, tp_size: int) -> None:
    """Refuse a model whose shapes the method's layout cannot hold, or that cannot be split
    over `tp_size` ranks: heads, KV heads and intermediate size split evenly; 4-bit formats pack
    eight output channels per int32 and need whole groups in each rank's share of the input of
    the row-parallel layers (o_proj, down_proj)."""
    if tp_size < 1:
        raise ValueError(f"-tp {tp_size}: the tensor-parallel size must be at least 1.")
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                        ("intermediate_size", inter)):
        if value % tp_size:
            raise ValueError(f"{name} {value} is not divisible by -tp {tp_size}.")
    if quant_type not in ("awq", "gptq"):
        return
    per_rank = " per rank" if tp_size > 1 else ""
    inputs = {"hidden_size (the input of q/k/v/gate/up_proj)": hidden,
              f"o_proj's input size{per_rank} ({heads} heads x {head_dim} / {tp_size})": heads * head_dim // tp_size,
              f"down_proj's input size{per_rank} (intermediate_size / {tp_size})": inter // tp_size}
    for name, value in inputs.items():
        if value % group_size:
            fits = [g for g in (64, 32, 16) if g < group_size and all(v % g == 0 for v in inputs.values())]
            hint = f"pass --group-size {fits[0]}" if fits else "no usual group size fits"
            raise ValueError(f"{name} {value} is not divisible by --group-size {group_size}; {hint}.")
    outputs = {"q_proj": heads * head_dim // tp_size, "k_proj/v_proj": kv_heads * head_dim // tp_size,
               "gate_proj/up_proj": inter // tp_size, "o_proj/down_proj": hidden}
    for name, value in outputs.items():
        if value % 8:
            raise ValueError(f"{name}'s output size{per_rank} {value} is not a multiple of 8, which the "
                             f"{quant_type} layout packs into each int32.")


def quantize_model(model: torch.nn.Module, quant_type: str, sequences: list[list[int]] | None, *,
                   alpha: float, group_size: int, sym: bool, desc_act: bool) -> dict[str, dict[str, torch.Tensor]]:
    """Calibrate (if the method needs it), transform the model in place as the method says, and
    return the checkpoint tensors of every quantized linear: {name: {suffix: tensor}}."""
    layers = algorithms.decoder_groups(model)
    stats, clips = None, {}
    if sequences is not None:
        tokens = sum(map(len, sequences))
        # One pass of the float model. SmoothQuant's and AWQ's scalings keep the float model's
        # function, so its activations stay the right ones (divided by s, which the algorithms
        # account for). GPTQ's Hessians are therefore those of the float model's inputs, not of
        # the already quantized earlier layers' ("true sequential" is off).
        logger.info("Calibrating on %d sequences (%d tokens)", len(sequences), tokens)
        # GPTQ and AWQ's clipping need every linear's input; SmoothQuant only those it can rescale.
        sites = {g.site: next(iter(g.linears.values())) for groups in layers for g in groups
                 if quant_type in ("gptq", "awq") or g.prev is not None}
        stats = collect_input_stats(model, sites, sequences, gram=quant_type in ("gptq", "awq"))
        widest = max(m.in_features for m in sites.values())
        if quant_type == "gptq" and tokens < widest:
            logger.warning("GPTQ: %d calibration tokens for inputs of up to %d channels make rank-deficient "
                           "Hessians, which it may overfit; give more data with --tokenids-path.", tokens, widest)
    if quant_type == "smooth_quant":
        logger.info("Smoothed %d linear groups (alpha %.2f)", algorithms.smooth_model(model, stats, alpha), alpha)
    elif quant_type == "awq":
        ratios, clips = algorithms.awq_scale_model(model, stats, group_size)
        logger.info("AWQ scaled %d linear groups; mean exponent %.2f", len(ratios), sum(ratios) / max(len(ratios), 1))

    result = {}
    for groups in tqdm(layers, desc=f"Quantizing ({quant_type})", unit="layer"):
        for group in groups:
            result.update(_quantize_group(group, quant_type, stats, group_size=group_size, sym=sym, desc_act=desc_act,
                                          clips=clips))
    return result


def _quantize_group(group: algorithms.InputGroup, quant_type: str, stats, *, group_size: int, sym: bool,
                    desc_act: bool, clips: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    if quant_type == "gptq":
        # The linears of a group share one Hessian (their input), and GPTQ treats rows independently.
        hessian = 2.0 * stats[group.site].second_moment()  # GPTQ's H = 2 X^T X / n
        stacked = algorithms.gptq_quantize(group.weight(), hessian, group_size, sym=sym, desc_act=desc_act,
                                           damp_percent=GPTQ_DAMP_PERCENT)
        parts = algorithms.split_rows(stacked, [m.out_features for m in group.linears.values()])
        return {name: pack_gptq(part) for name, part in zip(group.linears, parts)}
    result = {}
    for name, linear in group.linears.items():
        weight = linear.weight.detach().float()
        if quant_type == "awq" and name in clips:
            result[name] = pack_awq(algorithms.quantize_int4_clipped(weight, group_size, clips[name]))
        elif quant_type == "awq":
            result[name] = pack_awq(quantize_int4_groupwise(weight, group_size, sym=False))
        else:
            q, scale = quantize_int8_per_channel(weight)
            result[name] = {"weight": q, "weight_scale": scale}
    return result


def quantization_config(quant_type: str, *, alpha: float, group_size: int, sym: bool, desc_act: bool,
                        tp_size: int) -> dict:
    """The config.json `quantization_config`; awq and gptq with the keys AutoAWQ / AutoGPTQ write."""
    if quant_type == "weight_only_int8":
        qc = {"quant_method": "weight_only_int8", "bits": 8}
    elif quant_type == "smooth_quant":
        qc = {"quant_method": "smooth_quant", "bits": 8, "smoothing_strength": alpha,
              "activation_scheme": "dynamic_per_token"}
    elif quant_type == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "damp_percent": GPTQ_DAMP_PERCENT, "true_sequential": False, "checkpoint_format": "gptq"}
    qc["tensor_parallel_size"] = tp_size
    return qc


def write_checkpoint(model: torch.nn.Module, tokenizer, output: str, dtype: torch.dtype,
                     linears: dict[str, dict[str, torch.Tensor]], qc: dict) -> int:
    """A clean Hugging Face directory: config.json (from the model's config, without GGUF
    leftovers), model.safetensors, tokenizer and generation config. Returns its size in bytes."""
    from safetensors.torch import save_file

    os.makedirs(output, exist_ok=True)
    output_embeddings = model.get_output_embeddings()
    tied = output_embeddings is not None and output_embeddings.weight is model.get_input_embeddings().weight
    replaced = {f"{name}.weight" for name in linears}
    tensors = {key: value.detach().to(dtype).contiguous() for key, value in model.state_dict().items()
               if key not in replaced and not (tied and key == "lm_head.weight")}
    for name, parts in linears.items():
        for suffix, tensor in parts.items():
            tensors[f"{name}.{suffix}"] = tensor.contiguous()
    save_file(tensors, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_diff_dict()
    for key in ("_name_or_path", "_model_name_or_path", "quantization_config"):  # GGUF / source leftovers
        config.pop(key, None)
    dtype_name = str(dtype).removeprefix("torch.")
    config.update(architectures=[type(model).__name__], dtype=dtype_name, torch_dtype=dtype_name,
                  tie_word_embeddings=tied, quantization_config=qc)
    with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    tokenizer.save_pretrained(output)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(output)
    return sum(os.path.getsize(os.path.join(output, n)) for n in os.listdir(output)
               if os.path.isfile(os.path.join(output, n)))
