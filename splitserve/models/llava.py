"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower, a two-layer MLP projector
and a Llama-family language model; each image becomes a run of placeholder tokens in the prompt whose
embeddings are the projected features of one of the tower's layers (`vision_feature_layer`), CLS token
dropped under the "default" `vision_feature_select_strategy`.

The language model is LlamaForCausalLM on the config's text_config, so everything that model does
(tensor and pipeline parallelism, quantized linears, the CPU decode stack, LoRA) holds here; the
tower and projector sit beside it on the first pipeline stage, whole on every tensor-parallel rank.
The model runner asks for image embeddings (`embed_images`) and hands the step's input embeddings,
images placed, to `forward` (executor/encoder_cache.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from splitserve.layers.basic import Linear
from splitserve.models.llama import LlamaForCausalLM
from splitserve.models.vision import (
    VisionTransformer,
    activation,
    layers_for_feature_layer,
    load_exact,
    local_name,
)

# Checkpoint prefixes: transformers >= 4.52 saves model.{vision_tower,multi_modal_projector,language_model}
# and lm_head; older checkpoints (the hub's llava-hf models) have them at the top, the LM's as language_model.model.
_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


class LlavaProjector(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        bias = getattr(config, "multimodal_projector_bias", True)
        hidden = config.text_config.hidden_size
        self.linear_1 = Linear(config.vision_config.hidden_size, [hidden], bias=bias, dtype=dtype)
        self.act = activation(config.projector_hidden_act)
        self.linear_2 = Linear(hidden, [hidden], bias=bias, dtype=dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    decodes_as_llama = True  # a decode step is its language model's alone: the CPU decode stack runs it

    def __init__(self, config, dtype: torch.dtype, max_position: int, quant_config=None):
        super().__init__(config.text_config, dtype, max_position, quant_config)
        self.hf_config = config
        feature_layer = config.vision_feature_layer
        if not isinstance(feature_layer, int):
            raise ValueError(f"vision_feature_layer {feature_layer!r}: only one feature layer is supported.")
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} is unknown.")
        self.drops_class_token = config.vision_feature_select_strategy == "default"
        if self.model.is_first_stage:
            vision = config.vision_config
            num_layers = layers_for_feature_layer(vision.num_hidden_layers, feature_layer)
            self.vision_tower = VisionTransformer(vision, num_layers, dtype)
            self.multi_modal_projector = LlavaProjector(config, dtype)

    def embed_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's token embeddings [tokens, hidden], from its pixel_values [3, size, size] (the
        processor makes every image one size: one batch)."""
        features = self.vision_tower(torch.stack([image["pixel_values"] for image in images]))
        if self.drops_class_token:
            features = features[:, 1:]
        count, tokens, width = features.shape
        embeddings = self.multi_modal_projector(features.reshape(count * tokens, width))
        return list(embeddings.view(count, tokens, -1))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The language model's tensors go through LlamaForCausalLM's loading (renamed to its names);
        the tower's and the projector's are gathered and loaded after it."""
        vision: dict[str, dict[str, torch.Tensor]] = {"vision_tower": {}, "multi_modal_projector": {}}

        def language_model_weights():
            for name, tensor in weights:
                local = local_name(name, _PREFIXES)
                module, _, rest = local.partition(".")
                if module in vision:
                    vision[module][rest] = tensor
                else:
                    yield local, tensor

        super().load_weights(language_model_weights())
        if self.model.is_first_stage:
            self.vision_tower.load_weights(vision["vision_tower"])
            load_exact(self.multi_modal_projector, vision["multi_modal_projector"], "projector")

    def _load_keys(self, param_name: str) -> list[str]:
        if param_name.startswith(("vision_tower.", "multi_modal_projector.")):
            return []  # checked by their own loading
        return super()._load_keys(param_name)
