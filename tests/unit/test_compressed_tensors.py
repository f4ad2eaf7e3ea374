"""compressed-tensors (llm-compressor) W4A16 checkpoints: the pack-quantized layout against the word
layout spelled out in tests/helpers/quant_layouts.py, symmetric schemes, the config's settings and
`ignore` list, and clear refusals of the schemes the int4 kernels cannot run."""

from __future__ import annotations

import copy

import pytest
import torch

from splitserve.quantization import compressed_tensors
from splitserve.quantization.config import quantization_config_for
from splitserve.quantization.packing import Int4Weight
from tests.helpers.quant_layouts import compressed_tensors_tensors, quantization_config

OUT, IN, GROUP = 96, 128, 32


@pytest.mark.parametrize("act_order", [False, True])
def test_unpack_matches_the_word_layout(act_order):
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0))
    tensors, deq = compressed_tensors_tensors(w, GROUP, act_order_seed=5 if act_order else None)
    plain = compressed_tensors.unpack(tensors, GROUP)
    assert (plain.g_idx is not None) == act_order
    torch.testing.assert_close(plain.dequantize(), deq, rtol=0, atol=1e-6)
    repacked = compressed_tensors.pack(plain, sym=False)
    for name in ("weight_packed", "weight_zero_point", "weight_shape") + (("weight_g_idx",) if act_order else ()):
        assert torch.equal(repacked[name], tensors[name]), name


def test_one_word_holds_eight_input_channels_lowest_nibble_first():
    q = torch.arange(16, dtype=torch.int32).repeat(8, 2)  # stored levels 0..15 (signed -8..7 + 8)
    tensors = compressed_tensors.pack(Int4Weight(q, torch.ones(8, 1), torch.full((8, 1), 8), 32), sym=True)
    assert tensors["weight_packed"][0].tolist() == [0x76543210, 0xFEDCBA98 - 2**32] * 2  # int32 words
    assert "weight_zero_point" not in tensors  # symmetric: the zero point is the signed 0


def test_symmetric_weights_dequantize_around_zero():
    levels = torch.randint(0, 16, (OUT, IN), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    scale = torch.rand(OUT, IN // GROUP) + 0.5
    plain = Int4Weight(levels, scale, torch.full_like(scale, 8, dtype=torch.int32), GROUP)
    back = compressed_tensors.unpack(compressed_tensors.pack(plain, sym=True), GROUP)
    stored_scale = scale.to(torch.bfloat16).float()  # the checkpoint's dtype
    torch.testing.assert_close(back.dequantize(), (levels.float() - 8) * stored_scale.repeat_interleave(GROUP, 1))


def _config(**changes) -> dict:
    qc = copy.deepcopy(quantization_config("compressed-tensors", 64))
    weights = qc["config_groups"]["group_0"]["weights"]
    weights.update(changes.pop("weights", {}))
    qc["config_groups"]["group_0"].update(changes.pop("scheme", {}))
    qc.update(changes)
    return qc


def _settings(qc: dict):
    hf_config = type("Config", (), {"quantization_config": qc})()
    return quantization_config_for(hf_config, None, "auto")


def test_settings_and_ignore_list():
    config = _settings(_config(ignore=["lm_head", "re:.*layers\\.0\\.mlp\\..*"]))
    assert (config.method, config.group_size) == ("compressed-tensors", 64)
    assert config.linear_method("model.layers.0.mlp.down_proj") is None  # "re:" entries are regexes
    assert config.linear_method("model.layers.1.mlp.down_proj") is not None
    assert config.linear_method("lm_head") is None
    assert _settings(_config(weights={"strategy": "channel", "group_size": None})).group_size == -1


@pytest.mark.parametrize(
    "change,named",
    [
        ({"weights": {"num_bits": 8}}, "int 8-bit group"),
        ({"weights": {"type": "float"}}, "float 4-bit"),
        ({"scheme": {"input_activations": {"num_bits": 8, "type": "int"}}}, "input activations quantized"),
        ({"format": "float-quantized", "scheme": {"format": "float-quantized"}}, "format 'float-quantized'"),
        ({"kv_cache_scheme": {"num_bits": 8}}, "unquantized KV cache"),
    ],
)
def test_other_schemes_are_refused_with_their_description(change, named):
    with pytest.raises(ValueError, match="not supported") as refused:
        _settings(_config(**change))
    assert named in str(refused.value)
