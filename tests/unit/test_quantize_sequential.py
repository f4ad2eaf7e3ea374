"""Sequential calibration (`splitserve quantize --sequential`, quantization/sequential.py): the kept
inputs of the first decoder layer run through the layers reproduce the model's own hidden states; the
first layer is quantized as in one pass of the float model, later ones on the quantized layers'
outputs."""

from __future__ import annotations

import pytest
import torch
import transformers

from splitserve.quantization import tool
from splitserve.quantization.sequential import first_layer_inputs, run_layer
from tests.helpers.models import TINY_CONFIG

GROUP = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm_tokenizer) -> str:
    config = transformers.LlamaConfig(**{**TINY_CONFIG, "initializer_range": 0.05, "num_hidden_layers": 3})
    torch.manual_seed(0)
    directory = str(tmp_path_factory.mktemp("seq_llama"))
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    smollm_tokenizer.save_pretrained(directory)
    return directory


def _load(directory: str):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _sequences() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 1024, (n,), generator=generator).tolist() for n in (40, 33, 48)]


def test_the_kept_layer_inputs_give_the_models_hidden_states(model_dir):
    model = _load(model_dir)
    sequences = _sequences()
    calls = first_layer_inputs(model, sequences)
    assert len(calls) == len(sequences)
    for k, layer in enumerate(model.model.layers[:-1]):  # the last entry of hidden_states is after the norm
        calls = run_layer(layer, calls)
        for (args, kwargs), ids in zip(calls, sequences):
            with torch.no_grad():
                expected = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[k + 1]
            hidden = args[0] if args else kwargs["hidden_states"]
            torch.testing.assert_close(hidden, expected)


@pytest.mark.parametrize("quant_type", ["gptq", "awq"])
def test_later_layers_are_calibrated_on_the_quantized_ones(model_dir, quant_type):
    sequences = _sequences()
    options = dict(alpha=None, group_size=GROUP, sym=False, desc_act=True)
    one_pass = tool.quantize_model(_load(model_dir), quant_type, sequences, **options)
    sequential = tool.quantize_model(_load(model_dir), quant_type, sequences, sequential=True, **options)
    assert one_pass.keys() == sequential.keys()
    first = [name for name in one_pass if name.startswith("model.layers.0.")]
    later = [name for name in one_pass if name.startswith("model.layers.2.")]
    for name in first:  # the same inputs: the same result
        for suffix, tensor in one_pass[name].items():
            assert torch.equal(tensor, sequential[name][suffix]), (name, suffix)
    changed = [n for n in later if not torch.equal(one_pass[n]["qweight"], sequential[n]["qweight"])]
    assert changed, "the last layer saw the same inputs with its predecessors quantized"


def test_gptq_with_awq_scales_folds_them_before_rounding(model_dir):
    sequences = _sequences()
    options = dict(alpha=None, group_size=GROUP, sym=False, desc_act=True, sequential=True)
    plain_model, scaled_model = _load(model_dir), _load(model_dir)
    plain = tool.quantize_model(plain_model, "gptq", sequences, **options)
    scaled = tool.quantize_model(scaled_model, "gptq", sequences, awq_scales=True, **options)
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(plain_model.state_dict()[norm], _load(model_dir).state_dict()[norm])
    assert not torch.equal(scaled_model.state_dict()[norm], plain_model.state_dict()[norm])  # 1/s folded in
    assert any(not torch.equal(plain[n]["qweight"], scaled[n]["qweight"]) for n in plain)


def test_awq_scales_need_the_sequential_mode(model_dir, tmp_path):
    from tests.helpers.quantize import run_tool

    with pytest.raises(ValueError, match="--awq-scales works layer by layer"):
        run_tool("-i", model_dir, "-o", str(tmp_path / "out"), "--quant-type", "gptq", "--group-size", "32",
                 "--no-sequential", "--awq-scales")  # fmt: skip
