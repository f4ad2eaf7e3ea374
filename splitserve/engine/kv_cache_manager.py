"""Paged KV-cache bookkeeping with automatic prefix caching. Pure Python: no tensors here.

A block holds `block_size` tokens of KV. Full blocks are named by a chained hash of
(parent block's hash, the block's token ids, extra keys); a block that is freed keeps its hash
and stays findable until it is reused, least recently freed first. The hash is sha256 over a
fixed byte encoding, so every process (prefill and decode instances too) computes the same one.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from splitserve.engine.request import Request

_ROOT_HASH = hashlib.sha256(b"splitserve-prefix-cache-v1").digest()


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256((parent_hash or _ROOT_HASH) + data + extra_keys).digest()


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend request.block_hashes to cover every full block of its tokens; returns the list."""
    hashes, tokens = request.block_hashes, request.all_token_ids
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, tokens[start : start + block_size], request.block_hash_salt))
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

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a full block findable by its hash (the first block with a given content wins)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def check_invariants(self) -> None:
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in self.free_queue), f"block {block.block_id}"
            if block.block_hash is not None:
                assert self.cached[block.block_hash] is block
        assert all(b.block_hash == h for h, b in self.cached.items())


class KVCacheManager:
    """Which blocks each request holds; allocation, prefix-cache lookups and freeing."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}  # the same, as ids: read by every step
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, in order (the manager's own list: do not modify it)."""
        return self.req_to_block_ids.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request, in whole blocks, leaving at least its last
        token to compute (the model must produce logits for it)."""
        if not (self.enable_caching and request.uses_prefix_cache):
            return [], 0
        hashes = update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
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
            if self.enable_caching and register:
                self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
            return True
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # hits that currently sit in the free queue
        if needed > self.pool.num_free_blocks - revived - keep_free:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        self.pool.touch(computed_blocks)
        new = list(computed_blocks) + self.pool.allocate(max(needed, 0))
        blocks.extend(new)
        self.req_to_block_ids.setdefault(request.request_id, []).extend(b.block_id for b in new)
        if self.enable_caching and register:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return True

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
        for i in range(done, num_full):
            self.pool.cache(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so the least shareable blocks are reused first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        held: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == held.get(block.block_id, 0), f"block {block.block_id} ref count"
        assert {rid: ids for rid, ids in self.req_to_block_ids.items() if ids} == {
            rid: [b.block_id for b in blocks] for rid, blocks in self.req_to_blocks.items() if blocks
        }
