"""BlockPool / KVCacheManager bookkeeping on tiny pools, with exact block ids.

Every manager call goes through `Checked`, which runs `check_invariants()` after it."""

from __future__ import annotations

import hashlib
import struct

import pytest

from splitserve.engine.core.kv_cache_manager import (
    BlockPool,
    KVCacheManager,
    hash_block_tokens,
    update_block_hashes,
)
from splitserve.engine.core.request import Request
from splitserve.sampling_params import SamplingParams

BS = 4


class Checked:
    """Wraps a KVCacheManager: every method call is followed by check_invariants()."""

    def __init__(self, manager: KVCacheManager):
        self.m = manager

    def __getattr__(self, name):
        attr = getattr(self.m, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            result = attr(*args, **kwargs)
            self.m.check_invariants()
            return result

        return call


def make_manager(num_blocks: int = 8, caching: bool = True) -> Checked:
    return Checked(KVCacheManager(num_blocks, BS, enable_caching=caching))


def req(rid: str, tokens, max_tokens: int = 8, **params) -> Request:
    return Request(
        rid, list(tokens), SamplingParams(max_tokens=max_tokens, **params), eos_token_id=2, max_tokens=max_tokens
    )


def admit(m: Checked, request: Request) -> tuple[list[int], int, bool]:
    """What the scheduler does at admission for a whole prompt: look up hits, allocate the rest.
    Returns (hit block ids, hit tokens, allocated?)."""
    hits, num_cached = m.get_computed_blocks(request)
    ok = m.allocate_slots(request, request.num_tokens - num_cached, hits)
    if ok:
        request.num_computed_tokens = request.num_tokens
    return [b.block_id for b in hits], num_cached, ok


def free_ids(m: Checked) -> list[int]:
    return list(m.pool.free_queue)


# --- allocation -------------------------------------------------------------------------------
def test_allocation_hands_out_lowest_ids_in_order():
    m = make_manager(caching=False)
    a, b = req("a", range(10, 20)), req("b", range(30, 35))
    assert m.allocate_slots(a, 10)
    assert m.get_block_ids("a") == [0, 1, 2]
    assert m.allocate_slots(b, 5)
    assert m.get_block_ids("b") == [3, 4]
    assert m.pool.num_free_blocks == 3
    assert free_ids(m) == [5, 6, 7]
    assert m.usage == pytest.approx(5 / 8)
    assert m.get_block_ids("nobody") == []


def test_allocate_slots_grows_only_when_a_block_fills():
    m = make_manager(caching=False)
    a = req("a", range(10, 14))
    assert m.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    assert m.get_block_ids("a") == [0]
    a.append_output_token(7)
    assert m.allocate_slots(a, 1)  # token 5 needs a second block
    assert m.get_block_ids("a") == [0, 1]
    a.num_computed_tokens = 5
    assert m.allocate_slots(a, 3)  # tokens 6..8 still fit in block 1
    assert m.get_block_ids("a") == [0, 1]
    assert m.pool.num_free_blocks == 6


def test_allocate_slots_returns_false_and_changes_nothing_when_short():
    m = make_manager(caching=False)
    a, b = req("a", range(100, 124)), req("b", range(200, 212))
    assert m.allocate_slots(a, 24)
    assert m.get_block_ids("a") == [0, 1, 2, 3, 4, 5]
    before = free_ids(m)

    assert not m.allocate_slots(b, 12)  # needs 3, 2 free
    assert "b" not in m.req_to_blocks
    assert m.get_block_ids("b") == []
    assert free_ids(m) == before == [6, 7]

    a.num_computed_tokens = 24  # a running request asking for too much
    assert not m.allocate_slots(a, 12)
    assert m.get_block_ids("a") == [0, 1, 2, 3, 4, 5]
    assert free_ids(m) == [6, 7]

    assert m.allocate_slots(b, 8)  # exactly what is left still fits
    assert m.get_block_ids("b") == [6, 7]
    assert m.pool.num_free_blocks == 0


def test_free_returns_blocks_tail_first_so_the_last_block_is_reused_first():
    m = make_manager(caching=False)
    a = req("a", range(10, 20))
    m.allocate_slots(a, 10)
    assert m.get_block_ids("a") == [0, 1, 2]
    m.free(a)
    assert m.get_block_ids("a") == []
    assert free_ids(m) == [3, 4, 5, 6, 7, 2, 1, 0]
    b = req("b", range(40, 64))
    assert m.allocate_slots(b, 24)
    assert m.get_block_ids("b") == [3, 4, 5, 6, 7, 2]
    c = req("c", range(70, 74))
    assert m.allocate_slots(c, 4)
    assert m.get_block_ids("c") == [1]


def test_free_of_a_full_pool_reuses_the_last_block_first():
    m = make_manager(caching=False)
    a = req("a", range(10, 42))
    m.allocate_slots(a, 32)
    assert m.get_block_ids("a") == list(range(8))
    m.free(a)
    assert free_ids(m) == [7, 6, 5, 4, 3, 2, 1, 0]
    b = req("b", range(50, 54))
    m.allocate_slots(b, 4)
    assert m.get_block_ids("b") == [7]


def test_double_free_of_a_block_is_caught():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)


# --- prefix caching ---------------------------------------------------------------------------
def test_same_prompt_hits_the_same_full_blocks():
    m = make_manager()
    prompt = list(range(10, 19))  # 9 tokens: 2 full blocks + 1 token
    a, b = req("a", prompt), req("b", prompt)
    assert admit(m, a) == ([], 0, True)
    assert m.get_block_ids("a") == [0, 1, 2]
    assert admit(m, b) == ([0, 1], 8, True)
    assert m.get_block_ids("b") == [0, 1, 3]
    assert [m.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert m.pool.num_free_blocks == 4


def test_last_prompt_token_is_always_left_to_compute():
    m = make_manager()
    prompt = list(range(10, 18))  # exactly 2 full blocks
    a, b = req("a", prompt), req("b", prompt)
    admit(m, a)
    assert m.get_block_ids("a") == [0, 1]
    assert len(m.pool.cached) == 2  # both blocks are registered...
    hits, num_cached, ok = admit(m, b)
    assert (hits, num_cached, ok) == ([0], 4, True)  # ...but only the first one is a hit
    assert m.get_block_ids("b") == [0, 2]


def test_one_token_prompt_never_hits():
    m = make_manager()
    admit(m, req("a", [5, 6, 7, 8]))
    assert m.get_computed_blocks(req("b", [5]))[1] == 0
    assert m.get_computed_blocks(req("c", [5, 6, 7, 8]))[1] == 0


def test_shared_prefix_of_two_different_prompts():
    m = make_manager()
    a = req("a", list(range(10, 22)))  # 3 full blocks
    b = req("b", list(range(10, 18)) + [90, 91, 92, 93, 94])  # same first 2 blocks
    admit(m, a)
    assert m.get_block_ids("a") == [0, 1, 2]
    assert admit(m, b) == ([0, 1], 8, True)
    assert m.get_block_ids("b") == [0, 1, 3, 4]


def test_hash_chain_means_a_different_first_block_misses_everything():
    m = make_manager()
    a = req("a", list(range(10, 22)) + [1])
    b = req("b", [99] + list(range(11, 22)) + [1])  # only token 0 differs
    admit(m, a)
    assert admit(m, b) == ([], 0, True)
    assert m.get_block_ids("b") == [4, 5, 6, 7]


def test_hit_blocks_in_the_free_queue_are_revived():
    m = make_manager()
    prompt = list(range(10, 19))
    a = req("a", prompt)
    admit(m, a)
    m.free(a)
    assert free_ids(m) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert [m.pool.blocks[i].ref_cnt for i in (0, 1)] == [0, 0]

    b = req("b", prompt)
    assert admit(m, b) == ([0, 1], 8, True)
    assert m.get_block_ids("b") == [0, 1, 3]
    assert [m.pool.blocks[i].ref_cnt for i in (0, 1, 3)] == [1, 1, 1]
    assert free_ids(m) == [4, 5, 6, 7, 2]


def test_revived_hits_count_against_free_blocks():
    m = make_manager(num_blocks=4)
    prefix = list(range(10, 18))
    a = req("a", prefix + [50])
    admit(m, a)
    assert m.get_block_ids("a") == [0, 1, 2]
    m.free(a)
    assert free_ids(m) == [3, 2, 1, 0]

    # 17 tokens: 5 blocks, 2 of them hits that sit in the free queue -> 3 more needed, 2 left.
    c = req("c", prefix + list(range(60, 69)))
    hits, num_cached = m.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8
    assert not m.allocate_slots(c, c.num_tokens - num_cached, hits)
    assert "c" not in m.req_to_blocks
    assert free_ids(m) == [3, 2, 1, 0]
    assert [m.pool.blocks[i].ref_cnt for i in range(4)] == [0, 0, 0, 0]
    assert m.pool.lookup(c.block_hashes[0]) is m.pool.blocks[0]  # nothing evicted
    assert m.pool.lookup(c.block_hashes[1]) is m.pool.blocks[1]

    # 16 tokens: 4 blocks, 2 hits -> exactly the 2 non-hit free blocks.
    b = req("b", prefix + list(range(70, 78)))
    assert admit(m, b) == ([0, 1], 8, True)
    assert m.get_block_ids("b") == [0, 1, 3, 2]
    assert m.pool.num_free_blocks == 0


def test_reusing_a_freed_cached_block_evicts_its_hash():
    m = make_manager(num_blocks=4)
    prompt = list(range(10, 18))
    a = req("a", prompt)
    admit(m, a)
    assert m.get_block_ids("a") == [0, 1]
    h0, h1 = a.block_hashes
    m.free(a)
    assert free_ids(m) == [2, 3, 1, 0]
    assert m.pool.lookup(h1) is m.pool.blocks[1]

    other = req("x", range(100, 112))
    assert m.allocate_slots(other, 12)
    assert m.get_block_ids("x") == [2, 3, 1]
    assert m.pool.lookup(h1) is None and h1 not in m.pool.cached
    assert m.pool.blocks[1].block_hash == other.block_hashes[2]  # now named by its new content
    assert m.pool.lookup(h0) is m.pool.blocks[0]

    d = req("d", prompt + [1])  # would hit 2 blocks; the second was evicted
    # 3 blocks needed, 1 is a hit, and the only free block is that hit: does not fit.
    assert admit(m, d) == ([0], 4, False)
    assert m.get_block_ids("d") == []
    m.free(other)
    assert free_ids(m) == [0, 1, 3, 2]
    assert admit(m, d) == ([0], 4, True)
    assert m.get_block_ids("d") == [0, 1, 3]
    assert m.pool.lookup(h1) is m.pool.blocks[1]  # recomputed and registered again


def test_ref_counts_with_two_requests_sharing_blocks():
    m = make_manager()
    prompt = list(range(10, 19))
    a, b = req("a", prompt), req("b", prompt)
    admit(m, a)
    admit(m, b)
    assert m.get_block_ids("a") == [0, 1, 2] and m.get_block_ids("b") == [0, 1, 3]
    assert m.num_held_blocks() == 4  # a shared block counts once
    m.free(a)
    assert [m.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert free_ids(m) == [4, 5, 6, 7, 2]  # shared blocks stay out of the free queue
    m.free(b)
    assert [m.pool.blocks[i].ref_cnt for i in range(4)] == [0, 0, 0, 0]
    assert free_ids(m) == [4, 5, 6, 7, 2, 3, 1, 0]
    assert m.num_held_blocks() == 0  # freed blocks keep their hashes but no reference


def test_prompt_logprobs_requests_never_get_hits():
    m = make_manager()
    prompt = list(range(10, 19))
    admit(m, req("a", prompt))
    b = req("b", prompt, prompt_logprobs=0)
    assert not b.uses_prefix_cache
    assert admit(m, b) == ([], 0, True)
    assert m.get_block_ids("b") == [3, 4, 5]
    # Its blocks hold the same content, but the first registered block keeps the hash.
    assert m.pool.lookup(b.block_hashes[0]) is m.pool.blocks[0]
    assert m.pool.blocks[3].block_hash is None


def test_no_hits_and_no_registration_when_caching_is_disabled():
    m = make_manager(caching=False)
    prompt = list(range(10, 19))
    admit(m, req("a", prompt))
    assert m.pool.cached == {}
    assert admit(m, req("b", prompt)) == ([], 0, True)
    assert m.get_block_ids("b") == [3, 4, 5]


def test_full_blocks_are_registered_as_chunks_are_scheduled():
    m = make_manager()
    a = req("a", list(range(10, 20)))  # 10 tokens
    assert m.allocate_slots(a, 3)
    assert m.pool.cached == {}  # no full block yet
    a.num_computed_tokens = 3
    assert m.allocate_slots(a, 4)  # tokens 0..6: block 0 full
    assert list(m.pool.cached.values()) == [m.pool.blocks[0]]
    a.num_computed_tokens = 7
    assert m.allocate_slots(a, 3)  # tokens 0..9: block 1 full, block 2 not
    a.num_computed_tokens = 10
    assert m.get_block_ids("a") == [0, 1, 2]
    assert [m.pool.blocks[i].block_hash for i in range(3)] == a.block_hashes[:2] + [None]

    # Decoded tokens fill block 2; it is registered once the step computing its last token is.
    a.append_output_token(7)
    assert m.allocate_slots(a, 1)
    a.num_computed_tokens = 11
    assert m.pool.blocks[2].block_hash is None
    a.append_output_token(8)
    assert m.allocate_slots(a, 1)
    a.num_computed_tokens = 12
    assert m.pool.blocks[2].block_hash == a.block_hashes[2]
    assert m.pool.blocks[2].block_hash == hash_block_tokens(a.block_hashes[1], [18, 19, 7, 8])

    # A request whose prompt is a's prompt plus its outputs hits all three blocks.
    b = req("b", list(range(10, 20)) + [7, 8, 9])
    assert admit(m, b) == ([0, 1, 2], 12, True)


# --- hashing ----------------------------------------------------------------------------------
def _expected_hash(parent: bytes | None, tokens, extra: bytes = b"") -> bytes:
    root = hashlib.sha256(b"splitserve-prefix-cache-v1").digest()
    data = b"".join(struct.pack("<q", t) for t in tokens)
    return hashlib.sha256((parent if parent is not None else root) + data + extra).digest()


def test_hash_block_tokens_is_sha256_of_the_documented_encoding():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == _expected_hash(None, [1, 2, 3, 4])
    assert len(h0) == 32
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert h1 == _expected_hash(h0, [5, 6, 7, 8])
    assert hash_block_tokens(h0, [5, 6, 7, 8], b"lora1") == _expected_hash(h0, [5, 6, 7, 8], b"lora1")
    assert hash_block_tokens(None, [-1, 2**40, 0, 151643]) == _expected_hash(None, [-1, 2**40, 0, 151643])
    # Deterministic, and sensitive to parent, tokens, token order and extra keys.
    assert hash_block_tokens(None, [1, 2, 3, 4]) == h0
    assert hash_block_tokens(h0, [1, 2, 3, 4]) != h0
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h0
    assert hash_block_tokens(None, [2, 1, 3, 4]) != h0
    assert hash_block_tokens(None, [1, 2, 3, 4], b"x") != h0
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != h1


def test_update_block_hashes_covers_only_full_blocks_and_is_incremental():
    r = req("r", list(range(10, 20)))  # 10 tokens: 2 full blocks
    hashes = update_block_hashes(r, BS)
    assert hashes is r.block_hashes
    h0 = _expected_hash(None, [10, 11, 12, 13])
    h1 = _expected_hash(h0, [14, 15, 16, 17])
    assert hashes == [h0, h1]

    r.append_output_token(30)  # 11 tokens: still 2
    assert update_block_hashes(r, BS) == [h0, h1]
    r.append_output_token(31)  # 12 tokens: 3
    assert update_block_hashes(r, BS) == [h0, h1, _expected_hash(h1, [18, 19, 30, 31])]

    # Incremental: existing entries are kept, not recomputed.
    r.block_hashes[0] = b"sentinel"
    r.all_token_ids.extend([32, 33, 34, 35])
    out = update_block_hashes(r, BS)
    assert out[0] == b"sentinel" and len(out) == 4
    assert out[3] == _expected_hash(out[2], [32, 33, 34, 35])

    assert update_block_hashes(req("s", [1, 2, 3]), BS) == []
