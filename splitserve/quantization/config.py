"""Which quantization a model runs with: the checkpoint's `quantization_config`, or `--quantization`
applied while loading, and the linear method each layer gets from it."""

from __future__ import annotations

import re

from splitserve.layers.basic import LinearMethod
from splitserve.quantization import compressed_tensors
from splitserve.quantization.gguf import GGUFLinearMethod
from splitserve.quantization.int4_linear import Int4Method
from splitserve.quantization.linear import Fp8Method, Int8WeightOnlyMethod, W8A8Int8Method

QUANTIZATION_METHODS = ("weight_only_int8", "smooth_quant", "awq", "gptq", "compressed-tensors", "fp8", "gguf")
# --quantization none: run a quantized GGUF file dequantized to --dtype instead of in its blocks.
NO_QUANTIZATION = "none"
# Methods that can quantize an unquantized checkpoint while loading it (no calibration needed).
ONLINE_METHODS = ("weight_only_int8", "fp8")


class QuantizationConfig:
    """What the checkpoint's `quantization_config` (or `--quantization`) says about its linears."""

    def __init__(
        self,
        method: str,
        from_checkpoint: bool = True,
        group_size: int = -1,
        modules_to_not_convert: list[str] | None = None,
        act_order: bool = False,
    ):
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization={method!r} is not supported; choose one of {QUANTIZATION_METHODS}.")
        self.method = method
        self.from_checkpoint = from_checkpoint
        self.group_size = group_size
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.act_order = act_order  # a g_idx per input channel (GPTQ's desc_act, compressed-tensors' actorder group)

    def __repr__(self) -> str:
        source = "checkpoint" if self.from_checkpoint else "quantized while loading"
        return f"QuantizationConfig({self.method}, {source})"

    def linear_method(self, prefix: str) -> LinearMethod | None:
        if any(_skips(skip, prefix) for skip in self.modules_to_not_convert):
            return None
        if self.method == "weight_only_int8":
            return Int8WeightOnlyMethod(self.from_checkpoint)
        if self.method == "smooth_quant":
            return W8A8Int8Method(self.from_checkpoint)
        if self.method == "fp8":
            return Fp8Method(self.from_checkpoint)
        if self.method == "gguf":
            return GGUFLinearMethod()
        return Int4Method(self.method, self.group_size, self.from_checkpoint)


def _skips(skip: str, prefix: str) -> bool:
    """A modules_to_not_convert / compressed-tensors `ignore` entry: a name part, or "re:" and a regex."""
    if skip.startswith("re:"):
        return re.match(skip[3:], prefix) is not None
    return skip in prefix


def quantization_config_for(
    hf_config, requested: str | None, load_format: str, gguf_quantized: bool = False, device_type: str = "cpu"
) -> QuantizationConfig | None:
    """The checkpoint's quantization (its `quantization_config`), checked against `--quantization`;
    or the requested method applied while loading an unquantized checkpoint. A .gguf file
    (`load_format` gguf) runs in its blocks (`gguf`) when it holds quantized matrices and the
    device is a CPU, unless `--quantization none` asks for it dequantized or an online method
    (weight_only_int8, fp8) for it requantized."""
    if load_format == "gguf" or requested == "gguf":
        return _gguf_quantization(requested, load_format, gguf_quantized, device_type)
    if requested == NO_QUANTIZATION:
        return None
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    found = (qc or {}).get("quant_method")
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is not supported; choose one of {QUANTIZATION_METHODS}.")
    if found is not None and found not in QUANTIZATION_METHODS:
        raise ValueError(
            f"The checkpoint is quantized with {found!r}, which is not supported; supported: {QUANTIZATION_METHODS}."
        )
    if found and requested and found != requested:
        raise ValueError(f"--quantization {requested} was asked for, but the checkpoint is quantized with {found}.")
    method = found or requested
    if method is None:
        return None
    from_checkpoint = found is not None and load_format != "dummy"
    if not from_checkpoint and load_format != "dummy" and method not in ONLINE_METHODS:
        raise ValueError(
            f"quantization={method!r} needs a checkpoint quantized with it (calibrated offline): run "
            f"`splitserve quantize --quant-type {method}` first, or load a published {method} checkpoint. "
            f"Unquantized checkpoints can be quantized while loading with {ONLINE_METHODS}."
        )
    if method == compressed_tensors.METHOD:
        group_size, ignore, act_order = compressed_tensors.int4_settings(qc or {})
        return QuantizationConfig(method, from_checkpoint, group_size, ignore, act_order)
    if method in ("awq", "gptq"):
        qc = qc or {}
        bits = qc.get("bits", qc.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"{method} with {bits} bits is not supported (only 4-bit).")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"AWQ version {qc.get('version')!r} is not supported (only the 'gemm' layout).")
        if method == "gptq" and qc.get("checkpoint_format", "gptq") != "gptq":
            raise ValueError(f"GPTQ checkpoint_format {qc.get('checkpoint_format')!r} is not supported (only 'gptq').")
        group_size = qc.get("group_size", qc.get("q_group_size", 128))
        act_order = method == "gptq" and bool(qc.get("desc_act"))
        return QuantizationConfig(method, from_checkpoint, group_size, qc.get("modules_to_not_convert"), act_order)
    return QuantizationConfig(method, from_checkpoint, modules_to_not_convert=(qc or {}).get("modules_to_not_convert"))


def _gguf_quantization(requested: str | None, load_format: str, quantized: bool, device_type: str):
    if load_format != "gguf":
        raise ValueError("--quantization gguf needs a .gguf file.")
    if requested == NO_QUANTIZATION:
        return None
    if requested in ONLINE_METHODS:
        # The file's blocks are dequantized while loading, then quantized again with the method asked for.
        return QuantizationConfig(requested, from_checkpoint=False)
    if requested not in (None, "gguf"):
        raise ValueError(
            f"--quantization {requested} does not apply to a .gguf file: it runs in its own blocks (gguf), "
            f"dequantized to --dtype (--quantization none), or requantized while loading ({', '.join(ONLINE_METHODS)})."
        )
    if device_type == "cuda" and requested == "gguf":  # Q4_0/Q4_1/Q4_K in the W4A16 kernel, others dense (gguf.py)
        return QuantizationConfig("gguf") if quantized else None
    if device_type != "cpu":
        if requested == "gguf":
            raise ValueError(
                f"--quantization gguf runs on CPU and CUDA; on {device_type} the file is dequantized (leave it unset)."
            )
        return None
    return QuantizationConfig("gguf") if quantized else None


def check_tensor_parallel(quant_config: QuantizationConfig | None, tp_size: int) -> None:
    """Refuse, before anything loads, a checkpoint that cannot be split over `tp_size` ranks: with
    act-order, the input channels of one group are spread over every rank's share of o_proj's and
    down_proj's inputs, and the int4 kernels take whole groups."""
    if quant_config is not None and quant_config.act_order and tp_size > 1:
        raise ValueError(
            f"This {quant_config.method} checkpoint was quantized with act-order (desc_act: a group index per "
            f"input channel), whose groups cannot be split over {tp_size} tensor-parallel ranks. Serve it with "
            "--tensor-parallel-size 1 (--pipeline-parallel-size or --data-parallel-size spread it too), or use a "
            "checkpoint quantized without act-order (splitserve quantize --no-desc-act)."
        )
