"""Paged KV-cache bookkeeping with automatic prefix caching. Pure Python: no tensors here.

A block holds `block_size` tokens of KV. Full blocks are named by a chained hash of
(parent block's hash, the block's token ids, extra keys); a block that is freed keeps its hash
and stays findable until it is reused, least recently freed first. The hash is sha256 over a
fixed byte encoding, so every process (prefill and decode instances too) computes the same one.
With a KV offloading tier (kv_tier/index.py), a hashed block that is reused is first kept
there, and prefix lookups go on into the tier where the device pool misses.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from splitserve.engine.core.request import Request
from splitserve.kv_tier.index import KVOffloadTier, TierHit
from splitserve.kv_tier.ops import KVOffloadOps

_ROOT_HASH = hashlib.sha256(b"splitserve-prefix-cache-v1").digest()


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256((parent_hash or _ROOT_HASH) + data + extra_keys).digest()


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend request.block_hashes to cover every full block of its tokens; returns the list."""
    hashes, tokens = request.block_hashes, request.all_token_ids
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(
            hash_block_tokens(parent, tokens[start : start + block_size], request.block_extra_keys(start, block_size))
        )
    return hashes


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """All blocks, the free queue (LRU order: the front is reused first) and the hash index."""

    def __init__(self, num_blocks: int):
        assert num_blocks > 0
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, KVBlock] = {}
        self.events = None  # a kv_events.KVEventRecorder when KV cache events are published
        self.tier: KVOffloadTier | None = None  # where reused blocks' KV is kept (None: dropped)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[KVBlock]:
        assert n <= self.num_free_blocks, f"asked for {n} blocks, {self.num_free_blocks} free"
        out = []
        for _ in range(n):
            block = self.blocks[self.free_queue.popitem(last=False)[0]]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block, in the given order (the first freed is the first reused)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None

    def cache(self, block: KVBlock, block_hash: bytes) -> bool:
        """Make a full block findable by its hash (the first block with a given content wins);
        True when this block became findable."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self.tier is not None:
                self.tier.offload(block.block_id, block.block_hash)
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block's hash (after the KV memory was released, or the weights
        changed); False, doing nothing, while a request holds blocks."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.tier is not None:
            self.tier.reset()
        if self.events is not None:
            self.events.cleared()
        return True

    def check_invariants(self) -> None:
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in self.free_queue), f"block {block.block_id}"
            if block.block_hash is not None:
                assert self.cached[block.block_hash] is block
        assert all(b.block_hash == h for h, b in self.cached.items())


class KVCacheManager:
    """Which blocks each request holds; allocation, prefix-cache lookups and freeing."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_cpu_blocks: int = 0,
        offload: KVOffloadTier | None = None,
    ):
        """`num_cpu_blocks`: blocks of host memory that preempted requests' KV may be swapped to;
        `offload`: the tier that evicted prefix-cache blocks go to and come back from."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.pool.tier = offload if enable_caching else None
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}  # the same, as ids: read by every step
        self.num_cached_blocks: dict[str, int] = {}
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.req_to_cpu_blocks: dict[str, list[KVBlock]] = {}  # swapped-out requests' host blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_held_blocks(self) -> int:
        """Blocks with a reference, counted one by one (`usage` reads the free queue's length instead)."""
        return sum(1 for block in self.pool.blocks if block.ref_cnt > 0)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, in order (the manager's own list: do not modify it)."""
        return self.req_to_block_ids.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock | TierHit], int]:
        """The longest cached prefix of the request, in whole blocks, leaving at least its last
        token to compute (the model must produce logits for it): device blocks, then, with an
        offloading tier, blocks that tier holds (each loaded into a fresh device block)."""
        if not (self.enable_caching and request.uses_prefix_cache):
            return [], 0
        hashes = update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock | TierHit] = []
        tier = self.pool.tier
        for block_hash in hashes[:max_blocks]:
            hit = self.pool.lookup(block_hash)
            if hit is None and tier is not None:
                hit = tier.lookup(block_hash)
            if hit is None:
                break
            hits.append(hit)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock | TierHit] = (),
        keep_free: int = 0,
        register: bool = True,
    ) -> bool:
        """Reserve room for `num_new_tokens` more tokens (after `computed_blocks`, the prefix-cache
        hits of a request being admitted). Returns False, changing nothing, if that would leave
        fewer than `keep_free` blocks free. `register=False` keeps the new blocks out of the prefix
        cache (their KV arrives later, from another instance: see `cache_blocks`)."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(blocks) - len(computed_blocks)
        if needed <= 0 and not computed_blocks:  # most decode steps: the last block has room
            # (and no block fills: the first test of _cache_full_blocks, without its call)
            full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            if self.enable_caching and register and full > self.num_cached_blocks.get(request.request_id, 0):
                self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
            return True
        on_device = [b for b in computed_blocks if isinstance(b, KVBlock)]
        loaded = len(computed_blocks) - len(on_device)  # offloading-tier hits: each takes a fresh block
        revived = sum(1 for b in on_device if b.ref_cnt == 0)  # hits that currently sit in the free queue
        if max(needed, 0) + loaded > self.pool.num_free_blocks - revived - keep_free:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        self.pool.touch(on_device)
        new = self._load_tier_hits(computed_blocks) if loaded else list(computed_blocks)
        new += self.pool.allocate(max(needed, 0))
        blocks.extend(new)
        self.req_to_block_ids.setdefault(request.request_id, []).extend(b.block_id for b in new)
        if self.enable_caching and register:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return True

    def _load_tier_hits(self, computed_blocks: Sequence[KVBlock | TierHit]) -> list[KVBlock]:
        """The device blocks of a prefix: tier hits get fresh blocks, which the caller registers
        (their KV is copied in before the step's forward, like any block registered when scheduled)."""
        fresh = iter(self.pool.allocate(sum(1 for b in computed_blocks if isinstance(b, TierHit))))
        out = []
        for hit in computed_blocks:
            if isinstance(hit, TierHit):
                block = next(fresh)
                self.pool.tier.load(hit, block.block_id)
                hit = block
            out.append(hit)
        return out

    def take_offload_ops(self) -> KVOffloadOps | None:
        """The offloading tier's copies decided since the last call (None: none, or no tier)."""
        return self.pool.tier.take_ops() if self.pool.tier is not None else None

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Make the full blocks among a request's first `num_tokens` tokens findable (once their KV
        is really there)."""
        if self.enable_caching:
            self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_tokens)

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Blocks are registered as soon as they are scheduled: within a step every layer writes all
        # of its K/V before any attention reads, so a request admitted later in the same step may
        # already share them.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        done = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = update_block_hashes(request, self.block_size)
        stored = [i for i in range(done, num_full) if self.pool.cache(blocks[i], hashes[i])]
        self.num_cached_blocks[request.request_id] = num_full
        if self.pool.events is not None and stored:
            self._record_stored(request, hashes, stored)

    def _record_stored(self, request: Request, hashes: list[bytes], stored: list[int]) -> None:
        """BlockStored events for the blocks that became findable: one per run of consecutive blocks."""
        bs, tokens = self.block_size, request.all_token_ids
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            parent = hashes[run[0] - 1] if run[0] else None
            ids = list(tokens[run[0] * bs : (run[-1] + 1) * bs])
            self.pool.events.stored([hashes[i] for i in run], parent, ids, request.lora_int_id)

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so the least shareable blocks are reused first
        (and its host blocks, if it was swapped out)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
        if self.cpu_pool is not None:
            self.cpu_pool.free(self.req_to_cpu_blocks.pop(request.request_id, []))

    # --- swapping to host memory (preemption_mode="swap") ------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        blocks = self.req_to_blocks.get(request.request_id, [])
        return self.cpu_pool is not None and 0 < len(blocks) <= self.cpu_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move a request's blocks to host blocks: the (device block, host block) copies to make
        before the device blocks are reused. The device blocks are freed (keeping their prefix-cache
        hashes: their content stays valid until reused)."""
        blocks = self.req_to_blocks.pop(request.request_id)
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        host = self.cpu_pool.allocate(len(blocks))
        self.req_to_cpu_blocks[request.request_id] = host
        self.pool.free(reversed(blocks))
        return [(b.block_id, h.block_id) for b, h in zip(blocks, host)]

    def swap_in(self, request: Request, num_new_tokens: int, keep_free: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back into fresh device blocks, with room for `num_new_tokens`
        more tokens: the (host block, device block) copies to make before the step runs; None,
        changing nothing, when the device lacks the blocks."""
        host = self.req_to_cpu_blocks[request.request_id]
        total = max(len(host), -(-(request.num_computed_tokens + num_new_tokens) // self.block_size))
        if total > self.pool.num_free_blocks - keep_free:
            return None
        blocks = self.pool.allocate(total)
        self.req_to_blocks[request.request_id] = blocks
        self.req_to_block_ids[request.request_id] = [b.block_id for b in blocks]
        del self.req_to_cpu_blocks[request.request_id]
        self.cpu_pool.free(host)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, request.num_computed_tokens + num_new_tokens)
        return [(h.block_id, b.block_id) for h, b in zip(host, blocks)]

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.cpu_pool is not None:
            self.cpu_pool.check_invariants()
            held = sum(len(blocks) for blocks in self.req_to_cpu_blocks.values())
            assert held == self.cpu_pool.num_blocks - self.cpu_pool.num_free_blocks, "host block count"
            assert not set(self.req_to_cpu_blocks) & set(self.req_to_blocks), "a request both swapped and not"
        held: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == held.get(block.block_id, 0), f"block {block.block_id} ref count"
        assert {rid: ids for rid, ids in self.req_to_block_ids.items() if ids} == {
            rid: [b.block_id for b in blocks] for rid, blocks in self.req_to_blocks.items() if blocks
        }
