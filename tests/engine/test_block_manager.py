"""kvgen.engine.block_manager: allocation, reference counts, prefix caching and LRU eviction."""

import hashlib
from array import array

import pytest

from kvgen.engine.block_manager import BlockManager, hash_block
from kvgen.engine.request import Request
from kvgen.engine.sampling_params import SamplingParams


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(token_ids), sampling_params=SamplingParams())


def admit(bm: BlockManager, request: Request) -> int:
    """Allocate a request's whole prompt after its prefix-cache hit, as the scheduler does; returns the hit."""
    computed, num_cached = bm.get_computed_blocks(request)
    assert bm.allocate_slots(request, request.num_tokens - num_cached, computed)
    request.num_computed_tokens = request.num_tokens  # the step ran
    bm.cache_full_blocks(request)
    return num_cached


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1, got 0"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 2.0"):
        BlockManager(4, 2.0)


def test_allocate_covers_positions_and_free_returns_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    r = make_request("a", list(range(6)))
    assert bm.can_allocate(r, 6) and bm.allocate_slots(r, 6)
    assert len(r.block_ids) == 2 and bm.num_free_blocks == 2 and bm.usage == 0.5
    r.num_computed_tokens = 6
    assert bm.allocate_slots(r, 2)  # positions 6, 7 fit the second block
    assert len(r.block_ids) == 2
    assert bm.allocate_slots(r, 3)  # positions 6..8: 8 needs a third block
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 1
    assert not bm.can_allocate(r, 11) and not bm.allocate_slots(r, 11)  # [0, 17) needs 2 more blocks
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 1  # a failed allocation changes nothing
    bm.free(r)
    assert r.block_ids == [] and bm.num_free_blocks == 4 and bm.ref_counts == [0] * 4


def test_prefix_hit_shares_full_blocks_with_reference_counts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(bm, a) == 0
    assert bm.num_cached_blocks == 2  # only full blocks are registered
    b = make_request("b", list(range(8)) + [50, 51, 52])  # same first 2 blocks
    computed, num_cached = bm.get_computed_blocks(b)
    assert computed == a.block_ids[:2] and num_cached == 8
    assert bm.allocate_slots(b, b.num_tokens - num_cached, computed)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [bm.ref_counts[i] for i in a.block_ids] == [2, 2, 1]
    bm.free(a)
    assert [bm.ref_counts[i] for i in b.block_ids] == [1, 1, 1]
    assert bm.num_free_blocks == 8 - 3


def test_hit_needs_the_same_prefix_not_just_the_same_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block 2 matches a's block 2 token for token, but block 1 differs: the chained hash misses.
    assert bm.get_computed_blocks(make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == ([], 0)
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])


def test_block_keys_are_sha256_of_the_parent_key_and_the_int64_token_ids() -> None:
    """vLLM's default since CVE-2025-25183: Python's ``hash()`` of int tuples is the same in every process, so a
    client could aim a prompt at another request's cached blocks; a SHA-256 chain cannot be aimed."""
    first = hash_block(None, [1, 2])
    assert first == hashlib.sha256(array("q", [1, 2]).tobytes()).digest()
    assert hash_block(first, [-3, 2**40]) == hashlib.sha256(first + array("q", [-3, 2**40]).tobytes()).digest()


def test_hit_never_covers_the_whole_prompt() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, make_request("a", list(range(8))))
    assert bm.num_cached_blocks == 2
    computed, num_cached = bm.get_computed_blocks(make_request("b", list(range(8))))
    assert len(computed) == 1 and num_cached == 4  # the last block is recomputed for its logits
    computed, num_cached = bm.get_computed_blocks(make_request("c", list(range(9))))
    assert len(computed) == 2 and num_cached == 8


def test_freed_blocks_stay_cached_and_are_reused() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    admit(bm, a)
    first_two = a.block_ids[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = make_request("b", list(range(9)))
    assert admit(bm, b) == 8
    assert b.block_ids[:2] == first_two


def test_uncached_free_blocks_are_used_before_evicting() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])  # block 0 full (cached), block 1 partial (uncached)
    admit(bm, a)
    bm.free(a)
    b = make_request("b", [7, 8, 9, 10, 11])
    admit(bm, b)  # needs 3 blocks: 2 never used + a's uncached one
    assert bm.num_cached_blocks == 1 + 2  # a's block survives; b registers its 2 full blocks
    assert bm.get_computed_blocks(make_request("c", [1, 2, 3]))[1] == 2


def test_lru_eviction_order() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_request("a", [1, 2, 0]), make_request("b", [3, 4, 0])
    admit(bm, a), admit(bm, b)  # every block taken: a's and b's first block are cached
    bm.free(a)  # freed first: least recently used
    bm.free(b)
    c = make_request("c", [5, 6, 0])  # 2 blocks: the 2 uncached ones
    admit(bm, c)
    assert bm.num_cached_blocks == 3
    d = make_request("d", [9])  # one block: evicts a's cached block, not b's
    admit(bm, d)
    assert bm.get_computed_blocks(make_request("a2", [1, 2, 0]))[1] == 0
    assert bm.get_computed_blocks(make_request("b2", [3, 4, 0]))[1] == 2


def test_hit_refreshes_lru_position() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a, b = make_request("a", [1, 2]), make_request("b", [3, 4])
    admit(bm, a), admit(bm, b)
    bm.free(a), bm.free(b)  # LRU order: a, b
    a2 = make_request("a2", [1, 2, 0])
    admit(bm, a2)  # hits a's block (taking it out of the free pool), + 1 uncached block
    bm.free(a2)  # a's block is now the most recently freed
    admit(bm, make_request("x", [8, 8, 8]))  # 2 blocks: the uncached one, then evicts b's
    assert bm.get_computed_blocks(make_request("b2", [3, 4, 0]))[1] == 0
    assert bm.get_computed_blocks(make_request("a3", [1, 2, 0]))[1] == 2


def test_can_allocate_counts_revived_cached_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)  # 3 free blocks, 2 of them cached
    b = make_request("b", [1, 2, 3, 4, 9, 9, 9])
    computed, num_cached = bm.get_computed_blocks(b)
    assert num_cached == 4
    # 3 new tokens need 2 new blocks, but taking the 2 hits leaves only 1 free block.
    assert not bm.can_allocate(b, 3, computed) and not bm.allocate_slots(b, 3, computed)
    assert bm.num_free_blocks == 3 and b.block_ids == []
    assert bm.allocate_slots(b, 2, computed)  # a chunk of 2 fits in 1 new block
    assert bm.num_free_blocks == 0


def test_decode_blocks_are_registered_when_full() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    admit(bm, a)
    assert bm.num_cached_blocks == 1
    a.append_output_token_ids(4)  # sampled; not computed yet
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 1
    assert bm.allocate_slots(a, 1)
    a.num_computed_tokens += 1  # the decode step computed position 3: block 1 is full
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5]))[0] == a.block_ids[:2]


def test_duplicate_content_stays_unregistered_and_prefix_caching_can_be_off() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_request("a", [1, 2, 3]), make_request("b", [1, 2, 3])
    for r in (a, b):  # both computed in the same step: no hit for b
        assert bm.allocate_slots(r, 3)
    for r in (a, b):
        r.num_computed_tokens = 3
        bm.cache_full_blocks(r)
    assert bm.num_cached_blocks == 1
    bm.free(a), bm.free(b)
    assert bm.num_free_blocks == 4
    off = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    admit(off, make_request("a", [1, 2, 3]))
    assert off.num_cached_blocks == 0 and off.get_computed_blocks(make_request("b", [1, 2, 3])) == ([], 0)


def test_freed_uncached_blocks_are_taken_again_before_untouched_ones() -> None:
    """The pool's pages are committed on first write (kv_cache.pool): a freed block without a hash is reused
    before a never-written one, so a lightly loaded engine stays within the blocks it has touched."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(10)))
    admit(bm, a)
    first = list(a.block_ids)  # [0, 1, 2]
    bm.free(a)
    b = make_request("b", list(range(100, 110)))
    admit(bm, b)
    assert b.block_ids == first  # the same blocks, head first, not blocks 3..5


def test_reset_prefix_cache_is_refused_while_blocks_are_held_then_forgets_every_block() -> None:
    """vLLM v1 ``BlockPool.reset_prefix_cache``: "num_used_blocks = num_gpu_blocks - get_num_free_blocks(); if
    num_used_blocks != 1 [its null block]: ... return False", else it empties ``cached_block_hash_to_block``, calls
    ``reset_hash()`` on every block and returns True. kvgen had no way to drop the prefix cache."""
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    admit(bm, a)
    assert bm.num_cached_blocks == 2 and bm.reset_prefix_cache() is False
    assert bm.num_cached_blocks == 2  # refused: nothing changed
    bm.free(a)
    assert bm.reset_prefix_cache() is True
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 4
    b = make_request("b", list(range(9)))
    assert admit(bm, b) == 0  # the same prompt no longer hits
    assert bm.num_cached_blocks == 2  # and registers its blocks anew


def test_a_block_hit_needs_its_whole_prefix_not_just_its_own_tokens() -> None:
    """The key chains a block to every block before it (vLLM ``hash_block_tokens(parent_block_hash, ...)``): "b"
    begins with the tokens of "a"'s SECOND block, whose KV was computed at other positions after another block, so
    "b" hits nothing (brute force: the longest whole-block prefix both token lists share)."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    b = make_request("b", [5, 6, 7, 8, 10, 11])
    shared = 0
    while shared + 4 <= min(a.num_tokens, b.num_tokens - 1) and a.all_token_ids[:shared + 4] == b.all_token_ids[:shared + 4]:
        shared += 4
    assert bm.get_computed_blocks(b) == ([], shared) == ([], 0)


def test_a_request_id_used_again_registers_its_blocks_again() -> None:
    """Ids are reused once a request is done (and a preempted request starts again from its tokens): its full
    blocks are registered anew, so a later request with the same start hits them even after the first ones were
    evicted."""
    bm = BlockManager(num_blocks=4, block_size=4)
    first = make_request("a", list(range(1, 10)))
    admit(bm, first)
    bm.free(first)
    evictor = make_request("x", list(range(100, 116)))  # takes all 4 blocks: every cached one is evicted
    admit(bm, evictor)
    bm.free(evictor)
    again = make_request("a", list(range(50, 59)))  # 2 full blocks + 1 token
    admit(bm, again)
    full_blocks = again.block_ids[: again.num_tokens // 4]
    bm.free(again)
    later = make_request("b", list(range(50, 59)) + [99])
    assert bm.get_computed_blocks(later) == (full_blocks, 4 * len(full_blocks)) and len(full_blocks) == 2
