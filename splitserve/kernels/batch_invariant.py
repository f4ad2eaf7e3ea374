"""Batch-invariant numerics on CPU (--batch-invariant): every row of a step is computed exactly as it
would be alone, so that a request's tokens never depend on what it is batched with, how its prompt
is chunked, whether its prefix was cached, or which instance of a PD deployment computes it.

What makes a row's result depend on the others, and what this mode does about it:
- Matrix products: oneDNN and MKL choose their kernel (and with it the order of the reduction over
  K) by the row count M; on the hosts measured, a product padded to a multiple of a few rows gives
  every row bit for bit the same result whatever M is (bfloat16: 2, float32: 4 on AVX512-BF16).
  `enable()` finds that multiple on this host, for the model's own weight shapes (a probe of a few
  hundred milliseconds), and every CPU product then pads its rows to it (row_buckets.py); no
  multiple up to 64 is an error, not a silent fallback.
- GGUF weights: the integer path (8-bit activations, kernels/gguf_products.cpp) for every row
  count, instead of switching to dequantized tiles for larger batches.
- Attention: prompt rows go through the prefill kernel, whose result for a row does not depend on
  the chunk it is in (it walks keys from position 0 in fixed tiles), decode rows through the decode
  kernel, one request per work item; speculative decoding verifies drafts as decode rows.
Not covered (docs/determinism.md): a request preempted and recomputed (its output tokens are then
computed by the prefill kernel), quantized KV caches (the torch reference's SDPA), and CUDA.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

logger = logging.getLogger(__name__)

_MULTIPLES = (1, 2, 4, 8, 16, 32, 64)
_PROBE_ROWS = (1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 64)
_ALONE_ROWS = 32  # rows whose results alone are compared: a different reduction order shows in few of the
# rounded outputs, so many rows are compared
# "multiple": the padding of products whose weight was not probed; "by_weight": id(weight) ->
# (weight, its multiple), each weight padded as little as its own shape needs.
_state: dict[str, object] = {"multiple": None, "by_weight": {}, "step": None}


def enabled() -> bool:
    return _state["multiple"] is not None


def row_multiple(weight: torch.Tensor | None = None) -> int:
    """The row count a CPU product with `weight` is padded to a multiple of (1 when the mode is off;
    the largest any probed weight needs for a product whose weight is not given or not probed)."""
    entry = _state["by_weight"].get(id(weight)) if weight is not None else None
    return entry[1] if entry is not None else _state["multiple"] or 1


def padded_row_count(m: int, weight: torch.Tensor | None = None) -> int:
    multiple = row_multiple(weight)
    return -(-max(m, 1) // multiple) * multiple


def disable() -> None:
    _state["multiple"], _state["by_weight"] = None, {}


@contextlib.contextmanager
def step_rows(num_tokens: int, num_decodes: int):
    """Within it, products of num_tokens rows are the step's tokens: the first num_decodes are
    generated tokens, the rest prompt tokens (GGUF products pick their path by that: `prompt_rows`)."""
    previous, _state["step"] = _state["step"], (num_tokens, num_decodes)
    try:
        yield
    finally:
        _state["step"] = previous


def prompt_rows(m: int) -> int:
    """Where the prompt tokens begin among the m rows of a product (m when there are none: a product
    outside the layers' forward, such as the LM head's, or a step of decodes only)."""
    step = _state["step"]
    return step[1] if step is not None and step[0] == m else m


def enable(model: torch.nn.Module, device: torch.device) -> None:
    """Turn the mode on for this process, padding products to the smallest row multiple that the
    probe finds invariant for the model's weight shapes and dtype."""
    if device.type != "cpu":
        raise ValueError(
            f"--batch-invariant is implemented for CPUs; on {device.type} the products' reduction order still "
            "depends on the batch."
        )
    start = time.perf_counter()
    by_weight, needed = {}, {}
    for shape, (product, weights) in _model_products(model).items():
        multiple = next((m for m in _MULTIPLES if _invariant(product, m)), None)
        if multiple is None:
            raise RuntimeError(
                f"--batch-invariant: this host's products of {shape} give rows results that depend on the row count "
                f"even padded to {_MULTIPLES[-1]} rows; the mode cannot be guaranteed here."
            )
        needed[shape] = multiple
        by_weight.update({id(w): (w, multiple) for w in weights})
    _state["by_weight"], _state["multiple"] = by_weight, max(needed.values(), default=1)
    logger.info(
        "Batch-invariant numerics: products padded to multiples of %s rows (probed in %.2f s on %d weight shapes)",
        sorted(set(needed.values())) or [1],
        time.perf_counter() - start,
        len(needed),
    )


def _model_products(model: torch.nn.Module) -> dict:
    """The model's dense linears, LM head and GGUF tile products, by shape: shape -> (one product to
    probe, (K, dtype, x -> x @ W.T); every weight of that shape)."""
    found: dict = {}

    def add(key, weight, product):
        found.setdefault(key, (product, []))[1].append(weight)

    for module in model.modules():
        packed, weight = getattr(module, "packed_weight", None), getattr(module, "weight", None)
        if packed is not None:
            k = getattr(module, "in_features", None) or module.dim
            rows = getattr(module, "out_features", None) or getattr(module, "rows_per_rank", None)
            add(("packed", rows, k, packed.dtype), packed, (k, packed.dtype, lambda x, p=packed: _packed_product(x, p)))
        elif isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16):
            fn = lambda x, w=weight: torch.nn.functional.linear(x, w)  # noqa: E731
            add(("dense", *weight.shape, weight.dtype), weight, (weight.shape[1], weight.dtype, fn))
        for key, buffer, product in _gguf_tile_products(module):
            add(key, buffer, product)
    return found


def _gguf_tile_products(module: torch.nn.Module):
    """A GGUF linear's quantized runs as the dequantized tiles multiply them (prompt rows' path)."""
    from splitserve.kernels import cpu_features

    for qtype, rows, name in getattr(module, "gguf_runs", ()):
        if qtype is None:
            continue
        k, weight, dtype = module.in_features, getattr(module, name), module.dtype
        fn = lambda x, w=weight, q=qtype, n=rows, k=k: torch.ops.splitserve_cpu.gguf_mm(  # noqa: E731
            x.contiguous(), w, q, n, k, cpu_features.native_bf16(), 2
        )
        yield ("gguf", qtype, rows, k, dtype), weight, (k, dtype, fn)


def _packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """As kernels/packed_linear.py multiplies a prepacked weight (which pads through this module)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _invariant(product, multiple: int) -> bool:
    """Whether the first rows of x give the same results alone as within every probed row count."""
    k, dtype, fn = product
    generator = torch.Generator().manual_seed(k)
    scales = torch.rand(max(_PROBE_ROWS), 1, generator=generator) * 4
    x = (torch.randn(max(_PROBE_ROWS), k, generator=generator) * scales).to(dtype)
    alone = torch.cat([_rows(fn, x[i : i + 1], multiple) for i in range(_ALONE_ROWS)])
    for m in _PROBE_ROWS:
        n = min(m, _ALONE_ROWS)
        if not torch.equal(_rows(fn, x[:m], multiple)[:n], alone[:n]):
            return False
    return True


def _rows(fn, x: torch.Tensor, multiple: int) -> torch.Tensor:
    m = x.shape[0]
    padded = -(-m // multiple) * multiple
    return fn(x if padded == m else torch.cat([x, x.new_zeros(padded - m, x.shape[1])]))[:m]
