"""Attention backends behind one interface (backend.py): the torch reference, the C++ CPU kernels and
Triton on CUDA; selector.py picks one for a device and KV-cache dtype."""

from splitserve.executor.attention.backend import AttentionBackend, AttentionMetadata
from splitserve.executor.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
