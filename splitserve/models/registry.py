"""Which Hugging Face architectures splitserve runs, and the class that runs each."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from splitserve.models.ernie4_5 import Ernie4_5ForCausalLM
from splitserve.models.internlm import InternLM2ForCausalLM, internlm2_config, internlm_config
from splitserve.models.llama import LlamaForCausalLM
from splitserve.models.llava import LlavaForConditionalGeneration
from splitserve.models.moe import (
    Ernie4_5_MoeForCausalLM,
    GraniteMoeForCausalLM,
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from splitserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from splitserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from splitserve.models.sequence_classification import LlamaForSequenceClassification

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Ernie4_5_ForCausalLM": Ernie4_5ForCausalLM,  # Baidu's own name for it (remote code), same config and tensors
    "InternLMForCausalLM": LlamaForCausalLM,  # its config is read as a LlamaConfig (models/internlm.py)
    "InternLM2ForCausalLM": InternLM2ForCausalLM,
    "InternLM3ForCausalLM": LlamaForCausalLM,  # transformers' own InternLM3 is its Llama too
    "GraniteForCausalLM": LlamaForCausalLM,  # Llama with multipliers (embedding, residual, attention, logits)
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    # Vision-language models (image inputs: splitserve/multimodal/)
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    # Cross-encoders and classifiers (the pooling runner): models/sequence_classification.py
    **{
        f"{name}ForSequenceClassification": LlamaForSequenceClassification
        for name in ("Llama", "Mistral", "Qwen2", "Qwen3")
    },
}


# Model types whose config class is remote code: splitserve reads their config.json itself.
_NATIVE_CONFIG_READERS: dict[str, Callable[[dict], object]] = {
    "internlm": internlm_config,
    "internlm2": internlm2_config,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def native_config_reader(model_type: str | None) -> Callable[[dict], object] | None:
    """How splitserve reads the config.json of `model_type` without remote code; None: transformers reads it."""
    return _NATIVE_CONFIG_READERS.get(model_type)


def get_model_class(hf_config) -> type[nn.Module]:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"Model architecture {archs or hf_config.model_type!r} is not supported. "
        f"Supported architectures: {', '.join(supported_architectures())}."
    )
