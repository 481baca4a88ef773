"""Unit tests for kvflow.core.kv_cache_manager: the KV-manager verbs the scheduler uses."""

from __future__ import annotations

import pytest

from kvflow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvflow.core.kv_cache_utils import KVCacheBlock, RequestBlockHasher
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=64),
        block_hasher=RequestBlockHasher(BLOCK_SIZE),
        cache_salt=cache_salt,
    )


def make_manager(num_blocks: int = 16, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, **kwargs)


def schedule_prefill(manager: KVCacheManager, request: Request) -> KVCacheBlocks | None:
    """What the scheduler does for a new request: look up the prefix, allocate the rest, mark it computed."""
    computed_blocks, num_computed = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_computed, num_computed, computed_blocks
    )
    if new_blocks is not None:
        request.num_computed_tokens = request.num_tokens
    return new_blocks


def block_ids(manager: KVCacheManager, request: Request) -> list[int]:
    return manager.get_block_ids(request.request_id)[0]


def free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


# ------------------------------------------------------------------------------------------ KVCacheBlocks
def test_kv_cache_blocks_get_block_ids_per_group():
    blocks = KVCacheBlocks(([KVCacheBlock(3), KVCacheBlock(5)],))
    assert blocks.get_block_ids() == ([3, 5],)


def test_kv_cache_blocks_add_concatenates_groups():
    combined = KVCacheBlocks(([KVCacheBlock(1)],)) + KVCacheBlocks(([KVCacheBlock(2)],))
    assert combined.get_block_ids() == ([1, 2],)


def test_kv_cache_blocks_is_empty():
    assert KVCacheBlocks(([],)).is_empty
    assert not KVCacheBlocks(([KVCacheBlock(0)],)).is_empty


# ----------------------------------------------------------------------------------------------- construction
def test_manager_rejects_zero_block_size():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


def test_manager_num_blocks():
    assert make_manager(7).num_blocks == 7


# ---------------------------------------------------------------------------------------- get_computed_blocks
def test_get_computed_blocks_miss_returns_zero():
    manager = make_manager()
    blocks, num_computed = manager.get_computed_blocks(make_request("a", list(range(10))))
    assert num_computed == 0
    assert blocks.get_block_ids() == ([],)


def test_get_computed_blocks_hits_cached_prefix_after_free():
    manager = make_manager()
    first = make_request("a", list(range(10)))
    schedule_prefill(manager, first)
    first_ids = block_ids(manager, first)
    manager.free(first)
    blocks, num_computed = manager.get_computed_blocks(make_request("b", list(range(10))))
    assert num_computed == 8
    assert blocks.get_block_ids() == (first_ids[:2],)


def test_get_computed_blocks_hits_blocks_of_running_request():
    manager = make_manager()
    first = make_request("a", list(range(10)))
    schedule_prefill(manager, first)
    _, num_computed = manager.get_computed_blocks(make_request("b", list(range(10))))
    assert num_computed == 8


def test_get_computed_blocks_returns_full_blocks_only():
    manager = make_manager()
    schedule_prefill(manager, make_request("a", list(range(10))))
    _, num_computed = manager.get_computed_blocks(make_request("b", [*range(10), 99, 98, 97]))
    assert num_computed == 8


def test_get_computed_blocks_never_includes_last_prompt_token():
    manager = make_manager()
    first = make_request("a", list(range(8)))
    schedule_prefill(manager, first)
    manager.free(first)
    blocks, num_computed = manager.get_computed_blocks(make_request("b", list(range(8))))
    assert num_computed == 4
    assert len(blocks.blocks[0]) == 1


def test_get_computed_blocks_single_block_prompt_never_hits():
    manager = make_manager()
    first = make_request("a", [1, 2, 3, 4])
    schedule_prefill(manager, first)
    manager.free(first)
    _, num_computed = manager.get_computed_blocks(make_request("b", [1, 2, 3, 4]))
    assert num_computed == 0


def test_get_computed_blocks_stops_at_first_miss():
    manager = make_manager()
    first = make_request("a", list(range(12)))
    schedule_prefill(manager, first)
    manager.free(first)
    _, num_computed = manager.get_computed_blocks(
        make_request("b", [*range(4), 50, 51, 52, 53, *range(8, 13)])
    )
    assert num_computed == 4


def test_get_computed_blocks_misses_on_different_first_block():
    manager = make_manager()
    schedule_prefill(manager, make_request("a", list(range(12))))
    _, num_computed = manager.get_computed_blocks(make_request("b", [77, *range(1, 12)]))
    assert num_computed == 0


def test_get_computed_blocks_misses_for_different_cache_salt():
    manager = make_manager()
    schedule_prefill(manager, make_request("a", list(range(12)), cache_salt="x"))
    _, num_computed = manager.get_computed_blocks(
        make_request("b", list(range(12)), cache_salt="y")
    )
    assert num_computed == 0


def test_get_computed_blocks_takes_no_reference():
    manager = make_manager(4)
    first = make_request("a", list(range(8)))
    schedule_prefill(manager, first)
    manager.free(first)
    manager.get_computed_blocks(make_request("b", list(range(9))))
    assert manager.block_pool.get_num_free_blocks() == 4
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)


def test_get_computed_blocks_misses_after_eviction():
    manager = make_manager(2)
    first = make_request("a", list(range(8)))
    schedule_prefill(manager, first)
    manager.free(first)
    schedule_prefill(manager, make_request("b", [50, 51, 52, 53, 54, 55, 56, 57]))
    _, num_computed = manager.get_computed_blocks(make_request("c", list(range(9))))
    assert num_computed == 0


def test_enable_caching_false_never_hits():
    manager = make_manager(enable_caching=False)
    first = make_request("a", list(range(12)))
    schedule_prefill(manager, first)
    manager.free(first)
    _, num_computed = manager.get_computed_blocks(make_request("b", list(range(12))))
    assert num_computed == 0


def test_enable_caching_false_registers_no_hashes():
    manager = make_manager(enable_caching=False)
    schedule_prefill(manager, make_request("a", list(range(12))))
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert all(block.block_hash is None for block in manager.block_pool.blocks)


# --------------------------------------------------------------------------------------------- allocate_slots
def test_allocate_slots_allocates_ceil_blocks_for_prompt():
    manager = make_manager()
    request = make_request("a", list(range(10)))
    new_blocks = manager.allocate_slots(request, 10)
    assert new_blocks is not None
    assert len(new_blocks.blocks[0]) == 3
    assert manager.block_pool.get_num_free_blocks() == 13


def test_allocate_slots_exact_multiple_needs_no_extra_block():
    manager = make_manager()
    new_blocks = manager.allocate_slots(make_request("a", list(range(8))), 8)
    assert len(new_blocks.blocks[0]) == 2


def test_allocate_slots_counts_lookahead_tokens():
    manager = make_manager()
    new_blocks = manager.allocate_slots(
        make_request("a", list(range(10))), 10, num_lookahead_tokens=3
    )
    assert len(new_blocks.blocks[0]) == 4


def test_allocate_slots_zero_new_tokens_allocates_nothing():
    manager = make_manager()
    new_blocks = manager.allocate_slots(make_request("a", list(range(10))), 0)
    assert new_blocks.get_block_ids() == ([],)
    assert manager.block_pool.get_num_free_blocks() == 16


def test_allocate_slots_rejects_negative_new_tokens():
    manager = make_manager()
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(make_request("a", list(range(10))), -1)


def test_allocate_slots_chunked_prefill_extends_blocks():
    manager = make_manager()
    request = make_request("a", list(range(10)))
    manager.allocate_slots(request, 5)
    request.num_computed_tokens = 5
    more = manager.allocate_slots(request, 5)
    assert len(more.blocks[0]) == 1
    assert len(block_ids(manager, request)) == 3


def test_allocate_slots_decode_within_block_allocates_nothing():
    manager = make_manager()
    request = make_request("a", list(range(6)))
    schedule_prefill(manager, request)
    request.append_output_token_ids(100)
    new_blocks = manager.allocate_slots(request, 1)
    assert new_blocks.get_block_ids() == ([],)
    assert len(block_ids(manager, request)) == 2


def test_allocate_slots_decode_at_block_boundary_allocates_one_block():
    manager = make_manager()
    request = make_request("a", list(range(8)))
    schedule_prefill(manager, request)
    request.append_output_token_ids(100)
    new_blocks = manager.allocate_slots(request, 1)
    assert len(new_blocks.blocks[0]) == 1
    assert len(block_ids(manager, request)) == 3


def test_allocate_slots_with_prefix_hit_allocates_only_the_rest():
    manager = make_manager()
    first = make_request("a", list(range(10)))
    schedule_prefill(manager, first)
    manager.free(first)
    second = make_request("b", list(range(10)))
    computed_blocks, num_computed = manager.get_computed_blocks(second)
    new_blocks = manager.allocate_slots(second, 2, num_computed, computed_blocks)
    assert len(new_blocks.blocks[0]) == 1


def test_allocate_slots_returns_only_new_blocks_but_request_holds_hits_too():
    manager = make_manager()
    first = make_request("a", list(range(10)))
    schedule_prefill(manager, first)
    first_ids = block_ids(manager, first)
    manager.free(first)
    second = make_request("b", list(range(10)))
    computed_blocks, num_computed = manager.get_computed_blocks(second)
    new_blocks = manager.allocate_slots(second, 2, num_computed, computed_blocks)
    assert block_ids(manager, second) == first_ids[:2] + new_blocks.get_block_ids()[0]


def test_allocate_slots_prefix_hit_with_lookahead():
    manager = make_manager()
    schedule_prefill(manager, make_request("a", list(range(10))))
    second = make_request("b", list(range(10)))
    computed_blocks, num_computed = manager.get_computed_blocks(second)
    new_blocks = manager.allocate_slots(
        second, 2, num_computed, computed_blocks, num_lookahead_tokens=3
    )
    assert len(new_blocks.blocks[0]) == 2


def test_allocate_slots_max_model_len_caps_allocation():
    manager = make_manager(max_model_len=10)
    new_blocks = manager.allocate_slots(
        make_request("a", list(range(8))), 8, num_lookahead_tokens=8
    )
    assert len(new_blocks.blocks[0]) == 3


def test_allocate_slots_uses_all_free_blocks_exactly():
    manager = make_manager(3)
    new_blocks = manager.allocate_slots(make_request("a", list(range(12))), 12)
    assert new_blocks is not None
    assert manager.block_pool.get_num_free_blocks() == 0


def test_failed_allocation_returns_none():
    manager = make_manager(3)
    assert manager.allocate_slots(make_request("a", list(range(13))), 13) is None


def test_failed_allocation_keeps_free_count():
    manager = make_manager(5)
    schedule_prefill(manager, make_request("a", list(range(8))))
    manager.allocate_slots(make_request("b", list(range(50, 66))), 16)
    assert manager.block_pool.get_num_free_blocks() == 3


def test_failed_allocation_leaves_request_without_blocks():
    manager = make_manager(5)
    schedule_prefill(manager, make_request("a", list(range(8))))
    manager.allocate_slots(make_request("b", list(range(50, 66))), 16)
    assert manager.get_block_ids("b") == ([],)
    assert "b" not in manager.req_to_blocks


def test_failed_allocation_keeps_existing_request_blocks():
    manager = make_manager(3)
    request = make_request("a", list(range(8)))
    schedule_prefill(manager, request)
    ids_before = block_ids(manager, request)
    request.append_output_token_ids(100)
    assert manager.allocate_slots(request, 1, num_lookahead_tokens=8) is None
    assert block_ids(manager, request) == ids_before


def test_failed_allocation_with_prefix_hit_changes_nothing():
    manager = make_manager(4)
    first = make_request("a", list(range(8)))
    schedule_prefill(manager, first)
    manager.free(first)
    hash_map_before = dict(manager.block_pool.cached_block_hash_to_block)
    free_order_before = free_ids(manager)
    second = make_request("b", [*range(8), *range(100, 109)])
    computed_blocks, num_computed = manager.get_computed_blocks(second)
    assert num_computed == 8
    assert manager.allocate_slots(second, 9, num_computed, computed_blocks) is None
    assert manager.block_pool.cached_block_hash_to_block == hash_map_before
    assert free_ids(manager) == free_order_before
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert manager.get_block_ids("b") == ([],)


def test_revived_prefix_hit_blocks_count_against_free_capacity():
    manager = make_manager(4)
    first = make_request("a", list(range(8)))
    schedule_prefill(manager, first)
    manager.free(first)
    second = make_request("b", [*range(8), *range(100, 109)])  # 17 tokens: 2 hit + 3 new > 4 free
    computed_blocks, num_computed = manager.get_computed_blocks(second)
    assert manager.allocate_slots(second, 9, num_computed, computed_blocks) is None


def test_revived_prefix_hit_blocks_fit_exactly():
    manager = make_manager(4)
    first = make_request("a", list(range(8)))
    schedule_prefill(manager, first)
    manager.free(first)
    second = make_request("b", [*range(8), *range(100, 108)])  # 16 tokens: 2 hit + 2 new == 4 free
    computed_blocks, num_computed = manager.get_computed_blocks(second)
    assert manager.allocate_slots(second, 8, num_computed, computed_blocks) is not None
    assert manager.block_pool.get_num_free_blocks() == 0


def test_in_use_prefix_hit_blocks_do_not_count_against_free_capacity():
    manager = make_manager(4)
    schedule_prefill(manager, make_request("a", list(range(8))))
    second = make_request(
        "b", [*range(8), *range(100, 108)]
    )  # 2 shared in-use blocks + 2 new == 2 free
    computed_blocks, num_computed = manager.get_computed_blocks(second)
    assert manager.allocate_slots(second, 8, num_computed, computed_blocks) is not None


def test_prefix_hit_revives_blocks_out_of_free_queue():
    manager = make_manager(4)
    first = make_request("a", list(range(8)))
    schedule_prefill(manager, first)
    first_ids = block_ids(manager, first)
    manager.free(first)
    second = make_request("b", list(range(9)))
    computed_blocks, num_computed = manager.get_computed_blocks(second)
    manager.allocate_slots(second, 1, num_computed, computed_blocks)
    assert not set(first_ids) & set(free_ids(manager))


# ------------------------------------------------------------------------------------------------------- free
def test_free_returns_all_blocks():
    manager = make_manager(8)
    request = make_request("a", list(range(10)))
    schedule_prefill(manager, request)
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == 8
    assert manager.get_block_ids("a") == ([],)


def test_free_unknown_request_is_noop():
    manager = make_manager(4)
    manager.free(make_request("ghost", [1, 2, 3]))
    assert manager.block_pool.get_num_free_blocks() == 4


def test_free_releases_last_block_first_in_eviction_order():
    manager = make_manager(3)
    request = make_request("a", list(range(12)))
    schedule_prefill(manager, request)
    ids = block_ids(manager, request)
    manager.free(request)
    assert free_ids(manager) == list(reversed(ids))


def test_free_puts_partial_last_block_at_head_and_full_blocks_at_tail():
    manager = make_manager(5)
    request = make_request("a", list(range(10)))
    schedule_prefill(manager, request)
    first_block, second_block, partial_block = block_ids(manager, request)
    manager.free(request)
    assert free_ids(manager) == [partial_block, 3, 4, second_block, first_block]


def test_freed_request_last_full_block_is_evicted_before_its_first():
    manager = make_manager(3)
    request = make_request("a", list(range(12)))
    schedule_prefill(manager, request)
    manager.free(request)
    schedule_prefill(manager, make_request("b", [90, 91, 92, 93]))
    _, num_computed = manager.get_computed_blocks(make_request("c", list(range(12))))
    assert num_computed == 8


# ------------------------------------------------------------------------------------------------ cache_blocks
def test_allocate_registers_only_full_prompt_blocks():
    manager = make_manager()
    request = make_request("a", list(range(10)))
    schedule_prefill(manager, request)
    blocks = manager.req_to_blocks["a"].blocks
    assert [block.block_hash for block in blocks] == [*request.block_hashes[:2], None]
    assert len(manager.block_pool.cached_block_hash_to_block) == 2


def test_chunked_allocation_registers_only_computed_full_blocks():
    manager = make_manager()
    request = make_request("a", list(range(12)))
    manager.allocate_slots(request, 5)
    assert len(manager.block_pool.cached_block_hash_to_block) == 1


def test_cache_blocks_ignores_partial_block():
    manager = make_manager()
    request = make_request("a", list(range(12)))
    manager.allocate_slots(request, 5)
    manager.cache_blocks(request, 7)
    assert len(manager.block_pool.cached_block_hash_to_block) == 1


def test_cache_blocks_registers_block_once_full():
    manager = make_manager()
    request = make_request("a", list(range(12)))
    manager.allocate_slots(request, 5)
    manager.cache_blocks(request, 8)
    blocks = manager.req_to_blocks["a"].blocks
    assert blocks[1].block_hash == request.block_hashes[1]
    assert manager.block_pool.get_cached_block(request.block_hashes[1]) is blocks[1]


def test_cache_blocks_registers_decoded_block_once_full():
    manager = make_manager()
    request = make_request("a", list(range(6)))
    schedule_prefill(manager, request)
    request.append_output_token_ids([100, 101])
    manager.cache_blocks(request, 8)
    assert (
        manager.block_pool.get_cached_block(request.block_hashes[1])
        is manager.req_to_blocks["a"].blocks[1]
    )


def test_cache_blocks_never_exceeds_allocated_blocks():
    manager = make_manager()
    request = make_request("a", list(range(12)))
    manager.allocate_slots(request, 4)
    manager.cache_blocks(request, 12)
    assert len(manager.block_pool.cached_block_hash_to_block) == 1


def test_cache_blocks_for_unknown_request_is_noop():
    manager = make_manager()
    manager.cache_blocks(make_request("ghost", list(range(8))), 8)
    assert manager.block_pool.cached_block_hash_to_block == {}


def test_concurrent_identical_prompts_register_first_blocks_only():
    manager = make_manager()
    first = make_request("a", list(range(8)))
    second = make_request("b", list(range(8)))
    manager.allocate_slots(first, 8)
    manager.allocate_slots(second, 8)
    first_blocks = manager.req_to_blocks["a"].blocks
    assert [manager.block_pool.get_cached_block(h) for h in second.block_hashes] == first_blocks
    assert all(block.block_hash is None for block in manager.req_to_blocks["b"].blocks)


# ------------------------------------------------------------------------------------------------ sharing
def test_shared_prefix_shares_block_ids():
    manager = make_manager()
    first = make_request("a", [*range(8), 20, 21])
    second = make_request("b", [*range(8), 30, 31])
    schedule_prefill(manager, first)
    schedule_prefill(manager, second)
    assert block_ids(manager, first)[:2] == block_ids(manager, second)[:2]
    assert block_ids(manager, first)[2] != block_ids(manager, second)[2]


def test_shared_prefix_blocks_have_ref_cnt_two():
    manager = make_manager()
    schedule_prefill(manager, make_request("a", [*range(8), 20, 21]))
    schedule_prefill(manager, make_request("b", [*range(8), 30, 31]))
    blocks = manager.req_to_blocks["b"].blocks
    assert [block.ref_cnt for block in blocks] == [2, 2, 1]


def test_freeing_one_sharer_keeps_shared_blocks_in_use():
    manager = make_manager(8)
    first = make_request("a", [*range(8), 20, 21])
    schedule_prefill(manager, first)
    schedule_prefill(manager, make_request("b", [*range(8), 30, 31]))
    manager.free(first)
    blocks = manager.req_to_blocks["b"].blocks
    assert [block.ref_cnt for block in blocks] == [1, 1, 1]
    assert manager.block_pool.get_num_free_blocks() == 5


def test_shared_prefix_uses_fewer_blocks():
    manager = make_manager(8)
    schedule_prefill(manager, make_request("a", [*range(8), 20, 21]))
    schedule_prefill(manager, make_request("b", [*range(8), 30, 31]))
    assert manager.block_pool.get_num_free_blocks() == 4


# ------------------------------------------------------------------------------------------ reset_prefix_cache
def test_reset_prefix_cache_false_while_request_holds_blocks():
    manager = make_manager()
    schedule_prefill(manager, make_request("a", list(range(8))))
    assert manager.reset_prefix_cache() is False


def test_reset_prefix_cache_false_keeps_hits():
    manager = make_manager()
    schedule_prefill(manager, make_request("a", list(range(8))))
    manager.reset_prefix_cache()
    _, num_computed = manager.get_computed_blocks(make_request("b", list(range(9))))
    assert num_computed == 8


def test_reset_prefix_cache_true_after_free():
    manager = make_manager()
    request = make_request("a", list(range(8)))
    schedule_prefill(manager, request)
    manager.free(request)
    assert manager.reset_prefix_cache() is True


def test_reset_prefix_cache_forgets_prefixes():
    manager = make_manager()
    request = make_request("a", list(range(8)))
    schedule_prefill(manager, request)
    manager.free(request)
    manager.reset_prefix_cache()
    _, num_computed = manager.get_computed_blocks(make_request("b", list(range(9))))
    assert num_computed == 0


# ------------------------------------------------------------------------------------------------------ usage
def test_usage_starts_at_zero():
    assert make_manager(10).usage == 0.0


def test_usage_reflects_allocated_blocks():
    manager = make_manager(10)
    schedule_prefill(manager, make_request("a", list(range(10))))
    assert manager.usage == pytest.approx(0.3)


def test_usage_reaches_one_when_full():
    manager = make_manager(3)
    schedule_prefill(manager, make_request("a", list(range(12))))
    assert manager.usage == pytest.approx(1.0)


def test_usage_returns_to_zero_after_free():
    manager = make_manager(10)
    request = make_request("a", list(range(10)))
    schedule_prefill(manager, request)
    manager.free(request)
    assert manager.usage == 0.0


# ----------------------------------------------------------------------------------------------- get_block_ids
def test_get_block_ids_returns_one_group_in_position_order():
    manager = make_manager()
    request = make_request("a", list(range(10)))
    new_blocks = manager.allocate_slots(request, 10)
    assert manager.get_block_ids("a") == new_blocks.get_block_ids()
    assert manager.get_block_ids("a") == ([0, 1, 2],)


def test_get_block_ids_of_unknown_request_is_empty():
    assert make_manager().get_block_ids("missing") == ([],)


def test_get_block_ids_returns_a_copy():
    manager = make_manager()
    manager.allocate_slots(make_request("a", list(range(10))), 10)
    manager.get_block_ids("a")[0].append(99)
    assert manager.get_block_ids("a") == ([0, 1, 2],)


# ------------------------------------------------------------------------------------ common prefix blocks
def test_num_common_prefix_blocks_counts_blocks_shared_by_all_running():
    manager = make_manager()
    schedule_prefill(manager, make_request("a", [*range(8), 20, 21]))
    schedule_prefill(manager, make_request("b", [*range(8), 30, 31]))
    assert manager.get_num_common_prefix_blocks("a", 2) == [2]
