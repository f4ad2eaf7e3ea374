"""4-bit quantization on text it was not calibrated on: GPTQ and AWQ with `splitserve quantize`'s
defaults (layer by layer; GPTQ asymmetric with act-order and its damping; the built-in calibration
corpus) must not be worse than plain round-to-nearest at the same group size, on the embedded default
model (a real one: a random model's perplexity says nothing). The quantized weights are put back into
the transformers model, so the test measures the algorithms, not the runtime kernels
(tests/unit/test_quantize_tool.py has those)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from splitserve.benchmarks.perplexity import BUILTIN_TEXT
from splitserve.entrypoints.quantize_cli import SEQUENTIAL_DEFAULT
from splitserve.loader.hf_model import load_hf_model
from splitserve.loader.resolve import default_model_path, load_hf_config, split_gguf
from splitserve.quantization import algorithms, tool
from splitserve.quantization.calibration import builtin_sequences
from splitserve.quantization.packing import quantize_int4_groupwise
from splitserve.quantization.tool import default_awq_scales, default_clip_search
from splitserve.tokenizer import get_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # the default model quantized three times (minutes)

GROUP = 64  # the group size splitserve quantize picks for SmolLM2 (576 channels)


def _perplexity(model, texts: list[list[int]]) -> float:
    """Over all the texts' tokens (each text one window)."""
    nll, count = 0.0, 0
    for ids in texts:
        x = torch.tensor([ids])
        logits = model(input_ids=x, use_cache=False).logits[0, :-1]
        nll += torch.nn.functional.cross_entropy(logits.float(), x[0, 1:], reduction="sum").item()
        count += len(ids) - 1
    return math.exp(nll / count)


def _held_out_texts(tokenizer) -> list[list[int]]:
    """Prose (the perplexity tool's own paragraphs) and technical documentation (Python's help on
    its collections module, as pydoc writes it on every machine): neither is in the calibration corpus."""
    import collections
    import pydoc

    manual = pydoc.render_doc(collections, renderer=pydoc.plaintext)
    return [tokenizer(BUILTIN_TEXT).input_ids, tokenizer(manual).input_ids[:1024]]


def _with_weights(base, quantize) -> torch.nn.Module:
    """A copy of `base` whose decoder linears hold quantize(stacked group weight, Hessian), dequantized."""
    model = copy.deepcopy(base)
    modules = dict(model.named_modules())
    for groups in algorithms.decoder_groups(base):
        for group in groups:
            weight = torch.cat([linear.weight.float() for linear in group.linears.values()])
            deq = quantize(weight, group.site).dequantize()
            start = 0
            for name, linear in group.linears.items():
                modules[name].weight.copy_(deq[start : start + linear.out_features])
                start += linear.out_features
    return model


@pytest.fixture(scope="module")
def default_model():
    path = default_model_path()
    tokenizer = get_tokenizer(path)
    base = load_hf_model(*split_gguf(path), torch.float32, config=load_hf_config(path))
    sequences = builtin_sequences(tokenizer, base.config.vocab_size, 512, 128)
    held_out = _held_out_texts(tokenizer)
    with torch.no_grad():
        rounded = _perplexity(_with_weights(base, lambda w, _: quantize_int4_groupwise(w, GROUP, sym=False)), held_out)
        return base, sequences, held_out, _perplexity(base, held_out), rounded


@pytest.mark.parametrize("quant_type", ["gptq", "awq"])
@torch.no_grad()
def test_each_4bit_method_is_not_worse_than_rounding_on_held_out_text(default_model, quant_type):
    base, sequences, held_out, reference, rounded = default_model
    model = copy.deepcopy(base)
    # The tool's defaults: layer by layer, each layer's weights left dequantized in the model.
    options = dict(alpha=None, group_size=GROUP, sym=False, desc_act=True, sequential=SEQUENTIAL_DEFAULT)
    if quant_type == "gptq":  # AWQ's scales folded in and the clipping search, from group 64
        options.update(clip_search=default_clip_search(GROUP), awq_scales=default_awq_scales(GROUP, True))
    assert SEQUENTIAL_DEFAULT
    tool.quantize_model(model, quant_type, sequences, **options)
    calibrated = _perplexity(model, held_out)
    assert reference < calibrated <= rounded, (reference, calibrated, rounded)
