"""The KV offloading tier (vLLM's `--kv-offloading-size GiB --kv-offloading-backend native`; with
`--kv-cache-dir PATH`, also files on disk): prefix-cache blocks evicted from the device pool are
kept in host memory, least recently used out first, and on disk when a directory is given; a
prompt whose prefix is no longer on the device but still in a lower tier loads those blocks back
into fresh device blocks before its step instead of computing them again.

Pure Python, like the block pool it extends (engine/core/kv_cache_manager.py): the pool calls `offload`
when it reuses a block that has a hash, and `KVCacheManager.get_computed_blocks` asks `lookup`
where the device misses. What this decides reaches the model runners as one step's copies
(kv_tier/ops.py KVOffloadOps; kv_tier/copier.py makes them), all before the forward
of the step whose allocations caused them, in the order they were decided. Only the engine reads
or changes this index, so that a block counted as a hit is still there when its step runs.

The disk tier is written through: a block offloaded to host memory is also written to disk, so a
restart finds every block that left the device (kv_tier/disk_index.py indexes the files).
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from splitserve.kv_tier.disk_index import DiskTierIndex
from splitserve.kv_tier.files import layout_key, tier_directory
from splitserve.kv_tier.ops import OFFLOAD_DISK_LOAD, OFFLOAD_HOST_LOAD, OFFLOAD_STORE, KVOffloadOps
from splitserve.kv_tier.stats import KVOffloadStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierHit:
    """A prefix block found in the offloading tier: it gets a fresh device block and is loaded."""

    block_hash: bytes
    host_slot: int  # -1: only on disk


class KVOffloadTier:
    def __init__(self, num_host_blocks: int, disk: DiskTierIndex | None = None, disk_dir: str = ""):
        assert num_host_blocks > 0 or disk is not None, "an offloading tier needs host blocks or a disk"
        self.num_host_blocks = num_host_blocks
        self.host: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self.free_slots = list(range(num_host_blocks - 1, -1, -1))
        self.disk = disk
        self.disk_dir = disk_dir
        self.stats = KVOffloadStats()
        self._ops = KVOffloadOps()

    # --- what the block pool and the cache manager call ---------------------------------------
    def offload(self, device_block: int, block_hash: bytes) -> None:
        """A device block with this hash is about to be reused: keep its KV (unless it is kept already)."""
        slot = -1
        if self.num_host_blocks:
            if block_hash in self.host:
                self.host.move_to_end(block_hash)
            else:
                slot = self.free_slots.pop() if self.free_slots else self.host.popitem(last=False)[1]
                self.host[block_hash] = slot
        to_disk = self.disk is not None and self.disk.add(block_hash)
        if slot >= 0 or to_disk:
            self._ops.copies.append((OFFLOAD_STORE, device_block, slot, block_hash.hex() if to_disk else ""))
            self.stats.stored_blocks += 1

    def lookup(self, block_hash: bytes) -> TierHit | None:
        slot = self.host.get(block_hash)
        if slot is not None:
            self.host.move_to_end(block_hash)
            return TierHit(block_hash, slot)
        if self.disk is not None and self.disk.contains(block_hash):
            return TierHit(block_hash, -1)
        return None

    def load(self, hit: TierHit, device_block: int) -> None:
        """Copy a hit into the device block given to it, before the step's forward (after the
        copies decided before it: the slot may have been filled in this same step, or be refilled
        by a later `offload` of it)."""
        if hit.host_slot >= 0:
            self._ops.copies.append((OFFLOAD_HOST_LOAD, hit.host_slot, device_block, ""))
            self.stats.host_hit_blocks += 1
        else:
            self._ops.copies.append((OFFLOAD_DISK_LOAD, -1, device_block, hit.block_hash.hex()))
            self.stats.disk_hit_blocks += 1

    def take_ops(self) -> KVOffloadOps | None:
        """The copies decided since the last call (None: none), for the next step."""
        ops = self._ops
        if not ops.copies:
            return None
        self._ops = KVOffloadOps()
        ops.disk_dir = self.disk_dir if self.disk is not None else ""
        return ops

    def snapshot_stats(self) -> KVOffloadStats:
        skipped = self.disk.num_skipped if self.disk is not None else 0
        return msgspec.structs.replace(self.stats, disk_skipped_files=skipped)

    def reset(self) -> None:
        """Forget the host tier (the prefix cache was reset); the disk tier stays, keyed by model."""
        self.host.clear()
        self.free_slots = list(range(self.num_host_blocks - 1, -1, -1))

    def new_weights(self, config) -> None:
        """The model's weights changed (a weight update): nothing kept here holds their KV. The host
        tier is forgotten and the disk tier moves to the new weights' directory (its key changed)."""
        self.reset()
        if self.disk is not None:
            key = layout_key(tier_layout(config))
            self.disk_dir = tier_directory(os.path.dirname(self.disk_dir), key)
            self.disk = DiskTierIndex(self.disk_dir, key, config.parallel_config.world_size, self.disk.capacity_blocks)

    def check_invariants(self) -> None:
        slots = list(self.host.values())
        assert len(set(slots)) == len(slots), "a host slot holds two blocks"
        assert not set(slots) & set(self.free_slots), "a host slot both free and used"
        assert len(slots) + len(self.free_slots) == self.num_host_blocks


def make_offload_tier(config, executor) -> KVOffloadTier | None:
    """The tier an EngineConfig asks for, sized in blocks by the ranks (the smallest rank's
    answer); sets CacheConfig.num_offload_blocks. None when offloading is off."""
    cc = config.cache_config
    if not cc.offloads_kv:
        return None
    if cc.kv_offloading_bytes:
        cc.num_offload_blocks = executor.determine_num_cpu_blocks(cc.kv_offloading_bytes)
        if cc.num_offload_blocks < 1:
            raise ValueError("--kv-offloading-size is smaller than one KV block per rank: raise it.")
    disk, disk_dir = None, ""
    if cc.kv_cache_dir:
        key = layout_key(tier_layout(config))
        disk_dir = tier_directory(os.path.abspath(cc.kv_cache_dir), key)
        capacity = executor.determine_num_cpu_blocks(cc.kv_cache_dir_bytes)
        if capacity < 1:
            raise ValueError("--kv-cache-dir-size is smaller than one KV block per rank: raise it.")
        disk = DiskTierIndex(disk_dir, key, config.parallel_config.world_size, capacity)
    logger.info(
        "KV offloading: %d blocks in host memory per rank%s",
        cc.num_offload_blocks,
        f", up to {disk.capacity_blocks} blocks per rank on disk in {disk_dir}" if disk is not None else "",
    )
    return KVOffloadTier(cc.num_offload_blocks, disk, disk_dir)


def tier_layout(config) -> dict:
    """What must match for a block written by one engine to be read by another: the weights (their
    files' names, sizes and times), dtypes, block size and parallel layout."""
    mc, cc, pc = config.model_config, config.cache_config, config.parallel_config
    qc = mc.quant_config
    return {
        "model": os.path.abspath(mc.model) if os.path.exists(mc.model) else mc.model,
        "weights": _weights_fingerprint(mc.model),
        "load_format": mc.load_format,
        "seed": mc.seed if mc.load_format == "dummy" else None,
        "dtype": str(mc.dtype),
        "quantization": None if qc is None else [type(qc).__name__, json.dumps(vars(qc), sort_keys=True, default=str)],
        "kv_cache_dtype": cc.cache_dtype,
        "block_size": cc.block_size,
        "tp": pc.tensor_parallel_size,
        "pp": pc.pipeline_parallel_size,
    }


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _weights_fingerprint(path: str) -> list:
    if os.path.isfile(path):
        st = os.stat(path)
        return [[os.path.basename(path), st.st_size, st.st_mtime_ns]]
    if not os.path.isdir(path):
        return []
    out = []
    for name in sorted(os.listdir(path)):
        if name.endswith(_WEIGHT_SUFFIXES):
            st = os.stat(os.path.join(path, name))
            out.append([name, st.st_size, st.st_mtime_ns])
    return out
