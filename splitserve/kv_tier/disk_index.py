"""The engine's index of the disk tier (`--kv-cache-dir`): which blocks, by prefix-cache hash, have
files every rank can read, the least recently used first out past `--kv-cache-dir-size`.

The files themselves (kv_tier/files.py) are written and read by the model runners. A
block counts as on disk once its file is there (a write still queued, or one that failed, is a
miss); the index trusts the files this engine asked for, and any other file (left by an earlier run, or written by
another instance of the same model on this host) is read and checked, every rank's, before it
counts as a hit: a corrupt, cut-short or foreign file is skipped with a warning and removed.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

from splitserve.kv_tier.files import TierFileError, block_path, parse_block_name, read_block_file

logger = logging.getLogger(__name__)


class DiskTierIndex:
    def __init__(self, directory: str, key: str, world_size: int, capacity_blocks: int):
        assert capacity_blocks > 0
        self.directory, self.key, self.world_size = directory, key, world_size
        self.capacity_blocks = capacity_blocks
        os.makedirs(directory, exist_ok=True)
        # hash -> whether its files are known good (written by this engine, or checked)
        self.blocks: OrderedDict[bytes, bool] = OrderedDict()
        self.num_skipped = 0
        found = self._scan()
        for block_hash in found:
            self.blocks[block_hash] = False
        self._evict_past_capacity()
        if found:
            logger.info("KV disk tier %s: %d blocks from earlier runs", directory, len(self.blocks))

    def _scan(self) -> list[bytes]:
        """Blocks whose rank-0 file is there, oldest first."""
        entries = []
        with os.scandir(self.directory) as it:
            for entry in it:
                parsed = parse_block_name(entry.name)
                if parsed is not None and parsed[1] == 0:
                    entries.append((entry.stat().st_mtime_ns, bytes.fromhex(parsed[0])))
        return [h for _, h in sorted(entries)]

    def __len__(self) -> int:
        return len(self.blocks)

    def contains(self, block_hash: bytes) -> bool:
        """Whether the block can be read back from disk (checking its files the first time)."""
        trusted = self.blocks.get(block_hash)
        if not os.path.exists(block_path(self.directory, block_hash.hex(), 0)):
            # not written yet (the runners write in the background), a write that failed, or removed
            return False
        if trusted is None:
            trusted = False  # written by another instance since this index was made
        if not trusted and not self._check(block_hash):
            self.blocks.pop(block_hash, None)
            return False
        self.blocks[block_hash] = True
        self.blocks.move_to_end(block_hash)
        self._evict_past_capacity(keep=block_hash)
        return True

    def _check(self, block_hash: bytes) -> bool:
        hex_hash = block_hash.hex()
        for rank in range(self.world_size):
            try:
                read_block_file(block_path(self.directory, hex_hash, rank), self.key, hex_hash, rank)
            except TierFileError as e:
                logger.warning("KV disk tier: skipping block %s: %s", hex_hash[:16], e)
                self.num_skipped += 1
                self._remove(hex_hash)
                return False
        return True

    def add(self, block_hash: bytes) -> bool:
        """A block is being offloaded: True when its files are to be written (not there yet)."""
        if block_hash in self.blocks:
            self.blocks.move_to_end(block_hash)
            return False
        self.blocks[block_hash] = True
        self._evict_past_capacity(keep=block_hash)
        return True

    def _evict_past_capacity(self, keep: bytes | None = None) -> None:
        while len(self.blocks) > self.capacity_blocks:
            block_hash = next(iter(self.blocks))
            if block_hash == keep:
                return
            del self.blocks[block_hash]
            self._remove(block_hash.hex())

    def _remove(self, hex_hash: str) -> None:
        for rank in range(self.world_size):
            try:
                os.unlink(block_path(self.directory, hex_hash, rank))
            except FileNotFoundError:
                pass
