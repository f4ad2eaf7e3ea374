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
