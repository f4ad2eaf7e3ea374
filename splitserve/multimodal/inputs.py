"""What the engine carries of a request's images: each one's encoder inputs (pixel values ...), the
prompt tokens its embeddings replace, and an identifier of its pixels, as data only (msgspec), so
that a request with images travels between processes and to every rank like any other.

The identifier names the image's content: the runner's encoder cache keys its embeddings by it (an
image repeated in a request, across requests or across the chunks of one prompt is encoded once), and
the prefix cache mixes it into the hash of every block that holds its tokens, so that two prompts
with the same placeholder tokens but different images never share KV.
"""

from __future__ import annotations

import msgspec
import numpy as np


class TensorData(msgspec.Struct, array_like=True):
    """A numpy array as bytes: dtype name, shape, C-order data."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_array(cls, array) -> TensorData:
        array = np.ascontiguousarray(array)
        return cls(array.dtype.name, list(array.shape), array.tobytes())

    def to_array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)


class MultiModalFeature(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image of a prompt: its embeddings replace prompt tokens offset .. offset + length - 1."""

    modality: str  # "image"
    identifier: str  # the hash of its content (multimodal/media.py's image_hash)
    offset: int
    length: int
    data: dict[str, TensorData] = {}  # the encoder's inputs, by the processor's names (pixel_values ...)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """The part of its embeddings (lo, hi) that prompt positions start .. end - 1 take, if any."""
        lo, hi = max(start, self.offset), min(end, self.end)
        return (lo - self.offset, hi - self.offset) if lo < hi else None


def block_extra_keys(features: list[MultiModalFeature], start: int, end: int) -> bytes:
    """What a prefix-cache block over prompt positions start .. end - 1 adds to its hash: the
    identifiers of the images whose tokens it holds, with where they begin."""
    keys = [f"{f.identifier}@{f.offset}" for f in features if f.overlap(start, end) is not None]
    return ";".join(keys).encode() if keys else b""


def placement(feature: MultiModalFeature) -> dict:
    """Where an image lies in its prompt, as JSON, without its pixels: what a prefill instance tells
    the decode instance (which pulls the prompt's KV, so it never encodes the image), so that it keys
    the image's blocks by the image and gives the tokens after it their rope positions (M-RoPE)."""
    grids = {name: t.to_array().tolist() for name, t in feature.data.items() if name != "pixel_values"}
    return {"identifier": feature.identifier, "offset": feature.offset, "length": feature.length, **grids}


def feature_from_placement(value) -> MultiModalFeature:
    """The MultiModalFeature of a placement (no pixels); ValueError for one that is malformed."""
    if not isinstance(value, dict) or not isinstance(value.get("identifier"), str):
        raise ValueError("an image placement must be an object with identifier, offset and length.")
    offset, length = value.get("offset"), value.get("length")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)) or not length:
        raise ValueError("an image placement's offset and length must be integers, length >= 1.")
    grid = value.get("image_grid_thw")
    data = {}
    if grid is not None:
        if not (isinstance(grid, list) and len(grid) == 3 and all(isinstance(v, int) and v > 0 for v in grid)):
            raise ValueError("an image placement's image_grid_thw must be three positive integers.")
        data["image_grid_thw"] = TensorData.from_array(np.asarray(grid, dtype=np.int64))
    return MultiModalFeature("image", value["identifier"], offset, length, data)
