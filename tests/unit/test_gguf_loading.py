"""Reading a .gguf quickly: splitserve's own tensor index (against the `gguf` package's reader) and
the cache of its config and tokenizer (against transformers reading the file itself)."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from splitserve.loader import gguf_cache
from splitserve.loader.gguf_file import GGUFFile
from splitserve.loader.weights import dequantize_gguf


@pytest.mark.slow  # reads every tensor of the default model
def test_tensor_index_and_values_match_the_gguf_package(default_gguf):
    ours, theirs = GGUFFile(default_gguf), gguf.GGUFReader(default_gguf)
    assert ours.architecture == "llama" and ours.metadata["llama.block_count"] == 30
    assert ours.metadata["tokenizer.ggml.tokens"] is None  # arrays are skipped, not read
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert mine.qtype == int(ref.tensor_type)
        assert mine.shape == tuple(int(d) for d in reversed(ref.shape))
        assert np.array_equal(mine.data.numpy().reshape(-1), np.asarray(ref.data).reshape(-1).view(np.uint8))
    embd = next(t for t in ours.tensors if t.name == "token_embd.weight")
    ref = next(t for t in theirs.tensors if t.name == "token_embd.weight")
    assert embd.data.shape == (49152, 576 // 32 * 34)  # Q8_0: 34 bytes per 32 values
    expected = torch.from_numpy(gguf.dequantize(ref.data, ref.tensor_type).copy())
    assert torch.equal(dequantize_gguf(embd), expected)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(path))


@pytest.mark.slow  # parses the default model's GGUF twice
def test_config_and_tokenizer_are_read_once_then_from_the_cache(default_gguf, tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    saved = gguf_cache.hf_dir_for_gguf(default_gguf)
    assert saved is not None and saved.startswith(str(tmp_path))
    assert gguf_cache.hf_dir_for_gguf(default_gguf) == saved  # found, not saved again
    directory, name = os.path.split(default_gguf)
    with gguf_cache.gguf_parsed_once():  # transformers' own reads, on one parse of the file
        direct_tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        direct_cfg = AutoConfig.from_pretrained(directory, gguf_file=name)
    cached_tok = AutoTokenizer.from_pretrained(saved)
    text = "Hello world!\n  def f(x): return x ** 2  # 日本語 émoji 🙂"
    assert cached_tok.encode(text) == direct_tok.encode(text)
    assert cached_tok.chat_template == direct_tok.chat_template
    assert (cached_tok.bos_token_id, cached_tok.eos_token_id) == (direct_tok.bos_token_id, direct_tok.eos_token_id)
    cached_cfg = AutoConfig.from_pretrained(saved)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(cached_cfg, key) == getattr(direct_cfg, key)
    assert cached_cfg.rope_parameters == direct_cfg.rope_parameters


def test_an_unwritable_cache_falls_back_to_reading_the_file(default_gguf, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(blocked))
    assert gguf_cache.hf_dir_for_gguf(default_gguf) is None
    assert "it is read at every start" in caplog.text
