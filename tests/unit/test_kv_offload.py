"""The KV offloading tier's bookkeeping on tiny pools (kv_tier/index.py, kv_disk_tier.py), its
files (kv_tier/files.py) and a rank's copies (kv_tier/copier.py), exact block ids."""

from __future__ import annotations

import os

import pytest
import torch

from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.request import Request
from splitserve.kv_tier.copier import KVOffloadCopier
from splitserve.kv_tier.disk_index import DiskTierIndex
from splitserve.kv_tier.files import TierFileError, block_path, read_block_file, write_block_file
from splitserve.kv_tier.index import KVOffloadTier, TierHit
from splitserve.kv_tier.ops import OFFLOAD_DISK_LOAD, OFFLOAD_HOST_LOAD, OFFLOAD_STORE, KVOffloadOps
from splitserve.sampling_params import SamplingParams

BS = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, 0, 0.0)


def _fill(manager: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    """Admit a request, compute its whole prompt and free it (its blocks stay findable)."""
    request = _request(rid, tokens)
    hits, cached = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(tokens) - cached, hits)
    request.num_computed_tokens = len(tokens)
    manager.free(request)
    manager.check_invariants()
    return request


def test_evicted_blocks_go_to_host_and_come_back_in_order():
    tier = KVOffloadTier(num_host_blocks=8)
    manager = KVCacheManager(num_blocks=4, block_size=BS, offload=tier)
    a = list(range(100, 116))  # 4 full blocks: fills the pool
    _fill(manager, "a", a)
    assert tier.take_ops() is None  # nothing was evicted yet
    _fill(manager, "b", list(range(200, 216)))  # evicts all of a's blocks
    stores = tier.take_ops().copies
    assert [c[0] for c in stores] == [OFFLOAD_STORE] * 4 and sorted(c[2] for c in stores) == [0, 1, 2, 3]
    assert all(c[3] == "" for c in stores)  # no disk tier

    again = _request("a2", a)
    hits, cached = manager.get_computed_blocks(again)
    assert cached == 12 and all(isinstance(h, TierHit) for h in hits)  # the last block is computed
    assert manager.allocate_slots(again, 4, hits)
    copies = tier.take_ops().copies
    # The hits' fresh blocks are b's: stored first, then a's three blocks load into them in order;
    # the block for the last four tokens comes after.
    assert [c[0] for c in copies] == [OFFLOAD_STORE] * 3 + [OFFLOAD_HOST_LOAD] * 3 + [OFFLOAD_STORE]
    assert [c[1] for c in copies[3:6]] == [h.host_slot for h in hits]
    assert [c[2] for c in copies[3:6]] == manager.get_block_ids("a2")[:3]
    assert [c[1] for c in copies[:3]] == manager.get_block_ids("a2")[:3]
    assert tier.stats.host_hit_blocks == 3
    manager.check_invariants()
    tier.check_invariants()


def test_copies_keep_the_order_they_were_decided_in():
    """A slot read by a load and then refilled, or filled and then read, in one step: the runner
    makes the copies in this order, so each load reads what the slot held at that point."""
    tier = KVOffloadTier(num_host_blocks=1)
    h1, h2, h3 = (bytes([i]) * 32 for i in (1, 2, 3))
    tier.offload(0, h1)
    assert tier.take_ops().copies == [(OFFLOAD_STORE, 0, 0, "")]
    tier.load(tier.lookup(h1), 5)  # read slot 0 ...
    tier.offload(2, h2)  # ... then refill it (h1 leaves the host tier)
    tier.offload(3, h3)  # refilled again, least recently used first
    tier.load(tier.lookup(h3), 6)  # and read after that
    assert tier.take_ops().copies == [
        (OFFLOAD_HOST_LOAD, 0, 5, ""),
        (OFFLOAD_STORE, 2, 0, ""),
        (OFFLOAD_STORE, 3, 0, ""),
        (OFFLOAD_HOST_LOAD, 0, 6, ""),
    ]
    assert tier.lookup(h1) is None and tier.lookup(h2) is None
    tier.offload(4, h3)  # already kept: no copy
    assert tier.take_ops() is None
    tier.check_invariants()


def test_disk_index_trusts_its_own_files_checks_others_and_evicts(tmp_path):
    key, payload = "k" * 24, bytes(range(256)) * 4
    index = DiskTierIndex(str(tmp_path), key, world_size=2, capacity_blocks=2)
    h1, h2, h3 = (bytes([i]) * 32 for i in (1, 2, 3))
    assert index.add(h1) and not index.add(h1)
    assert not index.contains(h1)  # its files are not written yet: a miss, never a failed load
    for rank in (0, 1):
        write_block_file(block_path(str(tmp_path), h1.hex(), rank), key, h1.hex(), rank, payload)
    assert index.contains(h1)
    # Files another instance wrote are found and checked; a corrupt rank-1 file is skipped and removed.
    write_block_file(block_path(str(tmp_path), h2.hex(), 0), key, h2.hex(), 0, payload)
    damaged = block_path(str(tmp_path), h2.hex(), 1)
    write_block_file(damaged, key, h2.hex(), 1, payload)
    with open(damaged, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"x")
    assert not index.contains(h2) and index.num_skipped == 1
    assert not os.path.exists(block_path(str(tmp_path), h2.hex(), 0))
    # Past its capacity the least recently used block's files are deleted.
    index.add(h2)
    index.add(h3)
    assert h1 not in index.blocks and not os.path.exists(block_path(str(tmp_path), h1.hex(), 0))
    # A new index (a restart) finds what is on disk, unchecked until first asked.
    for h in (h2, h3):
        for rank in (0, 1):
            write_block_file(block_path(str(tmp_path), h.hex(), rank), key, h.hex(), rank, payload)
    restarted = DiskTierIndex(str(tmp_path), key, world_size=2, capacity_blocks=8)
    assert set(restarted.blocks) == {h2, h3} and not any(restarted.blocks.values())
    assert restarted.contains(h3) and restarted.blocks[h3]


def test_block_files_reject_every_kind_of_damage(tmp_path):
    path, key, h = str(tmp_path / "b.kv"), "k" * 24, "ab" * 32
    write_block_file(path, key, h, 0, b"payload")
    assert read_block_file(path, key, h, 0) == b"payload"
    with pytest.raises(TierFileError, match="another model"):
        read_block_file(path, "other", h, 0)
    with pytest.raises(TierFileError, match="another model"):
        read_block_file(path, key, h, 1)
    data = open(path, "rb").read()
    for damaged, reason in [(data[:-2], "cut short"), (data[:-1] + b"X", "checksum"), (b"junk", "not a splitserve")]:
        open(path, "wb").write(damaged)
        with pytest.raises(TierFileError, match=reason):
            read_block_file(path, key, h, 0)
    with pytest.raises(TierFileError, match="cannot be read"):
        read_block_file(str(tmp_path / "missing.kv"), key, h, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copier_makes_copies_in_order_through_host_and_disk(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 2, 6, BS, 8, generator=gen).to(dtype) for _ in range(2)]
    scales = [torch.rand(2, 2, 6, BS, 1, generator=gen) for _ in range(2)]
    original = [t.clone() for t in caches + scales]
    copier = KVOffloadCopier(caches, scales, num_host_blocks=2, rank=0)
    disk_dir = str(tmp_path / ("k" * 24))
    os.makedirs(disk_dir)
    h = "cd" * 32
    # Block 0 to slot 1 and disk; slot 1 to block 3 (reads the store just made); block 1 to slot
    # 1 (refilled after that read); block 0's file back into block 5.
    ops = KVOffloadOps(
        copies=[
            (OFFLOAD_STORE, 0, 1, h),
            (OFFLOAD_HOST_LOAD, 1, 3, ""),
            (OFFLOAD_STORE, 1, 1, ""),
            (OFFLOAD_DISK_LOAD, -1, 5, h),
        ],
        disk_dir=disk_dir,
    )
    copier.apply(ops)
    copier.close()
    for now, before in zip(caches + scales, original):
        assert torch.equal(now[:, :, 3], before[:, :, 0])
        assert torch.equal(now[:, :, 5], before[:, :, 0])
    for host, before in zip(copier.host_tensors, original):
        assert torch.equal(host[:, :, 1], before[:, :, 1])
    assert os.listdir(disk_dir) == [os.path.basename(block_path(disk_dir, h, 0))]
