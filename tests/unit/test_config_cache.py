"""Configs rebuilt from splitserve's cache (loader/config_cache.py) answer as transformers' own; what a
warm start imports, and when."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from splitserve.loader import config_cache
from splitserve.loader.resolve import load_hf_config
from splitserve.tokenizer import get_tokenizer

# What splitserve's models and engine read from a config.
READ = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "tie_word_embeddings",
    "max_position_embeddings",
    "hidden_act",
    "sliding_window",
    "bos_token_id",
    "eos_token_id",
    "id2label",
    "dtype",
)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_cached_config_answers_as_transformers_does(tiny_models, cache_dir, arch):
    real = load_hf_config(tiny_models[arch])
    assert type(real).__name__ != "PreTrainedConfig"
    assert len(os.listdir(cache_dir / "configs")) == 1
    cached = load_hf_config(tiny_models[arch])
    assert type(cached).__name__ == "PreTrainedConfig"
    for name in READ:
        assert getattr(cached, name, "missing") == getattr(real, name, "missing"), name
    assert {k: v for k, v in vars(cached).items() if k in vars(real)} == vars(real)
    # Each load is a fresh object: overrides on one do not reach the next.
    cached.hidden_size = 1
    assert load_hf_config(tiny_models[arch]).hidden_size == real.hidden_size


def test_transformers_gets_its_own_class_back(tiny_models, cache_dir):
    from transformers import AutoConfig

    load_hf_config(tiny_models["qwen3"])
    rebuilt = config_cache.as_transformers_config(load_hf_config(tiny_models["qwen3"]))
    real = AutoConfig.from_pretrained(tiny_models["qwen3"])
    assert type(rebuilt) is type(real) and rebuilt.to_dict() == real.to_dict()
    assert config_cache.as_transformers_config(real) is real


def test_the_tokenizer_is_the_same_with_the_cached_config(tiny_models, cache_dir, smollm_tokenizer):
    directory = tiny_models["llama"]
    load_hf_config(directory)
    assert config_cache.cached_config(directory) is not None
    get_tokenizer.cache_clear()
    try:
        tokenizer = get_tokenizer(directory)
    finally:
        get_tokenizer.cache_clear()
    text = "Hello <|im_start|>user\nworld ünïcode"
    assert type(tokenizer) is type(smollm_tokenizer)
    assert tokenizer(text).input_ids == smollm_tokenizer(text).input_ids
    assert tokenizer.chat_template == smollm_tokenizer.chat_template


def test_a_changed_config_is_read_again(tiny_models, cache_dir, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], directory)
    load_hf_config(str(directory))
    assert load_hf_config(str(directory)).num_hidden_layers == 3
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "num_hidden_layers": 2}))
    changed = load_hf_config(str(directory))
    assert type(changed).__name__ == "LlamaConfig" and changed.num_hidden_layers == 2
    assert len(os.listdir(cache_dir / "configs")) == 2


def test_what_json_cannot_carry_is_not_cached(tiny_models, cache_dir, caplog):
    from transformers import AutoConfig

    real = AutoConfig.from_pretrained(tiny_models["llama"])
    real.some_object = object()
    with caplog.at_level(logging.INFO, logger="splitserve.loader.config_cache"):
        config_cache.remember_config(tiny_models["llama"], real)
    assert config_cache.cached_config(tiny_models["llama"]) is None
    assert "read by transformers at every start" in caplog.text and "JSON cannot carry" in caplog.text
    real.some_object = torch.bfloat16  # dtypes and tuples do survive
    real.some_tuple = (1, (2, 3))
    config_cache.remember_config(tiny_models["llama"], real)
    cached = config_cache.cached_config(tiny_models["llama"])
    assert cached.some_object is torch.bfloat16 and cached.some_tuple == (1, (2, 3))


def test_the_cache_can_be_turned_off(tiny_models, cache_dir, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CONFIG_CACHE", "0")
    load_hf_config(tiny_models["llama"])
    assert type(load_hf_config(tiny_models["llama"])).__name__ == "LlamaConfig"
    assert not (cache_dir / "configs").exists()


@pytest.mark.slow  # fresh interpreters
def test_a_cached_load_does_not_import_the_config_class(tiny_models, cache_dir):
    """The point of the cache: neither the config nor the tokenizer imports transformers' model
    config classes (and with them torch._dynamo) once the config is cached."""
    load_hf_config(tiny_models["llama"])
    code = (
        "import sys\n"
        "from splitserve.loader.resolve import load_hf_config\n"
        "from splitserve.tokenizer import get_tokenizer\n"
        f"config = load_hf_config({tiny_models['llama']!r})\n"
        f"get_tokenizer({tiny_models['llama']!r})\n"
        "print(type(config).__name__, 'transformers.activations' in sys.modules, 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ}
    ).stdout.split()
    assert out == ["PreTrainedConfig", "False", "False"]


def test_serve_starts_its_engine_before_importing_torch():
    """`splitserve serve` parses its flags and reaches the engine process's start without importing
    torch or transformers, so that a spawned engine process (a GPU host's) imports them beside the
    server, not after."""
    code = (
        "import sys\n"
        "from splitserve.entrypoints.cli import build_parser\n"
        "from splitserve.entrypoints.openai.args import split_args\n"
        "from splitserve.entrypoints.serve import serve\n"
        "from splitserve.engine.engine_process import DeferredEngineConfig, EngineProcess\n"
        "from splitserve.entrypoints.openai.server import run_server\n"
        "engine_args, server_args = split_args(build_parser('serve').parse_args(['serve', '--port', '8000']))\n"
        "DeferredEngineConfig(engine_args, server_args.health_timeout)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow  # the default model's cache, a fresh interpreter
def test_a_gguf_models_warm_start_reads_no_model_table():
    """The default model's config and tokenizer, once saved from its .gguf file: the tokenizer loads
    by the class its saved tokenizer_config.json names, the config from the cache, and neither
    imports transformers.models (importing it reads the source of every model transformers has,
    0.3 s or more of each start); the tokenizer answers as AutoTokenizer's own."""
    from transformers import AutoTokenizer

    from splitserve.loader.gguf_cache import hf_dir_for_gguf
    from splitserve.loader.resolve import default_model_path

    path = default_model_path()
    ours = get_tokenizer(path)  # saves the config and tokenizer on a cold cache
    code = (
        "import sys\n"
        "from splitserve.loader.resolve import load_hf_config\n"
        "from splitserve.tokenizer import get_tokenizer\n"
        f"config = load_hf_config({path!r})\n"
        f"tokenizer = get_tokenizer({path!r})\n"
        "print(type(config).__name__, type(tokenizer).__name__, 'transformers.models' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["PreTrainedConfig", "TokenizersBackend", "False"]

    auto = AutoTokenizer.from_pretrained(hf_dir_for_gguf(path))
    texts = ["Hello world", " leading space, émojis 🙂 and\ttabs\n\nnew lines", "def f(x):\n    return x ** 2"]
    for text in texts:
        assert ours(text).input_ids == auto(text).input_ids
        assert ours.decode(ours(text).input_ids) == auto.decode(auto(text).input_ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "all_special_ids", "model_max_length"):
        assert getattr(ours, attribute) == getattr(auto, attribute), attribute
