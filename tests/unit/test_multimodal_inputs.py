"""The pieces of image input that need no model: chat content in a template's form (multimodal/chat.py),
the prefix-cache keys of blocks holding an image, and the encoder cache's hits and eviction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.executor.encoder_cache import EncoderCache, MultiModalSpan
from splitserve.multimodal import chat
from splitserve.multimodal.inputs import (
    MultiModalFeature,
    TensorData,
    block_extra_keys,
    feature_from_placement,
    placement,
)
from tests.helpers.multimodal import LLAVA_CHAT_TEMPLATE

STRING_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Compare"}, IMAGE, {"type": "image_pil", "image_pil": 7}],
        },
    ]


def test_content_format_is_read_from_the_template():
    assert chat.content_format(LLAVA_CHAT_TEMPLATE) == "openai"
    assert chat.content_format(STRING_TEMPLATE) == "string"
    assert (
        chat.content_format("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}")
        == "openai"
    )
    assert chat.content_format(None) == "string"


def test_split_images_in_both_forms():
    openai_form, images = chat.split_images(conversation(), "<image>", "openai")
    assert images == ["data:image/png;base64,AAAA", 7]
    assert openai_form[0] == {"role": "system", "content": "Be brief."}
    assert openai_form[1]["content"] == [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}]
    string_form, _ = chat.split_images(conversation(), "<image>", "string")
    assert string_form[1]["content"] == "<image>\n<image>\nCompare"
    assert not chat.has_images(conversation()[:1]) and chat.has_images(conversation())
    with pytest.raises(ValueError, match="no vision encoder"):
        chat.split_for_template(conversation(), None, STRING_TEMPLATE)


def test_lmdeploy_pairs():
    assert chat.is_image_prompt(("describe", object())) and chat.is_image_prompt(("describe", [1, 2]))
    assert not chat.is_image_prompt(("one prompt", "another prompt")) and not chat.is_image_prompt("text")
    (message,) = chat.image_prompt_messages("describe", [1, 2])
    assert [p["type"] for p in message["content"]] == ["image_pil", "image_pil", "text"]


def feature(identifier: str, offset: int, length: int = 4, value: float = 0.0) -> MultiModalFeature:
    pixels = TensorData.from_array(np.full((1, 2), value, dtype=np.float32))
    return MultiModalFeature("image", identifier, offset, length, {"pixel_values": pixels})


def test_blocks_holding_an_image_are_keyed_by_it():
    images = [feature("a", 6), feature("b", 20)]
    assert block_extra_keys(images, 0, 4) == b""  # before both
    assert block_extra_keys(images, 4, 8) == b"a@6"
    assert block_extra_keys(images, 8, 24) == b"a@6;b@20"
    assert block_extra_keys([feature("c", 6)], 4, 8) != block_extra_keys(images, 4, 8)
    assert feature("a", 6).overlap(8, 12) == (2, 4) and feature("a", 6).overlap(10, 12) is None


class FakeEncoder:
    """Embeds an image as `length` rows of its pixel value, counting calls."""

    def __init__(self):
        self.calls = 0

    def embed_images(self, images: list[dict]) -> list[torch.Tensor]:
        self.calls += 1
        return [image["pixel_values"][:1, :1].expand(4, 3).clone() for image in images]

    def embed_input_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(ids), 3)


def test_encoder_cache_places_rows_and_evicts_least_recently_used():
    model, cache = FakeEncoder(), EncoderCache(torch.device("cpu"), max_tokens=8)
    a, b, c = feature("a", 0, value=1.0), feature("b", 0, value=2.0), feature("c", 0, value=3.0)
    embeds = cache.inputs_embeds(model, torch.zeros(5, dtype=torch.long), [MultiModalSpan(a, 1, 4, 2)])
    assert embeds[:, 0].tolist() == [0, 0, 1, 1, 1]
    cache.embeddings(model, [a, b])  # a hit, b encoded
    assert (cache.num_encoded, cache.num_hits) == (2, 1)
    cache.embeddings(model, [c])  # 12 rows > 8: the least recently used (a) goes
    assert list(cache.entries) == ["b", "c"]
    cache.embeddings(model, [a, b, c])  # all three needed at once: kept while this step needs them
    assert cache.num_encoded == 4 and len(cache.entries) == 3


def test_a_placement_carries_everything_but_the_pixels():
    grid = TensorData.from_array(np.array([1, 4, 6], dtype=np.int64))
    full = MultiModalFeature(
        "image", "abc", 5, 6, {"pixel_values": TensorData.from_array(np.zeros(3)), "image_grid_thw": grid}
    )
    placed = feature_from_placement(placement(full))
    assert (placed.identifier, placed.offset, placed.length) == ("abc", 5, 6) and "pixel_values" not in placed.data
    assert placed.data["image_grid_thw"].to_array().tolist() == [1, 4, 6]
    for bad in (
        {"offset": 1, "length": 2},
        {"identifier": "x", "offset": -1, "length": 2},
        {"identifier": "x", "offset": 0, "length": 0},
        {"identifier": "x", "offset": 0, "length": 2, "image_grid_thw": [1, 2]},
        "x",
    ):
        with pytest.raises(ValueError):
            feature_from_placement(bad)
    with pytest.raises(RuntimeError, match="no pixels here"):
        EncoderCache(torch.device("cpu")).embeddings(FakeEncoder(), [placed])
