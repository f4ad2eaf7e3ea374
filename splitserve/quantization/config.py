"""Which quantization a model runs with: the checkpoint's `quantization_config`, or `--quantization`
applied while loading, and the linear method each layer gets from it."""

from __future__ import annotations

from splitserve.layers.basic import LinearMethod
from splitserve.quantization.linear import Fp8Method, Int4Method, Int8WeightOnlyMethod, W8A8Int8Method

QUANTIZATION_METHODS = ("weight_only_int8", "smooth_quant", "awq", "gptq", "fp8")
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
    ):
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization={method!r} is not supported; choose one of {QUANTIZATION_METHODS}.")
        self.method = method
        self.from_checkpoint = from_checkpoint
        self.group_size = group_size
        self.modules_to_not_convert = list(modules_to_not_convert or [])

    def __repr__(self) -> str:
        source = "checkpoint" if self.from_checkpoint else "quantized while loading"
        return f"QuantizationConfig({self.method}, {source})"

    def linear_method(self, prefix: str) -> LinearMethod | None:
        if any(skip in prefix for skip in self.modules_to_not_convert):
            return None
        if self.method == "weight_only_int8":
            return Int8WeightOnlyMethod(self.from_checkpoint)
        if self.method == "smooth_quant":
            return W8A8Int8Method(self.from_checkpoint)
        if self.method == "fp8":
            return Fp8Method(self.from_checkpoint)
        return Int4Method(self.method, self.group_size, self.from_checkpoint)


def quantization_config_for(hf_config, requested: str | None, load_format: str) -> QuantizationConfig | None:
    """The checkpoint's quantization (its `quantization_config`), checked against `--quantization`;
    or the requested method applied while loading an unquantized checkpoint."""
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
        return QuantizationConfig(method, from_checkpoint, group_size, qc.get("modules_to_not_convert"))
    return QuantizationConfig(method, from_checkpoint, modules_to_not_convert=(qc or {}).get("modules_to_not_convert"))
