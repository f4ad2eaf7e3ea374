"""`splitserve bench quant`: quantized variants (methods applied while loading, checkpoint directories)
against the base, with a perplexity column per text, weight memory, and the speeds unless
--quality-only."""

from __future__ import annotations

import json

import pytest

from splitserve.benchmarks import perplexity, quant
from splitserve.entrypoints.cli import build_parser, engine_args_from
from tests.helpers.quant_layouts import write_quantized_checkpoint

PROSE = "The quick brown fox jumps over the lazy dog. " * 12
CODE = "def add(a, b):\n    return a + b\n\n" * 12


def _run(*flags: str):
    ns = build_parser().parse_args(["bench", "quant", *flags])
    return quant.main(ns, engine_args_from(ns))


@pytest.mark.slow  # quantizes and scores models
def test_quality_only_scores_each_text_for_each_variant(tiny_chat_model, tmp_path, capsys):
    model = tiny_chat_model
    ct = tmp_path / "ct"
    write_quantized_checkpoint(model, str(ct), "compressed-tensors", group_size=32)
    texts = [tmp_path / "prose.txt", tmp_path / "code.txt"]
    for path, text in zip(texts, (PROSE, CODE)):
        path.write_text(text)
    out = tmp_path / "quant.json"
    results = _run(
        "--model", model, "--dtype", "float32", "--max-model-len", "128", "--max-length", "64", "--quality-only",
        "--text-file", *map(str, texts), "--output-json", str(out),
        "--variants", "base", "weight_only_int8", f"int4={ct}",
    )  # fmt: skip
    assert [r.label for r in results] == ["base", "weight_only_int8", "int4"]
    assert [r.quantization for r in results] == ["none", "weight_only_int8", "compressed-tensors"]
    assert all(len(r.perplexity) == 2 and r.output_tokens_per_s is None for r in results)
    base, int8, int4 = results
    assert int4.weight_mib < int8.weight_mib < base.weight_mib  # prepacked CPU weights counted too
    # A random model with sharp logits: int8 moves its perplexity a little; int4 anywhere finite.
    assert all(abs(p / b - 1) < 0.05 for p, b in zip(int8.perplexity, base.perplexity))
    assert all(0 < p < float("inf") for p in int4.perplexity)
    table = capsys.readouterr().out
    assert "| variant | perplexity (prose.txt) | perplexity (code.txt) | weights MiB |" in table
    assert "prefill" not in table
    saved = json.loads(out.read_text())
    assert saved["texts"] == ["prose.txt", "code.txt"]
    assert saved["results"][2]["perplexity"] == pytest.approx(int4.perplexity)


def test_speeds_are_measured_without_quality_only(tiny_chat_model, capsys):
    results = _run(
        "--model", tiny_chat_model, "--dtype", "float32", "--max-model-len", "128", "--max-length", "32",
        "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--variants", "base",
    )  # fmt: skip
    (r,) = results
    assert r.prefill_tokens_per_s > 0 and r.output_tokens_per_s > 0 and r.single_stream_tokens_per_s > 0
    assert len(r.perplexity) == 1  # the built-in text
    assert "single-stream tok/s" in capsys.readouterr().out


def test_a_variant_that_is_nothing_known_is_refused_before_any_run(tiny_chat_model):
    with pytest.raises(ValueError, match="a directory or a .gguf file"):
        _run("--model", tiny_chat_model, "--quality-only", "--variants", "base", "no-such-method")
    assert perplexity.BUILTIN_TEXT  # the default text exists
