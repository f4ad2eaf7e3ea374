"""What travels between KV connectors: a decode side's requests (PullRequest: send me these blocks
of a lease; Release: the lease is done), and what one KV pull carries back: a header naming the
blocks, then their bytes (and a quantized cache's scales), gathered from a rank's KV cache on the
prefill side and scattered into it on the decode side. The header's request id, block ids, shape,
dtype and CRC-32 let the decode side refuse a frame that is not the one it asked for."""

from __future__ import annotations

import zlib

import msgspec
import torch


class PullRequest(msgspec.Struct, tag="pull", array_like=True):
    request_id: str
    first_block: int
    num_blocks: int


class Release(msgspec.Struct, tag="release", array_like=True):
    request_id: str


ConnectorMessage = PullRequest | Release

_BLOCK_DIM = 2  # of a layer's cache [2, num_kv_heads, num_blocks, block_size, head_dim]


class KVFrameHeader(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    first_block: int = 0
    block_ids: list[int] = []
    shape: list[int] = []
    dtype: str = ""
    checksum: int = 0  # CRC-32 of the data frame, continued over the scales frame if any
    error: str | None = None
    kv_cache_dtype: str = "auto"
    scale_shape: list[int] = []  # a quantized cache's scales (float32); [] when none travel


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gather(tensors: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """Blocks `index` of every layer's tensor: one CPU tensor [layers, 2, heads, len(index), block_size, last]."""
    return torch.stack([t.index_select(_BLOCK_DIM, index) for t in tensors]).cpu().contiguous()


def scatter(tensors: list[torch.Tensor], index: torch.Tensor, data: torch.Tensor) -> None:
    """The inverse of gather: data's blocks into blocks `index` of every layer's tensor."""
    for tensor, blocks in zip(tensors, data):
        if tensor.element_size() == 1:  # int8, fp8, packed int4: CPU index_copy_ has no float8 kernel
            tensor, blocks = tensor.view(torch.uint8), blocks.view(torch.uint8)
        tensor.index_copy_(_BLOCK_DIM, index, blocks.to(tensor.device))


def frame_shape(tensors: list[torch.Tensor], num_blocks: int) -> list[int]:
    shape = [len(tensors), *tensors[0].shape]
    shape[1 + _BLOCK_DIM] = num_blocks
    return shape


def crc32(buffers) -> int:
    checksum = 0
    for buffer in buffers:
        checksum = zlib.crc32(buffer, checksum)
    return checksum
