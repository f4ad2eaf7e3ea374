"""The offloading tier's counters, reported with the engine's stats (/metrics)."""

from __future__ import annotations

import msgspec


class KVOffloadStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """The KV offloading tier's counters since start (kv_tier/index.py), in blocks."""

    stored_blocks: int = 0  # kept when their device block was reused (host memory and/or disk)
    host_hit_blocks: int = 0  # loaded back from host memory
    disk_hit_blocks: int = 0  # loaded back from disk
    disk_skipped_files: int = 0  # disk-tier blocks refused: corrupt, cut short or another layout's
