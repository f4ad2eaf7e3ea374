"""Shared fixtures: tiny random-weight models of every supported architecture, made with
transformers in a temporary directory (nothing is downloaded), plus the embedded default model."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SPLITSERVE_CPU_KVCACHE_SPACE", "0.25")

# Small enough to run in seconds on two cores, large enough that bugs show: GQA, several layers,
# head_dim 16, and a vocabulary within the SmolLM2 tokenizer so outputs detokenize.
_COMMON = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.5,
)

TINY_ARCHS = {
    "llama": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=24, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
}


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from splitserve.loader.resolve import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer(default_gguf):
    from splitserve.tokenizer import get_tokenizer

    return get_tokenizer(default_gguf)


def make_tiny_model(directory: str, arch: str, tokenizer) -> str:
    import torch
    import transformers

    config_name, extra = TINY_ARCHS[arch]
    config = getattr(transformers, config_name)(**_COMMON, **extra)
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(list(TINY_ARCHS).index(arch))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm_tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(str(root / arch), arch, smollm_tokenizer) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm_tokenizer) -> str:
    """A tiny random Llama with the whole SmolLM2 vocabulary and chat template: the other tiny
    models stop at 1024 tokens, which the template's own tokens (a system prompt, role names) exceed."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**{**_COMMON, "vocab_size": len(smollm_tokenizer)}, tie_word_embeddings=False)
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(0)
    directory = str(tmp_path_factory.mktemp("tiny_chat_model"))
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    smollm_tokenizer.save_pretrained(directory)
    return directory


def make_peft_adapter(
    base_dir: str, out_dir: str, target_modules, r: int = 8, alpha: int = 16, seed: int = 0, **lora_kwargs
) -> str:
    """A PEFT LoRA adapter of `base_dir` with random A and B (PEFT starts B at zero, which would make
    the adapter a no-op), saved as PEFT saves it: adapter_config.json + adapter_model.safetensors."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, **lora_kwargs)
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(out_dir)
    return out_dir
