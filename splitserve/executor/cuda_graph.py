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
from splitserve.executor.host import to_device

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
        # The static inputs live in two device buffers, so that a step's inputs arrive in two copies:
        # int64 rows (token ids, positions, slots, dynamic-NTK rope lengths) and int32 (the sequence
        # lengths, then the block table's rows).
        self._longs = torch.zeros(4, largest, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, rope_lengths = self._longs
        self.slot_mapping.fill_(pad_block * block_size)
        rope_lengths.fill_(1)
        self.rope_lengths = rope_lengths if uses_rope_lengths else None  # an input only for dynamic NTK
        self._ints = torch.full((largest * (1 + width),), pad_block, dtype=torch.int32, device=device)
        self.seq_lens = self._ints[:largest]
        self.seq_lens.fill_(1)
        self.block_tables = self._ints[largest:].view(largest, width)
        # Their host images, two sets used in turn: a set is rewritten only after its copy (two steps
        # before) has left it. Pinned on CUDA, so that the copies run asynchronously.
        pin = device.type == "cuda"
        self._host = [
            (torch.zeros(self._longs.shape, dtype=torch.long, pin_memory=pin),
             torch.zeros(self._ints.shape, dtype=torch.int32, pin_memory=pin))
            for _ in range(2)
        ]  # fmt: skip
        # recorded after each set's copies (an event never recorded synchronizes at once)
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if pin else None
        self._turn = 0
        self.captured: dict[int, tuple] = {}

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

    def stage(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        rope_lengths: list[int] | None = None,
        pending: tuple[list[int], list[int], torch.Tensor] | None = None,
    ) -> int:
        """Put one decode step of n = len(input_ids) requests (n <= max_batch_size) into the static
        buffers, rows n to the graph's size as padding, in two host-to-device copies; returns the
        size of the graph to replay. `pending` (rows, their rows in `tokens`, tokens): token ids that
        the step before is still sampling on the device (overlap scheduling)."""
        n, size = len(input_ids), self.padded_size(len(input_ids))
        largest, width = self.block_tables.shape
        longs, ints = self._host[self._turn]
        if self._copied is not None:
            self._copied[self._turn].synchronize()  # this set's last copy has left it (at once, mostly)
        host = longs.numpy()
        for row, values, pad in (
            (host[0], input_ids, 0),
            (host[1], positions, 0),
            (host[2], slot_mapping, self.pad_block * self.block_size),
            (host[3], rope_lengths, 1),
        ):
            if values is not None:
                row[:n] = values
            row[n:size] = pad
        flat = ints.numpy()
        flat[:n], flat[n:size] = seq_lens, 1
        table = flat[largest:].reshape(largest, width)
        table[:n, : block_table.shape[1]] = block_table.numpy()
        table[n:size] = self.pad_block
        self._longs.copy_(longs, non_blocking=True)
        end = largest + size * width
        self._ints[:end].copy_(ints[:end], non_blocking=True)
        if pending:
            self._take_pending(*pending)
        if self._copied is not None:
            self._copied[self._turn].record()
        self._turn ^= 1
        return size

    def _take_pending(self, rows: list[int], sources: list[int], tokens: torch.Tensor) -> None:
        if rows == sources == list(range(len(rows))):  # the usual case: the same requests in the same order
            self.input_ids[: len(rows)].copy_(tokens[: len(rows)])
            return
        device = self.input_ids.device
        self.input_ids[to_device(rows, torch.long, device)] = tokens[to_device(sources, torch.long, device)]

    def replay(self, size: int, n: int) -> torch.Tensor:
        """Replay the graph of `size` on the staged inputs: the final hidden states of rows [0, n)."""
        graph, hidden = self.captured[size]
        graph.replay()
        return hidden[:n]
