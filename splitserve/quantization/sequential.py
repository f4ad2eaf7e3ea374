"""Sequential calibration for `splitserve quantize` (awq and gptq; `--sequential`, llm-compressor's
sequential pipeline does the same): the decoder layers are calibrated and quantized one after the
other, each on the outputs of the layers before it *as quantized*: on the inputs it will see when the
quantized model runs rather than on the float model's. (The objective stays each layer's own output on
those inputs; the error made upstream is not compensated.)

The calibration sequences run once through the embeddings up to the first decoder layer, whose inputs
(hidden states and keyword arguments: rotary embeddings, masks) are kept. Then, per layer: its input
statistics are gathered by running it on the kept hidden states, the method quantizes it (AWQ folds
its scales into this layer's weights first), its weights are replaced by their dequantized values, and
it runs again to give the next layer's inputs. Two layer passes per layer: about two passes of the model
in all, with one layer's activations held at a time."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from splitserve.quantization.algorithms import InputGroup
from splitserve.quantization.calibration import InputStats, new_stats, recorder
from splitserve.quantization.packing import Int4Weight

# Each sequence's call of a decoder layer: (positional args, keyword args); args[0] the hidden states.
LayerCall = tuple[tuple, dict]


class _Stop(Exception):
    """Ends the forward pass once the first decoder layer's inputs are kept."""


def first_layer_inputs(model: nn.Module, sequences: list[list[int]]) -> list[LayerCall]:
    layers = model.model.layers
    calls: list[LayerCall] = []

    def keep(_module, args, kwargs):
        calls.append((tuple(a.detach() if torch.is_tensor(a) else a for a in args), dict(kwargs)))
        raise _Stop

    handle = layers[0].register_forward_pre_hook(keep, with_kwargs=True)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    try:
        with torch.no_grad():
            for ids in sequences:
                try:
                    decoder(input_ids=torch.tensor([ids]), use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
    return calls


def run_layer(layer: nn.Module, calls: list[LayerCall]) -> list[LayerCall]:
    """The layer on each sequence's inputs: the calls of the next layer."""
    result = []
    with torch.no_grad():
        for args, kwargs in calls:
            out = layer(*args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
            # The hidden states go on as they came: first positional argument, or by keyword.
            result.append(((hidden, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": hidden}))
    return result


def _hook(record, name: str, fold: torch.Tensor):
    def hook(module, args):
        record(name, args[0].detach().reshape(-1, module.in_features).float(), fold)

    return hook


def quantize_sequentially(
    model: nn.Module,
    layers: list[list[InputGroup]],
    sequences: list[list[int]],
    quantize_layer: Callable[[list[InputGroup], Callable[[], dict[str, InputStats]]], dict[str, Int4Weight]],
) -> dict[str, Int4Weight]:
    """quantize_layer(groups, collect) -> {linear name: Int4Weight} for each decoder layer in turn;
    collect() gives the layer's input statistics (with X^T X) on the quantized earlier layers' outputs,
    as the layer's weights are then (call it again after changing them, e.g. after AWQ's folds).
    Returns every linear's."""
    calls = first_layer_inputs(model, sequences)
    result: dict[str, Int4Weight] = {}
    no_fold = torch.zeros(0, dtype=torch.long)
    for layer, groups in tqdm(
        list(zip(model.model.layers, layers)), desc="Calibrating and quantizing layer by layer", unit="layer"
    ):
        sites = {g.site: next(iter(g.linears.values())) for g in groups}

        def collect(layer=layer, sites=sites, calls=calls) -> dict[str, InputStats]:
            stats = new_stats(sites, gram=True)
            handles = [m.register_forward_pre_hook(_hook(recorder(stats), name, no_fold)) for name, m in sites.items()]
            try:
                run_layer(layer, calls)
            finally:
                for handle in handles:
                    handle.remove()
            return stats

        plains = quantize_layer(groups, collect)
        modules = {name: linear for g in groups for name, linear in g.linears.items()}
        with torch.no_grad():
            for name, plain in plains.items():
                weight = modules[name].weight
                weight.copy_(plain.dequantize(weight.dtype))
        result.update(plains)
        calls = run_layer(layer, calls)
    return result
