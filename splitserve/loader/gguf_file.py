"""A .gguf file's tensors, memory-mapped, without parsing more metadata than loading needs.

The `gguf` package's GGUFReader builds a Python object for every element of every metadata array
(SmolLM2's 49,152 tokens, their scores and types, 48,900 merges): 4-9 s before the first tensor.
The weights need only the tensor index, the architecture name and the alignment, so this reader
skips the arrays by their lengths and maps the file: each tensor is a zero-copy view of it, in
its GGUF blocks ([rows, row bytes] uint8 for a quantized tensor). The layout is GGUF's v2/v3
(little-endian): header, metadata key/values, tensor infos, aligned data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
import torch

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# metadata value types: the fixed-size ones by struct format; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass
class GGUFTensor:
    name: str
    qtype: int  # ggml type id (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # torch order: outermost first ([out_features, in_features] for a weight)
    data: (
        torch.Tensor
    )  # uint8 [rows, row bytes] (rows of every outer dim: experts x rows for 3-d), or [bytes] (1-d), a view of the file

    @property
    def row_elements(self) -> int:
        return self.shape[-1]


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.unpack("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")


def _skip_strings(buf: memoryview, pos: int, count: int) -> int:
    """The position after `count` length-prefixed strings from `pos` (a tokenizer's vocabulary and
    merges: about 100,000 strings, skipped in milliseconds by one precompiled unpacker in a local loop)."""
    length_at = _U64.unpack_from
    for _ in range(count):
        pos += 8 + length_at(buf, pos)[0]
    return pos


def _read_value(cur: _Cursor, vtype: int):
    """A scalar or string value; arrays are skipped (None), strings inside them by their lengths."""
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype])
    if vtype == _STRING:
        return cur.string()
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {vtype}")
    etype, count = cur.unpack("IQ")
    if etype in _SCALARS:
        cur.pos += count * struct.calcsize(_SCALARS[etype])
    elif etype == _STRING:
        cur.pos = _skip_strings(cur.buf, cur.pos, count)
    else:
        for _ in range(count):
            _read_value(cur, etype)
    return None


class GGUFFile:
    """The scalar metadata and the tensors of a .gguf file, mapped copy-on-write (the tensors keep the
    mapping alive)."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        cur = _Cursor(memoryview(self._map))
        self.metadata, n_tensors = _read_header(cur, path)
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        alignment = self.metadata.get("general.alignment") or _DEFAULT_ALIGNMENT
        data_start = -(-cur.pos // alignment) * alignment
        whole = torch.frombuffer(self._map, dtype=torch.uint8) if len(self._map) else torch.empty(0, dtype=torch.uint8)
        self.tensors = [self._tensor(whole, data_start, *info) for info in infos]

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string()
        n_dims = cur.unpack("I")
        dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
        cur.pos += 8 * n_dims
        qtype, offset = cur.unpack("IQ")
        return name, tuple(reversed(dims)), qtype, offset

    @staticmethod
    def _tensor(whole: torch.Tensor, data_start: int, name: str, shape, qtype: int, offset: int) -> GGUFTensor:
        import gguf

        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        if shape[-1] % block_elems:
            raise ValueError(
                f"GGUF tensor {name}: rows of {shape[-1]} values are not whole {block_elems}-value blocks."
            )
        row_bytes = shape[-1] // block_elems * block_bytes
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        start = data_start + offset
        data = whole[start : start + rows * row_bytes]
        return GGUFTensor(name, qtype, shape, data.view(rows, row_bytes) if len(shape) > 1 else data)

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]


def _read_header(cur: _Cursor, path: str) -> tuple[dict, int]:
    """The scalar metadata (arrays skipped: None) and the tensor count; the cursor is left at the
    tensor infos."""
    if bytes(cur.buf[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic number).")
    cur.pos = 4
    version, n_tensors, n_kv = cur.unpack("IQQ")
    if version < 2:
        raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are supported.")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = _read_value(cur, cur.unpack("I"))
    return metadata, n_tensors


def _read_index(path: str, with_tensors: bool) -> tuple[dict, list]:
    """The scalar metadata and, if asked, the tensor infos (name, shape, type, offset), nothing mapped
    for the caller and the `gguf` package not imported (0.13 s)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            cur = _Cursor(view)
            metadata, n_tensors = _read_header(cur, path)
            return metadata, [GGUFFile._tensor_info(cur) for _ in range(n_tensors if with_tensors else 0)]
        finally:
            view.release()


def read_gguf_metadata(path: str) -> dict:
    """A .gguf file's scalar metadata alone."""
    return _read_index(path, with_tensors=False)[0]


def gguf_is_quantized(path: str) -> bool:
    """Whether any matrix of the file is stored in quantized blocks (not F32/F16/BF16)."""
    from splitserve.layers.gguf_weight import DENSE_TYPES

    return any(qtype not in DENSE_TYPES and len(shape) >= 2 for _, shape, qtype, _ in _read_index(path, True)[1])
