"""`splitserve quantize -i MODEL -o OUT --quant-type ...`: the command line of the offline quantizer
(splitserve/quantization/tool.py)."""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from splitserve.quantization.calibration import builtin_sequences, read_text_sequences, read_token_ids
from splitserve.quantization.checkpoint import quantization_config, write_checkpoint
from splitserve.quantization.moe_experts import unfuse_experts
from splitserve.quantization.tool import (
    GPTQ_DAMP_PERCENT,
    GPTQ_DAMP_PERCENT_ONE_PASS,
    check_shapes,
    default_awq_scales,
    default_clip_search,
    default_damp_percent,
    default_group_size,
    quantize_model,
)

logger = logging.getLogger(__name__)

QUANT_TYPES = ("weight_only_int8", "smooth_quant", "awq", "gptq")
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
DEFAULT_GROUP_SIZE = 128
# awq and gptq calibrate layer by layer on the quantized earlier layers (quantization/sequential.py).
SEQUENTIAL_DEFAULT = True


def _smoothing_strength(text: str) -> float | str:
    """-sq: 'auto' or a strength in [0, 1]."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text}: the smoothing strength must be within [0, 1]")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input", required=True, help="Hugging Face model directory or .gguf file")
    parser.add_argument("-o", "--output", required=True, help="directory to write the quantized model to")
    parser.add_argument(
        "--quant-type",
        "--quant_type",
        "-quant_type",
        dest="quant_type",
        required=True,
        choices=QUANT_TYPES,
        metavar="TYPE",
        help=f"quantization method: {', '.join(QUANT_TYPES)}",
    )
    parser.add_argument(
        "-t",
        "--dtype",
        default="bf16",
        choices=list(DTYPES),
        metavar="DTYPE",
        help="bf16 (default), fp16 or fp32 (or bfloat16, float16, float32): storage dtype of "
        "what stays unquantized (embeddings, norms, lm_head, biases)",
    )
    parser.add_argument(
        "-tp",
        "--tp-size",
        "--tp_size",
        dest="tp_size",
        type=int,
        default=1,
        help="check that the result can be served with this tensor-parallel size",
    )
    parser.add_argument(
        "-sq",
        "--smoothquant",
        type=_smoothing_strength,
        default=None,
        help="SmoothQuant smoothing strength: a number in [0, 1] for every linear group (AIAK's document "
        "recommends 0.8 or 0.75 by model), or auto (the default): each group's strength searched up to "
        "0.8 by its held-out W8A8 error (smooth_quant only)",
    )
    parser.add_argument(
        "--tokenids-path",
        "--tokenids_path",
        "-token",
        dest="tokenids_path",
        help="calibration token ids, one sequence per line, separated by whitespace or commas "
        "(lines longer than --seq-len are cut); default: the built-in calibration corpus",
    )
    parser.add_argument(
        "--calib-data",
        help="calibration text: a UTF-8 file, tokenized and cut into --seq-len sequences (instead of the "
        "built-in corpus of about 4,500 tokens of varied text)",
    )
    parser.add_argument(
        "--multi-query-mode",
        action="store_true",
        help="accepted for TensorRT-LLM compatibility; the KV heads come from the config",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help=f"input channels per scale for awq / gptq (default {DEFAULT_GROUP_SIZE})",
    )
    parser.add_argument(
        "--sym",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gptq: symmetric levels (zero point fixed at 8; what some GPTQ kernels elsewhere require) or "
        "asymmetric (the default)",
    )
    parser.add_argument(
        "--desc-act",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gptq: quantize columns in order of decreasing activation energy (act-order; the default)",
    )
    parser.add_argument(
        "--sequential",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="awq, gptq: calibrate layer by layer on the quantized earlier layers' outputs "
        "(llm-compressor's sequential pipeline) instead of on one pass of the float model",
    )
    parser.add_argument(
        "--awq-scales",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gptq (with --sequential): fold AWQ's activation-aware scales into each layer before GPTQ rounds it; "
        "default on from group size 64, off at 32 (docs/quantization.md has the measurements)",
    )
    parser.add_argument(
        "--damp-percent",
        type=float,
        default=None,
        help=f"gptq: dampening added to the Hessian's diagonal, as a share of its mean (AutoGPTQ's damp_percent; "
        f"default {GPTQ_DAMP_PERCENT} layer by layer, {GPTQ_DAMP_PERCENT_ONE_PASS} with --no-sequential: "
        "docs/quantization.md has the measurements)",
    )
    parser.add_argument(
        "--clip-search",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gptq: round each group over the clipped range that rounds it best, weighted by its inputs (AWQ's "
        "clipping, in GPTQ); default on from group size 64, off at 32 (docs/quantization.md has the measurements)",
    )
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
    group_size = ns.group_size
    if group_size is None:
        group_size = DEFAULT_GROUP_SIZE
        if ns.quant_type in ("awq", "gptq"):
            group_size = default_group_size(config, ns.tp_size, DEFAULT_GROUP_SIZE)
    check_shapes(config, ns.quant_type, group_size, ns.tp_size)
    if ns.multi_query_mode:
        logger.info(
            "--multi-query-mode: the model's %d KV heads are read from its config.",
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        )

    tokenizer = get_tokenizer(source)
    sequences = None
    if ns.quant_type != "weight_only_int8":
        if ns.tokenids_path:
            sequences = read_token_ids(ns.tokenids_path, config.vocab_size, ns.seq_len, ns.num_samples)
        elif ns.calib_data:
            sequences = read_text_sequences(ns.calib_data, tokenizer, config.vocab_size, ns.seq_len, ns.num_samples)
        else:
            sequences = builtin_sequences(tokenizer, config.vocab_size, ns.seq_len, ns.num_samples)
    model = load_hf_model(*split_gguf(source), torch.float32, config=config)
    moe_layers = unfuse_experts(model)  # each expert's matrices as Linears (quantization/moe_experts.py)
    if moe_layers:
        logger.info("Mixture of experts: %d layers' experts, each calibrated on the tokens routed to it", moe_layers)
    logger.info(
        "Loaded %s (%d decoder layers) in %.1f s", source, config.num_hidden_layers, time.perf_counter() - start
    )

    began = time.perf_counter()
    alpha = None if ns.smoothquant in (None, "auto") else ns.smoothquant  # None: the search
    # GPTQ's defaults: asymmetric levels and act-order, which generalize best (docs/quantization.md)
    sym = False if ns.sym is None else ns.sym
    desc_act = True if ns.desc_act is None else ns.desc_act
    damp = default_damp_percent(_sequential(ns)) if ns.damp_percent is None else ns.damp_percent
    linears = quantize_model(
        model,
        ns.quant_type,
        sequences,
        alpha=alpha,
        group_size=group_size,
        sym=sym,
        desc_act=desc_act,
        sequential=_sequential(ns),
        awq_scales=default_awq_scales(group_size, _sequential(ns)) if ns.awq_scales is None else ns.awq_scales,
        damp_percent=damp,
        clip_search=default_clip_search(group_size) if ns.clip_search is None else ns.clip_search,
    )
    logger.info(
        "Quantized %d linear layers with %s in %.1f s", len(linears), ns.quant_type, time.perf_counter() - began
    )

    qc = quantization_config(
        ns.quant_type,
        alpha=alpha,
        group_size=group_size,
        sym=sym,
        desc_act=desc_act,
        tp_size=ns.tp_size,
        damp_percent=damp,
    )
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


def _sequential(ns: argparse.Namespace) -> bool:
    return SEQUENTIAL_DEFAULT if ns.sequential is None else ns.sequential


def _check_options(ns: argparse.Namespace) -> None:
    """Refuse impossible values; warn about options the chosen method ignores."""
    if ns.num_samples < 1 or ns.seq_len < 1:
        raise ValueError("--num-samples and --seq-len must be at least 1.")
    if ns.tokenids_path and ns.calib_data:
        raise ValueError("Give calibration data once: --tokenids-path (token ids) or --calib-data (text).")
    if ns.group_size is not None and (ns.group_size < 8 or ns.group_size % 8):
        raise ValueError(f"--group-size {ns.group_size}: must be a positive multiple of 8 (usually 32, 64 or 128).")
    if ns.damp_percent is not None and not ns.damp_percent > 0:
        raise ValueError(f"--damp-percent {ns.damp_percent}: must be positive (0.01 to 1 are usual).")
    if ns.awq_scales and ns.quant_type == "gptq" and not _sequential(ns):
        raise ValueError("--awq-scales works layer by layer: it needs --sequential (drop --no-sequential).")
    ignored = []
    if ns.smoothquant is not None and ns.quant_type != "smooth_quant":
        ignored.append("-sq (smooth_quant only; AWQ searches its own scales)")
    if ns.group_size is not None and ns.quant_type not in ("awq", "gptq"):
        ignored.append("--group-size (awq and gptq only)")
    if ns.sym is not None and ns.quant_type != "gptq":
        ignored.append("--sym/--no-sym (gptq only; awq is always asymmetric)")
    if ns.desc_act is not None and ns.quant_type != "gptq":
        ignored.append("--desc-act (gptq only)")
    if ns.sequential is not None and ns.quant_type not in ("awq", "gptq"):
        ignored.append("--sequential (awq and gptq only)")
    if ns.damp_percent is not None and ns.quant_type != "gptq":
        ignored.append("--damp-percent (gptq only)")
    if ns.clip_search is not None and ns.quant_type != "gptq":
        ignored.append("--clip-search (gptq only; awq searches its clipping anyway)")
    if ns.awq_scales is not None and ns.quant_type != "gptq":
        ignored.append("--awq-scales (gptq only; awq folds its scales anyway)")
    if ns.tokenids_path and ns.quant_type == "weight_only_int8":
        ignored.append("--tokenids-path (weight_only_int8 needs no calibration)")
    if ns.calib_data and ns.quant_type == "weight_only_int8":
        ignored.append("--calib-data (weight_only_int8 needs no calibration)")
    for option in ignored:
        logger.warning("Ignoring %s.", option)
