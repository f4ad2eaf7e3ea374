"""Tiny random-weight models of every supported architecture and PEFT LoRA adapters for them."""

from __future__ import annotations

# Small enough to run in seconds on two cores, large enough that bugs show: GQA, several layers,
# head_dim 16, and a vocabulary within the SmolLM2 tokenizer so outputs detokenize.
TINY_CONFIG = dict(
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


def make_tiny_model(directory: str, arch: str, tokenizer) -> str:
    import torch
    import transformers

    config_name, extra = TINY_ARCHS[arch]
    config = getattr(transformers, config_name)(**TINY_CONFIG, **extra)
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(list(TINY_ARCHS).index(arch))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_tiny_chat_model(directory: str, tokenizer, **overrides) -> str:
    """A tiny random Llama with the whole vocabulary of `tokenizer` (SmolLM2's, with its chat
    template); `overrides` change its config (a longer context ...)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        **{**TINY_CONFIG, "vocab_size": len(tokenizer), **overrides}, tie_word_embeddings=False
    )
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
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


def make_tiny_moe_chat_model(directory: str, tokenizer) -> str:
    """A tiny ERNIE 4.5 MoE (shared expert, MoE from layer 1, 8 experts, top-2: the shape of the
    FastDeploy document's `ernie-45-turbo`) with the whole SmolLM2 vocabulary and chat template, and
    8 query heads, so that tp 8 splits it."""
    import torch
    import transformers

    config = transformers.Ernie4_5_MoeConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, moe_num_experts=8, moe_k=2,
        moe_intermediate_size=64, moe_layer_start_index=1, moe_layer_interval=1, moe_num_shared_experts=1,
        tie_word_embeddings=True, max_position_embeddings=2048, initializer_range=0.5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def perturbed_copy(src: str, dst: str, seed: int) -> str:
    """The checkpoint at `src` with every weight changed a little: the same model, trained further."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + 0.5 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(dst)
    return dst
