from splitserve.executor.attention.backend import AttentionBackend, AttentionMetadata
from splitserve.executor.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
