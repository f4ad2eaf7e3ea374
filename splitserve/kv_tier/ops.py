"""One step's block copies between the device KV cache and the offloading tier: decided by the
engine's index (kv_tier/index.py), carried with the step (executor/step_input.py), made by each
rank's copier (kv_tier/copier.py) before the step's forward."""

from __future__ import annotations

import msgspec

# KVOffloadOps' kinds of copy
OFFLOAD_STORE, OFFLOAD_HOST_LOAD, OFFLOAD_DISK_LOAD = 0, 1, 2


class KVOffloadOps(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's block copies between the device KV cache and the offloading tier (kv_tier/index.py),
    made before its forward, in the order given: each reads what the ones before it wrote.

    Each is (kind, source, destination, block hash in hex):
    - OFFLOAD_STORE: a device block about to be reused -> a host slot (-1: none); with a hash, its
      file in the disk tier is written too;
    - OFFLOAD_HOST_LOAD: a host slot -> a device block;
    - OFFLOAD_DISK_LOAD: the hash's file in the disk tier -> a device block (source -1)."""

    copies: list[tuple[int, int, int, str]] = []
    disk_dir: str = ""  # the disk tier's directory for this model and layout
