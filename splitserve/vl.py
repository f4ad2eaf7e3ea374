"""LMDeploy's `lmdeploy.vl` under splitserve's name: `from splitserve.vl import load_image`, for the
images of `pipe((prompt, image))` (docs/multimodal.md)."""

from __future__ import annotations

from splitserve.multimodal.media import MediaConfig
from splitserve.multimodal.media import load_image as _load_image


def load_image(image_url):
    """An RGB PIL image from an http(s) URL, a data: URI, a file path or file:// URL, or a PIL image,
    fully decoded (a corrupt or unsupported image raises ValueError here)."""
    return _load_image(image_url, MediaConfig.offline())
