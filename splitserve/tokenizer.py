"""Tokenizers come from transformers: HF directories, hub ids, and .gguf files alike."""

from __future__ import annotations

import functools
import json
import os

from splitserve.loader.config_cache import cached_config
from splitserve.loader.gguf_cache import hf_dir_for_gguf
from splitserve.loader.resolve import split_gguf


@functools.lru_cache(maxsize=8)
def get_tokenizer(path: str, trust_remote_code: bool = False):
    """One tokenizer object per path in a process (the server loads it while its engine process
    starts; the front-end then finds it). A .gguf file's tokenizer is read from the file once and
    then from splitserve's cache (loader/gguf_cache.py)."""
    directory, gguf_file = split_gguf(path)
    if gguf_file is not None and (saved := hf_dir_for_gguf(path)) is not None:
        tokenizer = _saved_gguf_tokenizer(saved)
    else:
        tokenizer = _auto_tokenizer(directory, gguf_file, trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _auto_tokenizer(directory: str, gguf_file: str | None, trust_remote_code: bool):
    from transformers import AutoTokenizer

    # AutoTokenizer reads the model's config to pick a class; the cached one spares importing its class.
    config = cached_config(directory) if gguf_file is None else None
    extra = {"config": config} if config else {}
    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file, trust_remote_code=trust_remote_code, **extra)


def _saved_gguf_tokenizer(directory: str):
    """The tokenizer splitserve saved from a .gguf file. transformers reads a GGUF vocabulary into its
    generic `tokenizers`-backed class, which is what the saved tokenizer_config.json names: loaded by
    that class directly, as AutoTokenizer would load it, without AutoTokenizer's model table (importing
    it reads the source of transformers' 1,100 model files: 0.3-1 s of every start). Any other class
    named there goes through AutoTokenizer."""
    with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
        declared = json.load(f).get("tokenizer_class")
    if declared == "TokenizersBackend":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(directory)
    return _auto_tokenizer(directory, None, trust_remote_code=False)


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs,
) -> str:
    """The prompt text for a conversation, rendered by the model's (or the given) chat template."""
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("This model's tokenizer has no chat template; pass one with chat_template=...")
    return tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
