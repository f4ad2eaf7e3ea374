"""CUDA graphs for decode steps.

A decode step of a small model is a few hundred short kernels; launched one by one from Python,
the launches cost more than the kernels. At start-up the model's forward is captured once per
batch size of a ladder (1, 2, 4, 8, 16, 24, ... up to the largest size), and a decode-only step of
n requests replays the graph of the smallest captured size >= n, its inputs copied into the graph's
static buffers and the extra rows padded:

- a padding row has token 0 at position 0, writes its K/V into a padding block that the block
  manager never hands out (so no request's cache is touched), and attends to that one token;
- the attention kernels read sequence lengths and block tables from device tensors, and the
  decode kernel's split count is fixed at capture for any length up to max_model_len
  (AttentionMetadata.decode_len_bound), so one graph serves every step of its size.

Only backends whose kernels need no host-side lengths can be captured (`supports_cuda_graphs`:
the Triton backend). Graphs of all sizes share one memory pool, captured largest first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from splitserve.executor.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

MAX_DEFAULT_CAPTURE_SIZE = 512


def capture_sizes(cuda_graph_sizes: list[int] | None, max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending, as vLLM's --cuda-graph-sizes reads them: one value N
    means 1, 2, 4 and the multiples of 8 up to N; several values are the sizes themselves. None
    means N = min(max_num_seqs, 512). Sizes above max_num_seqs are dropped (never used)."""
    if cuda_graph_sizes is not None and any(size < 1 for size in cuda_graph_sizes):
        raise ValueError(f"cuda_graph_sizes must be positive, got {cuda_graph_sizes}.")
    if cuda_graph_sizes is None or len(cuda_graph_sizes) == 1:
        largest = cuda_graph_sizes[0] if cuda_graph_sizes else min(max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE)
        sizes = [s for s in (1, 2, 4) if s <= largest] + list(range(8, largest + 1, 8))
        if largest not in sizes:
            sizes.append(largest)
    else:
        sizes = sorted(set(cuda_graph_sizes))
    return [s for s in sizes if s <= max_num_seqs] or [min(sizes[0], max_num_seqs)]


def _free_gpu_memory() -> int:
    """Free device memory: what the graphs' pool keeps, freed blocks included, shows in its change."""
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


class CudaGraphPool:
    """Captures callables into CUDA graphs that share one memory pool."""

    def __init__(self):
        self.pool = None

    def capture(self, fn: Callable[[], torch.Tensor]):
        """Returns (graph, output): graph.replay() reruns fn's kernels and refreshes output in place."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        self.pool = graph.pool()
        return graph, output


class CUDAGraphRunner:
    """Replays captured decode forwards. `forward(input_ids, positions, meta) -> hidden` is the
    model; `pad_block` is the cache block reserved for padding rows."""

    def __init__(
        self,
        forward: Callable,
        backend: AttentionBackend,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        pad_block: int,
        device: torch.device,
        uses_rope_lengths: bool = False,
    ):
        self.forward, self.backend, self.sizes = forward, backend, sizes
        self.max_model_len, self.block_size, self.pad_block = max_model_len, block_size, pad_block
        self.graphs = CudaGraphPool()
        largest, width = sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), pad_block * block_size, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.full((largest, width), pad_block, dtype=torch.int32, device=device)
        # Dynamic NTK rope: each token's scaling length (AttentionMetadata.rope_lengths) is an input too.
        self.rope_lengths = torch.ones(largest, dtype=torch.long, device=device) if uses_rope_lengths else None
        self.captured: dict[int, tuple] = {}
        self._dirty_rows = 0  # rows [0, _dirty_rows) of the buffers hold the last batch's requests

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def capture_all(self) -> None:
        start = time.perf_counter()
        free_before = _free_gpu_memory()
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool's memory
            self.forward(*self._static_inputs(size))  # compiles kernels and warms caches outside capture
            self.captured[size] = self.graphs.capture(lambda size=size: self.forward(*self._static_inputs(size)))
        used = free_before - _free_gpu_memory()
        logger.info(
            "Captured CUDA graphs for %d decode batch sizes (1 to %d) in %.1f s, using %.2f GiB; "
            "--enforce-eager turns them off.",
            len(self.sizes),
            self.max_batch_size,
            time.perf_counter() - start,
            used / (1 << 30),
        )

    def _static_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        meta = AttentionMetadata(
            backend=self.backend,
            num_decodes=size,
            query_start_loc=list(range(size + 1)),
            seq_lens=[1] * size,
            seq_lens_tensor=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            block_size=self.block_size,
            decode_len_bound=self.max_model_len,
            rope_lengths=None if self.rope_lengths is None else self.rope_lengths[:size],
        )
        return self.input_ids[:size], self.positions[:size], meta

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size that serves a decode batch of num_reqs, or None when none does."""
        return next((s for s in self.sizes if s >= num_reqs), None)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        rope_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step of n = len(input_ids) requests (n <= max_batch_size): final hidden [n, H]."""
        n, width = len(input_ids), block_tables.shape[1]
        size = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        if self.rope_lengths is not None:
            self.rope_lengths[:n].copy_(rope_lengths, non_blocking=True)
        self._pad_rows(n)
        graph, hidden = self.captured[size]
        graph.replay()
        return hidden[:n]

    def _pad_rows(self, n: int) -> None:
        """Rows from n on that an earlier, larger batch filled hold real requests' slots and blocks:
        turn them back into padding before a replay reads them."""
        if self._dirty_rows > n:
            rows = slice(n, self._dirty_rows)
            self.slot_mapping[rows].fill_(self.pad_block * self.block_size)
            self.seq_lens[rows].fill_(1)
            self.block_tables[rows].fill_(self.pad_block)
            self.positions[rows].zero_()
            self.input_ids[rows].zero_()
            if self.rope_lengths is not None:
                self.rope_lengths[rows].fill_(1)
        self._dirty_rows = n
