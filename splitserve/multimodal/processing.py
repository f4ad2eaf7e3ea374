"""Prompts with images turned into model inputs: each image placeholder of the prompt text expanded
into the image's tokens and the image's pixel values computed, by the model's own Hugging Face
processor (AutoProcessor, LLaVA) or its image processor and the placeholder rule of its family
(Qwen2-VL, whose full processor needs torchvision for videos); the result is the prompt's token ids
and, per image, a MultiModalFeature (multimodal/inputs.py) naming the tokens its embeddings replace.

Users write one placeholder per image where it belongs in the prompt (`<image>` for LLaVA,
`<|vision_start|><|image_pad|><|vision_end|>` for Qwen2-VL), as with vLLM; chat front-ends put them
there from image content parts (multimodal/chat.py). Every mistake (more images than
`--limit-mm-per-prompt` allows, placeholders and images that do not match, a model without a vision
encoder) raises ValueError with a message for the user.
"""

from __future__ import annotations

import logging

import numpy as np

from splitserve.config import ModelConfig
from splitserve.multimodal.inputs import MultiModalFeature, TensorData, feature_from_placement
from splitserve.multimodal.media import MediaConfig, image_hash, load_image

logger = logging.getLogger(__name__)

DEFAULT_LIMIT_PER_PROMPT = 999  # images per prompt unless --limit-mm-per-prompt says otherwise (vLLM's default)


def images_of(multi_modal_data) -> list:
    """The images of a prompt's multi_modal_data ({"image": image or list}); other modalities refused."""
    if not isinstance(multi_modal_data, dict):
        raise ValueError("multi_modal_data must be a dict such as {'image': image or [images]}.")
    unknown = sorted(set(multi_modal_data) - {"image"})
    if unknown:
        raise ValueError(f"multi_modal_data modalities {unknown} are not supported; only 'image' is.")
    images = multi_modal_data.get("image", [])
    return list(images) if isinstance(images, (list, tuple)) else [images]


class MultiModalProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer, limit_per_prompt: dict[str, int] | None = None):
        config = model_config.hf_config
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = getattr(config, "image_token_index", None)
        if self.image_token_id is None:
            raise ValueError(f"{model_config.architecture} names no image token: it cannot take images.")
        qwen = model_config.architecture.startswith(("Qwen2VL", "Qwen2_5_VL"))
        family = _Qwen2VLInputs if qwen else _LlavaInputs
        self.inputs = family(model_config, tokenizer)
        self.placeholder = self.inputs.placeholder
        self.limit = (limit_per_prompt or {}).get("image", DEFAULT_LIMIT_PER_PROMPT)

    def process(self, text: str, images: list, add_special_tokens: bool = True) -> tuple[list[int], list]:
        """(prompt token ids, one MultiModalFeature per image, in the prompt's order)."""
        if len(images) > self.limit:
            raise ValueError(
                f"The prompt has {len(images)} images; this server takes at most {self.limit} per prompt "
                "(--limit-mm-per-prompt)."
            )
        found = text.count(self.inputs.marker)
        if found != len(images):
            raise ValueError(
                f"The prompt has {found} image placeholders ({self.placeholder}) for {len(images)} images: "
                "write one placeholder where each image belongs."
            )
        images = [load_image(image, MediaConfig.offline()) for image in images]
        ids, data, lengths = self.inputs(text, images, add_special_tokens)
        return ids, self._features(ids, images, data, lengths)

    def _features(self, ids: list[int], images: list, data: list[dict], lengths: list[int]) -> list[MultiModalFeature]:
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != sum(lengths):
            raise ValueError(
                f"The prompt holds {len(positions)} image tokens where its {len(images)} images take "
                f"{sum(lengths)}: write images only through placeholders."
            )
        features, first = [], 0
        for image, tensors, length in zip(images, data, lengths):
            offset = positions[first]
            assert positions[first + length - 1] == offset + length - 1, "an image's tokens are not consecutive"
            encoded = {name: TensorData.from_array(array) for name, array in tensors.items()}
            features.append(MultiModalFeature("image", image_hash(image), offset, length, encoded))
            first += length
        return features

    def placed_features(self, ids: list[int], placements) -> list[MultiModalFeature]:
        """The images of a token-id prompt whose images were processed elsewhere (a decode instance's
        prompt, from its prefill instance): each placement must cover image tokens exactly."""
        if not isinstance(placements, list):
            raise ValueError("mm_placements must be a list of image placements.")
        features = sorted((feature_from_placement(p) for p in placements), key=lambda f: f.offset)
        covered = [i for f in features for i in range(f.offset, f.end)]
        if covered != [i for i, t in enumerate(ids) if t == self.image_token_id]:
            raise ValueError("The image placements do not cover the prompt's image tokens exactly.")
        return features

    def check_image_tokens(self, ids: list[int]) -> None:
        """A prompt given as token ids, or without images, must not hold image tokens."""
        if self.image_token_id in ids:
            raise ValueError(
                "The prompt holds image tokens but no images: send images as multi_modal_data (or image_url "
                "content parts) with one placeholder each."
            )


class _LlavaInputs:
    """LLaVA: its AutoProcessor expands each `<image>` to the tower's patch count."""

    def __init__(self, model_config: ModelConfig, tokenizer):
        from transformers import AutoProcessor

        self.hf_processor = AutoProcessor.from_pretrained(
            model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
        )
        self.placeholder = self.marker = getattr(self.hf_processor, "image_token", None) or "<image>"
        self.tokens_per_image = _llava_tokens_per_image(model_config.hf_config)

    def __call__(self, text: str, images: list, add_special_tokens: bool):
        out = self.hf_processor(
            text=[text], images=images or None, return_tensors="np", add_special_tokens=add_special_tokens
        )
        pixels = out.get("pixel_values")
        data = [{"pixel_values": pixels[i].astype("float32")} for i in range(len(images))]
        return [int(t) for t in out["input_ids"][0]], data, [self.tokens_per_image] * len(images)


class _Qwen2VLInputs:
    """Qwen2-VL: its image processor resizes each image to whole 28-pixel windows and flattens its
    patches; each `<|image_pad|>` becomes grid_t * grid_h * grid_w / merge^2 of them."""

    marker = "<|image_pad|>"
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"

    def __init__(self, model_config: ModelConfig, tokenizer):
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(
            model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
        )
        self.merge = model_config.hf_config.vision_config.spatial_merge_size
        self.tokenizer = tokenizer

    def __call__(self, text: str, images: list, add_special_tokens: bool):
        data, lengths = [], []
        if images:
            out = self.image_processor(images=images, return_tensors="np")
            first = 0
            for grid in out["image_grid_thw"]:
                patches = int(np.prod(grid))
                pixels = out["pixel_values"][first : first + patches].astype("float32")
                data.append({"pixel_values": pixels, "image_grid_thw": np.asarray(grid, dtype=np.int64)})
                lengths.append(patches // self.merge**2)
                first += patches
        pieces = text.split(self.marker)
        expanded = pieces[0] + "".join(self.marker * n + piece for n, piece in zip(lengths, pieces[1:]))
        return self.tokenizer(expanded, add_special_tokens=add_special_tokens).input_ids, data, lengths


def _llava_tokens_per_image(config) -> int:
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    class_token = vision.model_type == "clip_vision_model"
    return patches + (class_token and config.vision_feature_select_strategy == "full")
