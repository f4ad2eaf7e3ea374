"""`splitserve bench mm` end to end on a tiny Qwen2-VL (both engines, a few requests), and the
random-weight Qwen2-VL-2B directory it writes from the built-in config (config and processors only)."""

from __future__ import annotations

import argparse

import pytest

from splitserve.benchmarks import multimodal
from splitserve.engine.arg_flags import add_engine_args, engine_args_from


@pytest.mark.slow  # runs two engines
def test_bench_mm_runs_both_engines(tiny_qwen2_vl, capsys):
    model = tiny_qwen2_vl
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    multimodal.add_arguments(parser)
    flags = ["--model", model, "--load-format", "auto", "--dtype", "float32", "--image-size", "32"]
    ns = parser.parse_args(
        flags + ["--num-prompts", "3", "--concurrency", "2", "--ttft-runs", "1", "--output-len", "3"]
    )
    multimodal.main(ns, engine_args_from(ns))
    out = capsys.readouterr().out
    assert "splitserve / transformers: TTFT" in out and "3 requests of one 32 x 32 image" in out


@pytest.mark.slow  # builds a 2B-shaped model
def test_the_synthetic_2b_directory(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    directory = multimodal.synthetic_model_dir("Qwen/Qwen2-VL-2B-Instruct")
    config, tokenizer = AutoConfig.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.text_config.hidden_size == 1536 and config.vision_config.depth == 32
