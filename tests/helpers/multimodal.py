"""Tiny random-weight vision-language models and their processors, built locally (no download),
and small test images."""

from __future__ import annotations

# A LLaVA (CLIP vision tower, 2-layer MLP projector, Llama) small enough for seconds on two cores:
# 56 x 56 images in 7 x 7 patches are 64 image tokens, four KV blocks of 16.
LLAVA_IMAGE_SIZE, LLAVA_PATCH = 56, 7
LLAVA_IMAGE_TOKENS = (LLAVA_IMAGE_SIZE // LLAVA_PATCH) ** 2

# A chat template that renders image parts as the processor's <image> and text parts as they are.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_llava(directory: str, tokenizer, *, seed: int = 0) -> str:
    """LlavaForConditionalGeneration with the SmolLM2 vocabulary plus <image>, saved with its processor
    (CLIP image processor, LlavaProcessor) and a chat template that takes image parts."""
    import copy

    import torch
    import transformers

    from tests.helpers.models import TINY_CONFIG

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    text = transformers.LlamaConfig(**{**TINY_CONFIG, "vocab_size": len(tokenizer)}, tie_word_embeddings=False)
    text.bos_token_id, text.eos_token_id = 1, 2
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        image_size=LLAVA_IMAGE_SIZE,
        patch_size=LLAVA_PATCH,
        projection_dim=32,
    )
    config = transformers.LlavaConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_index=image_token_id,
        image_seq_length=LLAVA_IMAGE_TOKENS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # transformers' initialisation is too gentle for the images to matter
        for name, param in model.named_parameters():
            if "norm" in name:  # layernorm / RMSNorm scales near 1
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": LLAVA_IMAGE_SIZE}, crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=LLAVA_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(directory)
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def random_image(seed: int, size: tuple[int, int] = (64, 48)):
    """An RGB image of random pixels (PIL)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


# A Qwen2-VL: 4 x 4 patches merged 2 x 2, so a 64 x 48 image is a 16 x 12 grid of 48 tokens.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def make_tiny_qwen2_vl(directory: str, tokenizer, *, seed: int = 0, version: str = "2") -> str:
    """Qwen2VLForConditionalGeneration (ViT with 2D rotary, 2 x 2 patch merger, Qwen2 with M-RoPE) with
    the SmolLM2 vocabulary plus Qwen2-VL's vision tokens, saved with its image processor. version "2.5":
    Qwen2.5-VL, whose tower has RMSNorms, gated MLPs and attention in windows of 2 x 2 merged tokens
    (layers 1 and 3 over the whole image)."""
    import copy

    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.helpers.models import TINY_CONFIG

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_VL_TOKENS})
    ids = dict(zip(QWEN2_VL_TOKENS, tokenizer.convert_tokens_to_ids(QWEN2_VL_TOKENS)))
    text = {
        **TINY_CONFIG,
        "vocab_size": len(tokenizer),
        "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    vision = dict(depth=2, embed_dim=32, hidden_size=TINY_CONFIG["hidden_size"], num_heads=2, mlp_ratio=2)
    if version == "2.5":
        vision = dict(depth=4, hidden_size=32, intermediate_size=48, out_hidden_size=TINY_CONFIG["hidden_size"])
        vision.update(num_heads=2, hidden_act="silu", window_size=16, fullatt_block_indexes=[1, 3])
    vision.update(patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config_cls = transformers.Qwen2_5_VLConfig if version == "2.5" else transformers.Qwen2VLConfig
    model_cls = (
        transformers.Qwen2_5_VLForConditionalGeneration
        if version == "2.5"
        else transformers.Qwen2VLForConditionalGeneration
    )
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,  # as Qwen2-VL-2B: the flag is the outer config's, not text_config's
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    processor = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=96 * 96
    )
    processor.save_pretrained(directory)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory
