"""The attention backend interface and the per-step batch description it reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

BACKENDS = ("torch", "cpu", "triton")


@dataclass
class AttentionMetadata:
    """One step's batch, flattened: the tokens of every scheduled request, decodes first.

    Request i owns query tokens [query_start_loc[i], query_start_loc[i+1]) and, after this step,
    `seq_lens[i]` tokens of KV; its first `seq_lens[i] - query_len` tokens are already cached.
    Host-side lists are kept next to the tensors so that backends need no device->host syncs.
    """

    backend: AttentionBackend
    num_decodes: int  # requests 0..num_decodes-1 have exactly one query token
    query_start_loc: list[int]  # len R + 1
    seq_lens: list[int]  # len R
    seq_lens_tensor: torch.Tensor  # [R] int32 on device
    block_tables: torch.Tensor  # [R, max_blocks] int32 on device (rows padded with 0)
    slot_mapping: torch.Tensor  # [T] int64 on device: where each token's K/V is written
    block_size: int
    # Dynamic NTK rope only (None otherwise): per token, the sequence length its rotation is scaled
    # for, max(its request's prompt length, its position + 1) ([T] int64 on device).
    rope_lengths: torch.Tensor | None = None
    # CUDA graphs: the steps replayed from one capture may have any length up to this bound, so a
    # backend must not size its work from seq_lens (the host list is the capture's, not the step's).
    decode_len_bound: int | None = None
    # Device tensors a backend derives from the fields above (e.g. query_start_loc as a tensor):
    # the first layer of a step builds them, the others reuse them.
    scratch: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def query_start_tensor(self) -> torch.Tensor:
        """query_start_loc as an int64 CPU tensor, built by the first layer of the step that asks."""
        starts = self.scratch.get("query_start_loc")
        if starts is None:
            starts = self.scratch["query_start_loc"] = torch.tensor(self.query_start_loc, dtype=torch.long)
        return starts


class AttentionBackend(ABC):
    name: str
    # Whether a decode step can be captured in a CUDA graph: its kernels read lengths and block
    # tables from device tensors only, and it honours AttentionMetadata.decode_len_bound.
    supports_cuda_graphs: bool = False

    @abstractmethod
    def forward(
        self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Write k/v into layer.kv_cache at meta.slot_mapping, return attention output [T, Hq, D]."""
