"""A rank's side of the KV offloading tier (kv_tier/index.py decides, this copies): host memory
with the device cache's layout and `num_host_blocks` blocks (pinned on CUDA), the disk tier's
files for this rank (kv_tier/files.py), written by a background thread so that a step
never waits on the disk to store, and read back when a step loads a block from disk.

A step's copies (KVOffloadOps) are made in their order, in runs of one kind: each run is one
gather and one scatter per KV tensor.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

import msgspec
import torch

from splitserve.kv_tier.files import TierFileError, block_path, read_block_file, write_block_file
from splitserve.kv_tier.host_blocks import BLOCK_DIM, copy_blocks, host_blocks_like
from splitserve.kv_tier.ops import OFFLOAD_HOST_LOAD, OFFLOAD_STORE, KVOffloadOps

logger = logging.getLogger(__name__)


class KVOffloadCopier:
    def __init__(self, caches: list[torch.Tensor], scales: list[torch.Tensor] | None, num_host_blocks: int, rank: int):
        self.device_tensors = list(caches) + list(scales or [])
        self.host_tensors = host_blocks_like(self.device_tensors, num_host_blocks)
        self.rank = rank
        self._writer: _DiskWriter | None = None

    def apply(self, ops: KVOffloadOps | list) -> None:
        """Make a step's copies (also given alone, as a rank call's decoded argument: the copies a
        decode instance's KV pulls wait for, distributed/kv_transfer/connector.py)."""
        if not isinstance(ops, KVOffloadOps):
            ops = msgspec.convert(ops, KVOffloadOps)
        for kind, run in _runs(ops.copies):
            if kind == OFFLOAD_STORE:
                self._store(run, ops.disk_dir)
            elif kind == OFFLOAD_HOST_LOAD:
                copy_blocks(self.host_tensors, self.device_tensors, [(src, dst) for _, src, dst, _ in run])
            else:
                self._load_from_disk(run, ops.disk_dir)

    def _store(self, run: list[tuple[int, int, int, str]], disk_dir: str) -> None:
        to_host = [(src, dst) for _, src, dst, _ in run if dst >= 0]
        if to_host:
            copy_blocks(self.device_tensors, self.host_tensors, to_host)
        to_disk = [(src, hex_hash) for _, src, _, hex_hash in run if hex_hash]
        if not to_disk:
            return
        ids = torch.tensor([src for src, _ in to_disk], dtype=torch.long)
        gathered = [t.index_select(BLOCK_DIM, ids.to(t.device)).cpu() for t in self.device_tensors]
        if self._writer is None:
            self._writer = _DiskWriter()
        key = os.path.basename(disk_dir)
        for i, (_, hex_hash) in enumerate(to_disk):
            payload = b"".join(_as_bytes(g.select(BLOCK_DIM, i)) for g in gathered)
            self._writer.put(block_path(disk_dir, hex_hash, self.rank), key, hex_hash, self.rank, payload)

    def _load_from_disk(self, run: list[tuple[int, int, int, str]], disk_dir: str) -> None:
        if self._writer is not None:
            self._writer.flush()  # a block stored earlier may be read back now
        key = os.path.basename(disk_dir)
        for _, _, dst, hex_hash in run:
            path = block_path(disk_dir, hex_hash, self.rank)
            try:
                payload = read_block_file(path, key, hex_hash, self.rank)
            except TierFileError as e:  # the engine checked it: it changed since (another instance, by hand)
                raise RuntimeError(f"KV disk tier: a block counted as a hit cannot be loaded: {e}") from e
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            offset = 0
            for t in self.device_tensors:
                block = t.select(BLOCK_DIM, dst)
                n = block.numel() * block.element_size()
                if offset + n > buffer.numel():
                    raise RuntimeError(f"KV disk tier: {path} holds {buffer.numel()} bytes, fewer than a block's")
                block.copy_(buffer[offset : offset + n].view(t.dtype).view(block.shape))
                offset += n

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def rebind(self, caches: list[torch.Tensor], scales: list[torch.Tensor] | None) -> KVOffloadCopier:
        """Copy to and from another device KV cache (none while asleep: executor/sleep_mode.py); the
        host blocks and the disk writer stay."""
        self.device_tensors = list(caches) + list(scales or [])
        return self


def _runs(copies: list[tuple[int, int, int, str]]):
    """Consecutive copies of one kind, cut where a destination repeats (the later copy must see
    the earlier one's write)."""
    run: list[tuple[int, int, int, str]] = []
    seen: set[int] = set()
    for copy in copies:
        dst = copy[2]
        if run and (copy[0] != run[0][0] or (dst >= 0 and dst in seen)):
            yield run[0][0], run
            run, seen = [], set()
        run.append(copy)
        if dst >= 0:
            seen.add(dst)
    if run:
        yield run[0][0], run


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class _DiskWriter:
    """Block files written in the background, in order; `flush` waits for the queue to drain."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="kv-disk-tier-writer", daemon=True).start()

    def put(self, path: str, key: str, hex_hash: str, rank: int, payload: bytes) -> None:
        self._queue.put((path, key, hex_hash, rank, payload))

    def flush(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            path, key, hex_hash, rank, payload = self._queue.get()
            try:
                write_block_file(path, key, hex_hash, rank, payload)
            except OSError as e:
                logger.error("KV disk tier: could not write %s (%s): the block is not kept on disk", path, e)
            finally:
                self._queue.task_done()
