"""Memory for the KV cache.

On CPU the cache is mapped lazily: anonymous memory that the OS fills with zero pages when a page
is first written, so that allocating a 4 GiB cache takes microseconds instead of seconds of page
faults and zeroing, and the process's resident memory grows with the blocks actually used (the
block pool hands out blocks in ascending order until it has used them all, so the used part is the
front of every layer's cache). The cache keeps 4 KiB pages even where torch's allocator asks for
transparent huge pages: a first write to a huge page makes the OS find and zero 2 MiB (0.1-4.5 ms on
the VMs measured), so the engine's warm-up, writing one block per layer, spent 0.4-1.0 s there, and
offline throughput (64 x 128/128, default model) was 1-3% lower with them. On CUDA the cache is
torch.zeros, as before.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap

import numpy as np
import torch

from splitserve.quantization.kv_cache import SCALE_DTYPE, KVCacheSpec


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU, backed by lazily mapped zero pages (the tensor keeps the mapping)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=dtype).view(shape)


def allocate_kv_cache(
    layers: list, spec: KVCacheSpec, block_size: int, device: torch.device, num_blocks: int
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per attention layer: the cache [2, heads, blocks, block_size, packed head_dim] and, when
    quantized, the scales; attached to the layers."""
    # Head-major: gathering a request's blocks gives [heads, tokens, head_dim] with no transposing copy.
    shape = (2, layers[0].num_kv_heads, num_blocks, block_size, spec.packed_head_dim(layers[0].head_dim))
    caches = [kv_zeros(shape, spec.storage_dtype, device) for _ in layers]
    scales = None
    if spec.quantized:
        # Each cached vector's scale fields, in the same layout: [2, heads, blocks, block_size, fields].
        scale_shape = (*shape[:-1], spec.num_scale_fields)
        scales = [kv_zeros(scale_shape, SCALE_DTYPE, device) for _ in layers]
    for i, layer in enumerate(layers):
        layer.kv_cache = caches[i]
        layer.kv_scales = scales[i] if scales is not None else None  # None: the unquantized path
    return caches, scales


def kv_memory_use(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(bytes allocated, bytes resident) of KV cache tensors: on CPU the resident pages as the
    kernel reports them (mincore), elsewhere all of them."""
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    if not tensors or tensors[0].device.type != "cpu":
        return allocated, allocated
    return allocated, sum(_resident(t.data_ptr(), t.numel() * t.element_size()) for t in tensors)


def _resident(address: int, nbytes: int) -> int:
    """Bytes of [address, address + nbytes) that are in memory, counted page by page."""
    page = mmap.PAGESIZE
    start = address - address % page
    length = address + nbytes - start
    pages = (ctypes.c_ubyte * -(-length // page))()
    if _libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed on the KV cache")
    return int((np.frombuffer(pages, dtype=np.uint8) & 1).sum()) * page


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
