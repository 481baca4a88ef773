"""Unit tests for kvflow.core.block_pool.BlockPool: allocation, ref counts, prefix-cache map, LRU eviction."""

from __future__ import annotations

import pytest

from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_utils import KVCacheBlock, RequestBlockHasher
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(prompt: list[int], request_id: str = "r") -> Request:
    return Request(
        request_id, prompt, SamplingParams(), block_hasher=RequestBlockHasher(BLOCK_SIZE)
    )


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def cached_blocks(
    pool: BlockPool, num_blocks: int, prompt: list[int] | None = None, request_id: str = "r"
) -> tuple[Request, list[KVCacheBlock]]:
    """Allocate `num_blocks` blocks for a request of exactly that many full blocks and register their hashes."""
    request = make_request(
        prompt if prompt is not None else list(range(num_blocks * BLOCK_SIZE)), request_id
    )
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(request, blocks, 0, num_blocks)
    return request, blocks


# -------------------------------------------------------------------------------------------- construction
def test_new_pool_has_all_blocks_free_in_id_order():
    pool = BlockPool(5)
    assert pool.get_num_free_blocks() == 5
    assert free_ids(pool) == [0, 1, 2, 3, 4]


def test_new_pool_has_empty_hash_map():
    assert BlockPool(3).cached_block_hash_to_block == {}


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_rejects_non_positive_num_blocks(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


# ----------------------------------------------------------------------------------------- get_new_blocks
def test_get_new_blocks_sets_ref_cnt_one():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [block.ref_cnt for block in blocks] == [1, 1, 1]


def test_get_new_blocks_takes_from_head():
    pool = BlockPool(4)
    assert [block.block_id for block in pool.get_new_blocks(2)] == [0, 1]
    assert free_ids(pool) == [2, 3]


def test_get_new_blocks_reduces_free_count():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 1


def test_get_new_blocks_zero_returns_empty():
    pool = BlockPool(2)
    assert pool.get_new_blocks(0) == []
    assert pool.get_num_free_blocks() == 2


def test_get_new_blocks_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3
    assert free_ids(pool) == [0, 1, 2]


def test_get_new_blocks_evicts_cached_hash_of_reused_block():
    pool = BlockPool(1)
    request, (block,) = cached_blocks(pool, 1)
    pool.free_blocks([block])
    (reused,) = pool.get_new_blocks(1)
    assert reused is block
    assert reused.block_hash is None
    assert pool.get_cached_block(request.block_hashes[0]) is None


def test_get_new_blocks_keeps_hashes_of_blocks_not_reused():
    pool = BlockPool(2)
    request, blocks = cached_blocks(pool, 2)
    pool.free_blocks(blocks)
    pool.get_new_blocks(1)
    assert pool.get_cached_block(request.block_hashes[1]) is blocks[1]


# ---------------------------------------------------------------------------------------------------- touch
def test_touch_revives_free_hashed_block():
    pool = BlockPool(3)
    _, (block,) = cached_blocks(pool, 1)
    pool.free_blocks([block])
    pool.touch([block])
    assert block.ref_cnt == 1
    assert block not in pool.free_block_queue.get_all_free_blocks()
    assert pool.get_num_free_blocks() == 2


def test_touch_keeps_revived_block_hash():
    pool = BlockPool(2)
    request, (block,) = cached_blocks(pool, 1)
    pool.free_blocks([block])
    pool.touch([block])
    assert pool.get_cached_block(request.block_hashes[0]) is block


def test_touch_in_use_block_increments_ref_cnt_without_changing_free_queue():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    assert pool.get_num_free_blocks() == 2


def test_revived_block_is_not_reallocated():
    pool = BlockPool(2)
    _, (block,) = cached_blocks(pool, 1)
    pool.free_blocks([block])
    pool.touch([block])
    assert pool.get_new_blocks(1)[0] is not block
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


# ---------------------------------------------------------------------------------------------- free_blocks
def test_free_blocks_decrements_ref_cnt():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert pool.get_num_free_blocks() == 1


def test_shared_block_returns_to_free_queue_only_at_zero_refs():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block])
    assert block not in pool.free_block_queue.get_all_free_blocks()
    pool.free_blocks([block])
    assert block in pool.free_block_queue.get_all_free_blocks()


def test_free_hashed_block_goes_to_tail():
    pool = BlockPool(3)
    _, (block,) = cached_blocks(pool, 1)
    pool.free_blocks([block])
    assert free_ids(pool) == [1, 2, 0]


def test_free_unhashed_block_goes_to_head():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks([blocks[1]])
    assert free_ids(pool) == [1, 2]


def test_free_unhashed_block_is_reused_before_hashed_block():
    pool = BlockPool(2)
    _, (hashed,) = cached_blocks(pool, 1)
    (unhashed,) = pool.get_new_blocks(1)
    pool.free_blocks([hashed, unhashed])
    assert pool.get_new_blocks(1)[0] is unhashed


def test_free_restores_free_count():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 4


def test_double_free_asserts():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_free_never_allocated_block_asserts():
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.free_blocks([pool.blocks[0]])


# ------------------------------------------------------------------------------------------------ LRU order
def test_hashed_blocks_are_evicted_in_free_order():
    pool = BlockPool(3)
    _, blocks = cached_blocks(pool, 3)
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert [block.block_id for block in pool.get_new_blocks(3)] == [2, 0, 1]


def test_never_used_blocks_are_evicted_before_freed_hashed_blocks():
    pool = BlockPool(4)
    _, blocks = cached_blocks(pool, 2)
    pool.free_blocks(blocks)
    assert [block.block_id for block in pool.get_new_blocks(2)] == [2, 3]


def test_revived_then_refreed_block_moves_to_lru_tail():
    pool = BlockPool(3)
    _, blocks = cached_blocks(pool, 3)
    pool.free_blocks(blocks)
    pool.touch([blocks[0]])
    pool.free_blocks([blocks[0]])
    assert free_ids(pool) == [1, 2, 0]


def test_eviction_removes_only_evicted_hashes():
    pool = BlockPool(3)
    request, blocks = cached_blocks(pool, 3)
    pool.free_blocks(blocks)
    pool.get_new_blocks(2)
    assert pool.get_cached_block(request.block_hashes[0]) is None
    assert pool.get_cached_block(request.block_hashes[1]) is None
    assert pool.get_cached_block(request.block_hashes[2]) is blocks[2]


# ---------------------------------------------------------------------------------------- cache_full_blocks
def test_cache_full_blocks_registers_hashes():
    pool = BlockPool(4)
    request, blocks = cached_blocks(pool, 2)
    for block, block_hash in zip(blocks, request.block_hashes, strict=True):
        assert block.block_hash == block_hash
        assert pool.get_cached_block(block_hash) is block


def test_cache_full_blocks_registers_only_the_given_range():
    pool = BlockPool(4)
    request = make_request(list(range(12)))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 1, 2)
    assert blocks[0].block_hash is None
    assert blocks[1].block_hash == request.block_hashes[1]
    assert blocks[2].block_hash is None
    assert len(pool.cached_block_hash_to_block) == 1


def test_cache_full_blocks_with_empty_range_is_noop():
    pool = BlockPool(2)
    request = make_request(list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 2, 2)
    assert pool.cached_block_hash_to_block == {}


def test_cache_full_blocks_leaves_duplicate_hash_block_unhashed():
    pool = BlockPool(4)
    _, first_blocks = cached_blocks(pool, 2, request_id="a")
    second_request = make_request(list(range(8)), "b")
    second_blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(second_request, second_blocks, 0, 2)
    assert all(block.block_hash is None for block in second_blocks)
    assert pool.get_cached_block(second_request.block_hashes[0]) is first_blocks[0]
    assert pool.get_cached_block(second_request.block_hashes[1]) is first_blocks[1]


def test_freed_duplicate_block_goes_to_head():
    pool = BlockPool(4)
    cached_blocks(pool, 1, prompt=[1, 2, 3, 4], request_id="a")
    _, (duplicate,) = cached_blocks(pool, 1, prompt=[1, 2, 3, 4], request_id="b")
    pool.free_blocks([duplicate])
    assert free_ids(pool)[0] == duplicate.block_id


def test_evicting_duplicate_block_keeps_twin_mapping():
    pool = BlockPool(2)
    request, (twin,) = cached_blocks(pool, 1, prompt=[1, 2, 3, 4], request_id="a")
    _, (duplicate,) = cached_blocks(pool, 1, prompt=[1, 2, 3, 4], request_id="b")
    pool.free_blocks([duplicate])
    assert pool.get_new_blocks(1)[0] is duplicate
    assert pool.get_cached_block(request.block_hashes[0]) is twin


def test_cache_full_blocks_skips_already_hashed_prefix_hit():
    pool = BlockPool(4)
    first_request, first_blocks = cached_blocks(pool, 1, prompt=[1, 2, 3, 4], request_id="a")
    second_request = make_request([1, 2, 3, 4, 5, 6, 7, 8], "b")
    pool.touch(first_blocks)
    new_block = pool.get_new_blocks(1)
    pool.cache_full_blocks(second_request, first_blocks + new_block, 0, 2)
    assert first_blocks[0].block_hash == first_request.block_hashes[0]
    assert pool.get_cached_block(second_request.block_hashes[1]) is new_block[0]


def test_cache_full_blocks_is_noop_without_caching():
    pool = BlockPool(2, enable_caching=False)
    request = make_request(list(range(8)))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2)
    assert pool.cached_block_hash_to_block == {}
    assert all(block.block_hash is None for block in blocks)


def test_cache_full_blocks_beyond_hashes_asserts():
    pool = BlockPool(2)
    request = make_request([1, 2, 3, 4, 5])
    blocks = pool.get_new_blocks(2)
    with pytest.raises(AssertionError):
        pool.cache_full_blocks(request, blocks, 0, 2)


# --------------------------------------------------------------------------------------- reset_prefix_cache
def test_reset_prefix_cache_refuses_while_block_in_use():
    pool = BlockPool(3)
    request, _ = cached_blocks(pool, 1)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(request.block_hashes[0]) is not None


def test_reset_prefix_cache_refuses_with_one_unhashed_block_in_use():
    pool = BlockPool(3)
    request, blocks = cached_blocks(pool, 1)
    pool.free_blocks(blocks)
    pool.get_new_blocks(1)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]


def test_reset_prefix_cache_clears_hash_map_when_idle():
    pool = BlockPool(3)
    _, blocks = cached_blocks(pool, 2)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}


def test_reset_prefix_cache_clears_block_hashes():
    pool = BlockPool(3)
    _, blocks = cached_blocks(pool, 2)
    pool.free_blocks(blocks)
    pool.reset_prefix_cache()
    assert all(block.block_hash is None for block in pool.blocks)


def test_reset_prefix_cache_keeps_all_blocks_free():
    pool = BlockPool(3)
    _, blocks = cached_blocks(pool, 2)
    pool.free_blocks(blocks)
    pool.reset_prefix_cache()
    assert pool.get_num_free_blocks() == 3


# ---------------------------------------------------------------------------------------------------- usage
def test_usage_of_fresh_pool_is_zero():
    assert BlockPool(4).get_usage() == 0.0


def test_usage_is_fraction_of_blocks_in_use():
    pool = BlockPool(4)
    pool.get_new_blocks(1)
    assert pool.get_usage() == pytest.approx(0.25)


def test_usage_of_full_pool_is_one():
    pool = BlockPool(4)
    pool.get_new_blocks(4)
    assert pool.get_usage() == pytest.approx(1.0)


def test_free_hashed_blocks_do_not_count_as_used():
    pool = BlockPool(4)
    _, blocks = cached_blocks(pool, 2)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
