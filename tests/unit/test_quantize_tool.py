"""`splitserve quantize`: the checkpoints it writes (names, dtypes, shapes, config), their accuracy
once dequantized back into the transformers model, the algorithms' own guarantees, and its errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch
import transformers

from splitserve.quantization import algorithms, clipping, tool
from splitserve.quantization.calibration import collect_input_stats, read_token_ids
from splitserve.quantization.gptq import clip_searched_params, gptq_quantize
from splitserve.quantization.packing import fake_quantize_int4, int4_params, quantize_int4_groupwise
from tests.helpers.models import TINY_CONFIG
from tests.helpers.quantize import dequantized_model, load_float, read_config, run_tool

GROUP = 32  # divides the tiny models' hidden (64) and intermediate (128) sizes


def _save_llama(directory: str, tokenizer, **overrides) -> str:
    # initializer_range 0.05, not TINY_CONFIG's 0.5: with weights that large the random model is
    # chaotic (int8 rounding alone moves its logits by ~13%), which would hide what is measured.
    config = transformers.LlamaConfig(**{**TINY_CONFIG, "initializer_range": 0.05, **overrides})
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory, smollm_tokenizer) -> str:
    """A tiny untied Llama with GQA (4 heads, 2 KV heads)."""
    return _save_llama(str(tmp_path_factory.mktemp("q_llama")), smollm_tokenizer, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama_mha(tmp_path_factory, smollm_tokenizer) -> str:
    """Without GQA, so that AWQ also folds o_proj's scales into v_proj."""
    return _save_llama(str(tmp_path_factory.mktemp("q_llama_mha")), smollm_tokenizer, num_key_value_heads=4)


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("calib") / "ids.txt"
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(map(str, torch.randint(3, 1024, (48,), generator=generator).tolist())) for _ in range(5)]
    lines[1] = lines[1].replace(" ", ", ")  # commas are accepted too
    path.write_text("\n".join(lines) + "\n\n")
    return str(path)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _eval_ids() -> torch.Tensor:
    return torch.randint(3, 1024, (2, 64), generator=torch.Generator().manual_seed(1))


def _linear_names(num_layers: int = 3):
    for i in range(num_layers):
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            yield f"model.layers.{i}.{name}"


def _check_tensors(out_dir: str, quant_type: str, float_dir: str, dtype: torch.dtype) -> None:
    tensors = safetensors.torch.load_file(os.path.join(out_dir, "model.safetensors"))
    reference = load_float(float_dir).state_dict()
    for name in _linear_names():
        out_features, in_features = reference[f"{name}.weight"].shape
        if quant_type in ("weight_only_int8", "smooth_quant"):
            assert tensors[f"{name}.weight"].dtype == torch.int8
            assert tensors[f"{name}.weight"].shape == (out_features, in_features)
            assert tensors[f"{name}.weight_scale"].dtype == torch.float32
            assert tensors[f"{name}.weight_scale"].shape == (out_features,)
            continue
        assert f"{name}.weight" not in tensors
        groups = in_features // GROUP
        expected = {
            "qzeros": ((groups, out_features // 8), torch.int32),
            "scales": ((groups, out_features), torch.float16),
        }
        if quant_type == "awq":
            expected["qweight"] = ((in_features, out_features // 8), torch.int32)
        else:
            expected["qweight"] = ((in_features // 8, out_features), torch.int32)
            expected["g_idx"] = ((in_features,), torch.int32)
        for suffix, (shape, tensor_dtype) in expected.items():
            assert tuple(tensors[f"{name}.{suffix}"].shape) == shape, (name, suffix)
            assert tensors[f"{name}.{suffix}"].dtype == tensor_dtype, (name, suffix)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert tensors[name].dtype == dtype


_EXPECTED_CONFIG = {
    "weight_only_int8": {"quant_method": "weight_only_int8", "bits": 8},
    "smooth_quant": {
        "quant_method": "smooth_quant",
        "bits": 8,
        "smoothing_strength": 0.8,
        "smoothing_strength_choice": "per linear group, least held-out W8A8 error, at most smoothing_strength",
        "activation_scheme": "dynamic_per_token",
    },
    "awq": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    },
    "gptq": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": True,
        "sym": False,
        "damp_percent": 0.1,  # layer by layer (the default); 1.0 with --no-sequential
        "true_sequential": False,
        "checkpoint_format": "gptq",
    },
}


@pytest.mark.parametrize("quant_type", list(_EXPECTED_CONFIG))
def test_checkpoint_layout_and_accuracy(llama, calib_file, tmp_path, quant_type):
    out = run_tool(
        "-i",
        llama,
        "-o",
        str(tmp_path / quant_type),
        "--quant-type",
        quant_type,
        "-t",
        "bf16",
        "--group-size",
        str(GROUP),
        "--tokenids-path",
        calib_file,
    )
    config = read_config(out)
    assert config["quantization_config"] == {**_EXPECTED_CONFIG[quant_type], "tensor_parallel_size": 1}
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert config["architectures"] == ["LlamaForCausalLM"] and not config["tie_word_embeddings"]
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert transformers.AutoConfig.from_pretrained(out).num_key_value_heads == 2
    _check_tensors(out, quant_type, llama, torch.bfloat16)
    assert "lm_head.weight" in safetensors.torch.load_file(os.path.join(out, "model.safetensors"))

    ids = _eval_ids()
    reference = _logits(load_float(llama), ids)
    logits = _logits(dequantized_model(out, llama), ids)
    relative = ((logits - reference).norm() / reference.norm()).item()
    nll = [
        torch.nn.functional.cross_entropy(x[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item()
        for x in (reference, logits)
    ]
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    if quant_type in ("weight_only_int8", "smooth_quant"):
        # 8-bit weights (+ bf16 embeddings and norms): measured ~1.5% logit error.
        assert relative < 0.05 and agree > 0.9, (relative, agree)
        assert abs(nll[1] - nll[0]) < 0.01
    else:
        # 4-bit, groups of 32 on random Gaussian weights: measured ~20% logit error.
        assert relative < 0.35, relative
        assert abs(nll[1] - nll[0]) < 0.1


def test_gptq_desc_act_tied_embeddings_and_biases(tiny_models, calib_file, tmp_path):
    """Qwen2: q/k/v biases stay unquantized in the -t dtype, tied embeddings stay tied (no
    lm_head.weight), and act-order writes a g_idx that permutes the groups."""
    out = run_tool(
        "-i",
        tiny_models["qwen2"],
        "-o",
        str(tmp_path / "q"),
        "--quant_type",
        "gptq",
        "-t",
        "float16",
        "--group-size",
        str(GROUP),
        "-token",
        calib_file,
        "--desc-act",
        "--no-sym",
        "--damp-percent",
        "0.05",
    )
    config = read_config(out)
    assert config["quantization_config"]["desc_act"] is True and config["quantization_config"]["sym"] is False
    assert config["quantization_config"]["damp_percent"] == 0.05
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float16"
    tensors = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" not in tensors
    _check_tensors(out, "gptq", tiny_models["qwen2"], torch.float16)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert tensors[f"model.layers.0.self_attn.{name}.bias"].dtype == torch.float16
    g_idx = tensors["model.layers.0.mlp.down_proj.g_idx"]
    assert not torch.equal(g_idx, torch.arange(128, dtype=torch.int32) // GROUP)
    assert torch.bincount(g_idx.long()).tolist() == [GROUP] * 4
    dequantized_model(out, tiny_models["qwen2"])  # loads: every tensor has its place


@pytest.mark.slow  # two CLI processes (~9 s)
def test_cli_subprocess(llama, calib_file, tmp_path):
    out = str(tmp_path / "awq")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.entrypoints.cli",
            "quantize",
            "-i",
            llama,
            "-o",
            out,
            "-quant_type",
            "awq",
            "--group-size",
            str(GROUP),
            "-token",
            calib_file,
            "-tp",
            "2",
            "--multi-query-mode",
            "-sq",
            "0.5",
            "--damp-percent",
            "0.1",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "2 KV heads are read from its config" in result.stderr
    assert "Ignoring -sq" in result.stderr and "Ignoring --damp-percent (gptq only)" in result.stderr
    assert "Quantized 21 linear layers with awq" in result.stderr
    assert read_config(out)["quantization_config"]["tensor_parallel_size"] == 2

    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.entrypoints.cli",
            "quantize",
            "-i",
            llama,
            "-o",
            out,
            "--quant-type",
            "smooth_quant",
            "--tokenids-path",
            str(tmp_path / "missing.txt"),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].endswith("missing.txt does not exist.")


def test_awq_scaling_keeps_the_float_model_and_never_loses_to_no_scaling(llama_mha, calib_file):
    model = load_float(llama_mha)
    ids = _eval_ids()
    reference = _logits(model, ids)
    stats = _calibrate(model, calib_file)
    for group in (g for groups in algorithms.decoder_groups(model) for g in groups):
        moment, weight = stats[group.site].second_moment(), group.weight()
        found = algorithms.awq_search(moment, stats[group.site].absmean, weight, GROUP)
        unscaled = algorithms.awq_objective(moment, weight, torch.ones(weight.shape[1]), GROUP)
        assert found.losses[0] == pytest.approx(unscaled)
        assert algorithms.awq_objective(moment, weight, found.scale, GROUP) <= found.losses[0] * (1 + 1e-6)
    ratios, clips = algorithms.awq_scale_model(model, stats, GROUP)
    assert len(clips) == 3 * 5  # every linear but q/k_proj
    assert len(ratios) == 12  # without GQA o_proj is scaled too, into v_proj
    torch.testing.assert_close(_logits(model, ids), reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


def test_awq_clipping_never_loses_to_the_full_range():
    """Per (row, group), the chosen clipping's share of the output error is at most the full range's."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(400, 64, generator=generator) * torch.linspace(0.2, 2.0, 64)
    weight = torch.randn(32, 64, generator=generator)
    weight[0, 3] = 12.0  # an outlier that clipping should sacrifice
    moment = x.T @ x / x.shape[0]
    ratio = algorithms.awq_clip_search(weight, moment, GROUP)
    assert ratio.shape == (32, 64 // GROUP, 2) and float(ratio.min()) >= 0.5 and float(ratio.max()) <= 1.0

    def group_losses(w):
        error = (w.dequantize() - weight).reshape(32, -1, GROUP)
        blocks = [moment[g * GROUP : (g + 1) * GROUP, g * GROUP : (g + 1) * GROUP] for g in range(64 // GROUP)]
        return torch.stack([((error[:, g] @ blocks[g]) * error[:, g]).sum(-1) for g in range(len(blocks))], dim=1)

    clipped = group_losses(clipping.quantize_int4_clipped(weight, GROUP, ratio))
    full = group_losses(quantize_int4_groupwise(weight, GROUP, sym=False))
    assert (clipped <= full * (1 + 1e-5) + 1e-9).all()
    assert float(ratio[0, 0].min()) < 1.0 and clipped[0, 0] < full[0, 0]


def test_awq_clipping_searches_each_end_of_the_range():
    """Outliers on one side of every row's first group, in a channel whose inputs are small: shrinking
    that end alone rounds the rest finer than shrinking both ends by one ratio (AutoAWQ's search), and
    the search takes it; nowhere is its loss above the best single ratio's."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(400, 64, generator=generator)
    x[:, 5] *= 0.05
    weight = torch.randn(32, 64, generator=generator)
    weight[:, 5] = 6.0 + torch.rand(32, generator=generator)  # the maximum of group 0, far above the rest
    moment = x.T @ x / x.shape[0]
    ratio = algorithms.awq_clip_search(weight, moment, GROUP)
    assert (ratio[:, 0, 1] < ratio[:, 0, 0]).float().mean() > 0.8  # the maximum shrinks, the minimum less

    def losses(r: torch.Tensor) -> torch.Tensor:  # [out, G]
        error = (clipping.quantize_int4_clipped(weight, GROUP, r).dequantize() - weight).reshape(32, -1, GROUP)
        blocks = [moment[g * GROUP : (g + 1) * GROUP, g * GROUP : (g + 1) * GROUP] for g in range(64 // GROUP)]
        return torch.stack([((error[:, g] @ blocks[g]) * error[:, g]).sum(-1) for g in range(len(blocks))], dim=1)

    single = torch.stack([losses(torch.full((32, 64 // GROUP), 1.0 - k * 0.025)) for k in range(20)]).amin(0)
    chosen = losses(ratio)
    assert (chosen <= single * (1 + 1e-5) + 1e-9).all()
    assert chosen[:, 0].sum() < 0.9 * single[:, 0].sum()


@pytest.mark.parametrize("sym", [False, True])
def test_the_searches_fake_rounding_gives_the_packed_weights_bit_for_bit(sym):
    """AWQ's searches round without integer levels (fake_quantize_int4); what they choose must be what
    the checkpoint's packed levels give back, plain and clipped, down to the last bit."""
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 3
    assert torch.equal(
        fake_quantize_int4(weight, *int4_params(weight, GROUP, sym)),
        quantize_int4_groupwise(weight, GROUP, sym).dequantize(),
    )
    for ends in ((), (2,)):  # one ratio for both ends of a group's range, or one for each end
        ratio = torch.rand(48, 128 // GROUP, *ends, generator=torch.Generator().manual_seed(1)) * 0.5 + 0.5
        clipped = clipping.quantize_int4_clipped(weight, GROUP, ratio).dequantize()
        assert torch.equal(fake_quantize_int4(weight, *clipping.clipped_int4_params(weight, GROUP, ratio)), clipped)
        assert not torch.equal(clipped, quantize_int4_groupwise(weight, GROUP, sym=False).dequantize())


def test_awq_objective_is_the_output_error_on_the_calibration_inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=generator) * torch.linspace(0.1, 3.0, 64)
    weight = torch.randn(48, 64, generator=generator)
    s = torch.rand(64, generator=generator) + 0.5
    quantized = quantize_int4_groupwise(weight * s, GROUP, sym=False).dequantize()
    direct = ((x / s) @ quantized.t() - x @ weight.t()).pow(2).mean().item()
    assert algorithms.awq_objective(x.t() @ x / x.shape[0], weight, s, GROUP) == pytest.approx(direct, rel=1e-4)


@pytest.mark.parametrize("mode, damp", [("--sequential", 0.1), ("--no-sequential", 1.0)])
def test_gptq_damping_by_calibration_mode(llama, calib_file, tmp_path, mode, damp):
    """Layer by layer, 0.1 of the Hessian's mean diagonal; on one pass of the float model, 1.0
    (tool.py's GPTQ_DAMP_PERCENT says what each was measured against)."""
    argv = ["--quant-type", "gptq", "--group-size", str(GROUP), "--tokenids-path", calib_file, mode]
    out = run_tool("-i", llama, "-o", str(tmp_path / "q"), *argv)
    assert read_config(out)["quantization_config"]["damp_percent"] == damp


@pytest.mark.parametrize("sym, desc_act", [(True, False), (False, False), (True, True)])
def test_gptq_beats_round_to_nearest_on_calibration_data(llama, calib_file, sym, desc_act):
    model = load_float(llama)
    stats = _calibrate(model, calib_file)
    for group in (g for groups in algorithms.decoder_groups(model) for g in groups):
        moment, weight = stats[group.site].second_moment(), group.weight()
        gptq = gptq_quantize(weight, 2 * moment, GROUP, sym=sym, desc_act=desc_act)
        rtn = quantize_int4_groupwise(weight, GROUP, sym=sym)
        errors = [_output_error(q.dequantize() - weight, moment) for q in (gptq, rtn)]
        assert errors[0] < 0.9 * errors[1], (group.site, errors)
        assert (gptq.g_idx is not None) == desc_act


@pytest.mark.parametrize("sym", [False, True])
def test_gptq_clip_search_never_rounds_a_group_worse_than_its_full_range(sym):
    """Per row, the chosen range's input-weighted error e H e^T is at most the full range's; an
    outlier's row gives up its outlier for a finer grid."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, GROUP, generator=generator) * torch.linspace(0.2, 2.0, GROUP)
    hessian = x.T @ x / x.shape[0]
    group = torch.randn(64, GROUP, generator=generator)
    group[0, 1] = 9.0

    def errors(scale, zero):
        e = (torch.round(group / scale[:, None] + zero[:, None]).clamp(0, 15) - zero[:, None]) * scale[:, None] - group
        return ((e @ hessian) * e).sum(-1)

    full = errors(*(t[:, 0] for t in int4_params(group, GROUP, sym)))
    scale, zero = clip_searched_params(group, hessian, sym)
    searched = errors(scale, zero)
    assert (searched <= full * (1 + 1e-5) + 1e-9).all() and searched[0] < full[0]
    assert ((zero == zero.round()) & (zero >= 0) & (zero <= 15)).all()


@pytest.mark.parametrize(
    "group_size, flags, searched, rescaled",
    [
        (32, [], False, False),
        (64, [], True, True),
        (32, ["--clip-search", "--awq-scales"], True, True),
        (64, ["--no-clip-search", "--no-awq-scales"], False, False),
        (64, ["--no-sequential"], True, False),  # AWQ's scales need the layer-by-layer pipeline
    ],
)
def test_gptq_defaults_by_group_size(llama, calib_file, tmp_path, monkeypatch, group_size, flags, searched, rescaled):
    """The clipping search and AWQ's scales are on from group size 64 (tool.py's defaults say what was
    measured), or as the flags say."""
    seen, scaled = [], []
    real_gptq, real_scale = gptq_quantize, algorithms.awq_scale_layer
    monkeypatch.setattr(tool.gptq, "gptq_quantize", lambda *a, **k: seen.append(k["clip_search"]) or real_gptq(*a, **k))
    monkeypatch.setattr(algorithms, "awq_scale_layer", lambda *a, **k: scaled.append(1) or real_scale(*a, **k))
    argv = ["--quant-type", "gptq", "--group-size", str(group_size), "--tokenids-path", calib_file, *flags]
    run_tool("-i", llama, "-o", str(tmp_path / "q"), *argv)
    assert seen and set(seen) == {searched}
    assert bool(scaled) == rescaled


def _output_error(weight_error: torch.Tensor, moment: torch.Tensor) -> float:
    """Mean squared output error over the calibration tokens: tr(E M E^T) / out."""
    return ((weight_error @ moment) * weight_error).sum().item() / weight_error.shape[0]


def _calibrate(model, calib_file: str):
    groups = [g for layer in algorithms.decoder_groups(model) for g in layer]
    sites = {g.site: next(iter(g.linears.values())) for g in groups}
    return collect_input_stats(model, sites, read_token_ids(calib_file, 1024, 512, 128), gram=True)


def test_builtin_calibration_text(tiny_chat_model, tmp_path):
    """Without --tokenids-path the built-in text is cut into --seq-len sequences (needs the whole
    SmolLM2 vocabulary, which the tiny chat model has)."""
    out = run_tool(
        "-i",
        tiny_chat_model,
        "-o",
        str(tmp_path / "sq"),
        "--quant-type",
        "smooth_quant",
        "-sq",
        "0.5",
        "--seq-len",
        "256",
        "--num-samples",
        "2",
    )
    qc = read_config(out)["quantization_config"]
    assert (qc["smoothing_strength"], qc["smoothing_strength_choice"]) == (0.5, "every linear group")


def test_smoothing_strength_flag():
    """-sq: a number in [0, 1] as AIAK's document has it, or auto (the per-group search)."""
    import argparse

    from splitserve.entrypoints.quantize_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["-i", "m", "-o", "o", "--quant-type", "smooth_quant"]
    assert parser.parse_args(base).smoothquant is None
    assert parser.parse_args([*base, "-sq", "auto"]).smoothquant == "auto"
    assert parser.parse_args([*base, "-sq", "0.75"]).smoothquant == 0.75
    for bad in ("1.5", "-0.1", "strong"):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "-sq", bad])


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "holds no token ids"),
        ("1 2 three\n", r":1: 'three' is not an integer token id"),
        ("1 2 3\n4 1024\n", r":2: token id 1024 is outside the model's vocabulary \(0..1023\)"),
    ],
)
def test_bad_calibration_files(llama, tmp_path, content, message):
    path = tmp_path / "ids.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        run_tool(
            "-i",
            llama,
            "-o",
            str(tmp_path / "out"),
            "--quant-type",
            "awq",
            "--group-size",
            str(GROUP),
            "--tokenids-path",
            str(path),
        )


@pytest.mark.parametrize(
    "argv, error, message",
    [
        (
            ["--quant-type", "gptq", "--group-size", "48"],
            ValueError,
            r"hidden_size \(the input of q/k/v/gate/up_proj\) 64 is not divisible by --group-size 48; "
            r"pass --group-size 32",
        ),
        (["--quant-type", "gptq", "--group-size", "12"], ValueError, "must be a positive multiple of 8"),
        (
            ["--quant-type", "weight_only_int8", "-tp", "3"],
            ValueError,
            "num_attention_heads 4 is not divisible by -tp 3",
        ),
        (
            ["--quant-type", "awq", "--group-size", "64", "-tp", "2"],
            ValueError,
            r"o_proj's input size per rank \(4 heads x 16 / 2\) 32 is not divisible by --group-size 64; "
            r"pass --group-size 32",
        ),
        (["--quant-type", "smooth_quant"], ValueError, "outside the model's vocabulary .* --tokenids-path"),
        (["--quant-type", "gptq", "--damp-percent", "0"], ValueError, "--damp-percent 0.0: must be positive"),
        (
            ["--quant-type", "awq", "--group-size", "32", "--tokenids-path", "/nonexistent/ids.txt"],
            FileNotFoundError,
            "does not exist",
        ),
    ],
)
def test_bad_arguments(llama, tmp_path, argv, error, message):
    with pytest.raises(error, match=message):
        run_tool("-i", llama, "-o", str(tmp_path / "out"), *argv)


def test_bad_paths_and_types(llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_tool("-i", str(tmp_path / "nothing"), "-o", str(tmp_path / "out"), "--quant-type", "awq")
    with pytest.raises(ValueError, match="is the input's directory"):
        run_tool("-i", llama, "-o", llama, "--quant-type", "weight_only_int8")
    with pytest.raises(SystemExit):  # argparse: "invalid choice: 'int3'"
        run_tool("-i", llama, "-o", str(tmp_path / "out"), "--quant-type", "int3")


def test_smollm2_shapes_ask_for_group_size_64():
    config = transformers.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64
    )
    with pytest.raises(ValueError, match="576 is not divisible by --group-size 128; pass --group-size 64"):
        tool.check_shapes(config, "awq", 128, 1)
    tool.check_shapes(config, "awq", 64, 3)
    with pytest.raises(ValueError, match="num_attention_heads 9 is not divisible by -tp 2"):
        tool.check_shapes(config, "gptq", 64, 2)


def test_default_group_size_is_the_largest_that_divides(caplog):
    """`-quant_type awq` on the default model with no --group-size: 64, logged, instead of refusing 128."""
    import logging

    smol = transformers.LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64
    )
    with caplog.at_level(logging.INFO, logger="splitserve.quantization.tool"):
        assert tool.default_group_size(smol, 1) == 64
    assert "Group size 64: the default 128 does not divide hidden_size" in caplog.text
    wide = transformers.LlamaConfig(hidden_size=1024, intermediate_size=4096, num_attention_heads=16)
    assert tool.default_group_size(wide, 1) == 128


@pytest.mark.parametrize("fixture", ["llama", "llama_mha"])
@torch.no_grad()
def test_awq_folds_rescale_the_statistics_as_a_new_pass_would_record_them(request, calib_file, fixture):
    """GPTQ after AWQ's scales reads each group's Hessian of its rescaled inputs x / s from the first
    pass's statistics (awq_scale_layer's rescale_stats) instead of a second pass of the layer."""
    model = load_float(request.getfixturevalue(fixture))
    stats = _calibrate(model, calib_file)
    groups = algorithms.decoder_groups(model)[0]
    algorithms.awq_scale_layer(groups, stats, 32, clip=False, rescale_stats=True)
    again = _calibrate(model, calib_file)
    scaled = [g.site for g in groups if g.prev is not None]
    assert scaled
    for site in scaled:
        for name in ("gram", "absmax", "abssum"):
            torch.testing.assert_close(getattr(stats[site], name), getattr(again[site], name), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(
        again[scaled[0]].gram, _calibrate(load_float(request.getfixturevalue(fixture)), calib_file)[scaled[0]].gram
    )
