"""Prompts with images turned into model inputs: the model's own Hugging Face processor (AutoProcessor)
expands each image placeholder of the prompt text into the image's tokens and computes its pixel
values; the result is the prompt's token ids and, per image, a MultiModalFeature (multimodal/inputs.py)
naming the tokens its embeddings replace.

Users write one placeholder per image where it belongs in the prompt (`<image>` for LLaVA, the
processor's `image_token`), as with vLLM; chat front-ends put them there from image content parts
(multimodal/chat.py). Every mistake (more images than `--limit-mm-per-prompt` allows, placeholders
and images that do not match, a model without a vision encoder) raises ValueError with a message for
the user.
"""

from __future__ import annotations

import logging

from splitserve.config import ModelConfig
from splitserve.multimodal.inputs import MultiModalFeature, TensorData
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
    def __init__(self, model_config: ModelConfig, limit_per_prompt: dict[str, int] | None = None):
        from transformers import AutoProcessor

        config = model_config.hf_config
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = getattr(config, "image_token_index", None)
        if self.image_token_id is None:
            raise ValueError(f"{model_config.architecture} names no image token: it cannot take images.")
        self.hf_processor = AutoProcessor.from_pretrained(
            model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
        )
        self.placeholder = getattr(self.hf_processor, "image_token", None) or "<image>"
        self.limit = (limit_per_prompt or {}).get("image", DEFAULT_LIMIT_PER_PROMPT)
        self.tokens_per_image = _llava_tokens_per_image(config)

    def process(self, text: str, images: list, add_special_tokens: bool = True) -> tuple[list[int], list]:
        """(prompt token ids, one MultiModalFeature per image, in the prompt's order)."""
        if len(images) > self.limit:
            raise ValueError(
                f"The prompt has {len(images)} images; this server takes at most {self.limit} per prompt "
                "(--limit-mm-per-prompt)."
            )
        found = text.count(self.placeholder)
        if found != len(images):
            raise ValueError(
                f"The prompt has {found} image placeholders ({self.placeholder}) for {len(images)} images: "
                "write one placeholder where each image belongs."
            )
        images = [load_image(image, MediaConfig.offline()) for image in images]
        out = self.hf_processor(
            text=[text], images=images or None, return_tensors="np", add_special_tokens=add_special_tokens
        )
        ids = [int(t) for t in out["input_ids"][0]]
        return ids, self._features(ids, images, out.get("pixel_values"))

    def _features(self, ids: list[int], images: list, pixel_values) -> list[MultiModalFeature]:
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != len(images) * self.tokens_per_image:
            raise ValueError(
                f"The prompt holds {len(positions)} image tokens where {len(images)} images take "
                f"{len(images) * self.tokens_per_image}: write images only through placeholders."
            )
        features = []
        for i, image in enumerate(images):
            offset = positions[i * self.tokens_per_image]
            assert positions[(i + 1) * self.tokens_per_image - 1] == offset + self.tokens_per_image - 1
            data = {"pixel_values": TensorData.from_array(pixel_values[i].astype("float32"))}
            features.append(MultiModalFeature("image", image_hash(image), offset, self.tokens_per_image, data))
        return features

    def check_image_tokens(self, ids: list[int]) -> None:
        """A prompt given as token ids, or without images, must not hold image tokens."""
        if self.image_token_id in ids:
            raise ValueError(
                "The prompt holds image tokens but no images: send images as multi_modal_data (or image_url "
                "content parts) with one placeholder each."
            )


def _llava_tokens_per_image(config) -> int:
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    class_token = vision.model_type == "clip_vision_model"
    return patches + (class_token and config.vision_feature_select_strategy == "full")
