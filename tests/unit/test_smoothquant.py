"""SmoothQuant's pieces (splitserve/quantization/smoothquant.py): the fold into v_proj under GQA,
the searched strengths, and the error the search measures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from splitserve.quantization import algorithms, smoothquant
from splitserve.quantization.calibration import collect_input_stats, token_folds
from splitserve.quantization.linear import W8A8Int8Method
from splitserve.quantization.packing import quantize_int8_per_channel
from tests.helpers.models import TINY_CONFIG


def _llama(**overrides):
    config = transformers.LlamaConfig(**{**TINY_CONFIG, "initializer_range": 0.05, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _ids(rows: int = 2, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 1024, (rows, length), generator=torch.Generator().manual_seed(seed))


def _o_group(model, layer: int = 0) -> algorithms.InputGroup:
    return next(g for g in algorithms.decoder_groups(model)[layer] if g.kind == "o")


def test_gqa_source_maps_each_query_head_to_its_kv_head():
    # 4 query heads, 2 KV heads, head_dim 16: heads 0-1 read KV head 0, heads 2-3 KV head 1.
    group = _o_group(_llama())
    channel = torch.arange(64)
    head, dim = channel // 16, channel % 16
    assert torch.equal(group.source, head // 2 * 16 + dim)
    assert _o_group(_llama(num_key_value_heads=4)).source is None  # without GQA: row j is channel j


def test_tied_max_shares_the_max_over_a_kv_group():
    group = _o_group(_llama())
    values = torch.rand(64, generator=torch.Generator().manual_seed(0))
    tied = group.tied_max(values)
    for kv in range(2):
        for d in range(16):
            channels = [h * 16 + d for h in (2 * kv, 2 * kv + 1)]
            assert tied[channels[0]] == tied[channels[1]] == values[channels].max()
    assert torch.equal(group.tied_max(torch.stack([values, 2 * values]))[1], 2 * tied)  # leading dims


def test_gqa_o_proj_fold_keeps_the_float_model():
    """Scales tied over each KV group's query heads fold exactly into v_proj (and its bias)."""
    model = _llama(attention_bias=True)
    ids = _ids()
    reference = _logits(model, ids)
    v_before = model.model.layers[0].self_attn.v_proj.weight.clone()
    generator = torch.Generator().manual_seed(2)
    for layer in range(3):
        group = _o_group(model, layer)
        algorithms.fold_scales(group, group.tied_max(torch.rand(64, generator=generator) * 4 + 0.25))
    torch.testing.assert_close(_logits(model, ids), reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())
    assert not torch.allclose(model.model.layers[0].self_attn.v_proj.weight, v_before)


def _calibrated(folds: int = 1):
    """A tiny Llama, a prompt's float logits, calibration sequences and their input statistics."""
    model = _llama()
    ids = _ids()
    reference = _logits(model, ids)
    sequences = _ids(4, 48, seed=3).tolist()
    groups = [g for layer in algorithms.decoder_groups(model) for g in layer]
    sites = {g.site: next(iter(g.linears.values())) for g in groups}
    return model, ids, reference, sequences, collect_input_stats(model, sites, sequences, folds=folds)


def test_smooth_model_keeps_the_float_model_and_smooths_o_proj():
    model, ids, reference, sequences, stats = _calibrated(folds=smoothquant.SEARCH_FOLDS)
    v_before = model.model.layers[0].self_attn.v_proj.weight.clone()
    chosen = smoothquant.smooth_model(model, stats, sequences, alpha=0.8)
    assert len(chosen) == 12  # qkv, o, gate/up and down of 3 layers: o_proj too, despite GQA
    assert set(chosen.values()) <= set(smoothquant.strengths(0.8))
    torch.testing.assert_close(_logits(model, ids), reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())
    o_strength = chosen["model.layers.0.self_attn.o_proj"]
    assert o_strength == 0 or not torch.equal(model.model.layers[0].self_attn.v_proj.weight, v_before)


def test_a_given_strength_is_applied_to_every_group():
    """-sq NUMBER: that strength in every group, no search (and the float model unchanged)."""
    model, ids, reference, sequences, stats = _calibrated()
    chosen = smoothquant.smooth_model(model, stats, sequences, alpha=0.75)
    assert len(chosen) == 12 and set(chosen.values()) == {0.75}
    torch.testing.assert_close(_logits(model, ids), reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


def test_strengths():
    assert smoothquant.strengths(0.8) == pytest.approx([k * 0.05 for k in range(17)])
    assert smoothquant.strengths(0.82)[-2:] == pytest.approx([0.8, 0.82])
    assert smoothquant.strengths(0.0) == [0.0]


def test_token_folds_are_contiguous_and_even():
    folds = token_folds([[0] * 5, [0] * 7], 3)
    assert torch.cat(folds).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert token_folds([[0] * 2], 1)[0].tolist() == [0, 0]


def test_w8a8_error_is_that_of_the_run_time_product():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=generator) * torch.linspace(0.1, 5.0, 64)
    weight = torch.randn(32, 64, generator=generator)
    s = torch.rand(64, generator=generator) + 0.5
    qweight, scale = quantize_int8_per_channel(weight * s)
    layer = SimpleNamespace(qweight=qweight, weight_scale=scale)
    product = W8A8Int8Method._matmul(layer, x / s)
    reference = x @ weight.t()
    expected = (product - reference).pow(2).sum().item()
    assert smoothquant.w8a8_error(x, weight, reference, s) == pytest.approx(expected, rel=1e-5)


def test_the_search_takes_the_least_held_out_error():
    """One group, by hand: each fold's error with scales from the other folds' maxima, summed."""
    model = _llama(num_hidden_layers=1)
    sequences = _ids(3, 32, seed=4).tolist()
    group = next(g for g in algorithms.decoder_groups(model)[0] if g.kind == "down")
    module = group.linears[group.site]
    stats = collect_input_stats(model, {group.site: module}, sequences, folds=3)
    inputs = []
    handle = module.register_forward_pre_hook(lambda m, args: inputs.append(args[0][0].detach()))
    for ids in sequences:
        _logits(model, torch.tensor([ids]))
    handle.remove()
    grid = smoothquant.strengths(0.8)
    weight = group.weight()
    expected = torch.zeros(len(grid), dtype=torch.float64)
    for k, x in enumerate(inputs):  # three sequences of equal length: fold k is sequence k
        fit = torch.stack([inputs[j].abs().amax(0) for j in range(3) if j != k]).amax(0)
        for i, alpha in enumerate(grid):
            s = smoothquant.smoothing_scales(fit, weight.abs().amax(0), alpha)
            expected[i] += smoothquant.w8a8_error(x, weight, x @ weight.t(), s)
    search = smoothquant.HeldOutErrors({group.site: group}, stats, grid, stride=1)
    chosen = smoothquant.choose_strengths(model, {group.site: group}, stats, sequences, 0.8)
    for x, fold in zip(inputs, token_folds(sequences, 3)):
        search.record(group.site, x, fold)
    torch.testing.assert_close(search.errors[group.site], expected, rtol=1e-6, atol=0)
    assert chosen[group.site] == grid[int(torch.argmin(expected))]
