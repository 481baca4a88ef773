"""KV cache groups: the layer layout (`KVCacheLayout`) and the hybrid manager (a full-attention group beside
sliding-window groups, one pool): allocation per group, sliding groups giving back out-of-window blocks (kept as
evictable prefix-cache entries), prefix hits every group can serve, reset, preemption."""

from __future__ import annotations

from kvflow.core.hybrid_kv_cache_manager import HybridKVCacheManager, make_kv_cache_manager
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.kv_cache_utils import KVCacheLayout, RequestBlockHasher
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.utils import cdiv

BLOCK_SIZE = 4
WINDOW = 16


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=1000),
        block_hasher=RequestBlockHasher(BLOCK_SIZE),
    )


def make_manager(num_blocks: int = 200, windows=(None, WINDOW), **kwargs) -> HybridKVCacheManager:
    manager = make_kv_cache_manager(num_blocks, BLOCK_SIZE, group_windows=windows, **kwargs)
    assert isinstance(manager, HybridKVCacheManager)
    return manager


def held(manager: HybridKVCacheManager, request: Request, group_id: int) -> list[int]:
    """Block ids the request really holds in a group (the null block excluded)."""
    null_id = manager.null_block.block_id
    return [
        block_id
        for block_id in manager.get_block_ids(request.request_id)[group_id]
        if block_id != null_id
    ]


def run_prefill(manager: HybridKVCacheManager, request: Request, chunk: int) -> None:
    """Prefill the prompt in chunks of `chunk` tokens, as the scheduler does (prefix hit first)."""
    computed_blocks, num_hit = manager.get_computed_blocks(request)
    first = True
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(
            chunk, request.num_tokens - request.num_computed_tokens - (num_hit if first else 0)
        )
        assert (
            manager.allocate_slots(
                request,
                num_new,
                num_hit if first else 0,
                computed_blocks if first else None,
            )
            is not None
        )
        request.num_computed_tokens += num_new + (num_hit if first else 0)
        first = False


def decode(manager: HybridKVCacheManager, request: Request, num_steps: int) -> None:
    for step in range(num_steps):
        request.append_output_token_ids([1000 + step])
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1


# ------------------------------------------------------------------------------------------ layout
def test_layout_one_kind_keeps_one_group_and_a_tensor_per_layer():
    layout = KVCacheLayout([None] * 4)
    assert layout.group_windows == (None,) and not layout.is_hybrid
    assert layout.layer_pages == (0, 1, 2, 3) and layout.num_pages == 4
    sliding = KVCacheLayout([4096] * 3)
    assert sliding.group_windows == (4096,) and sliding.num_pages == 3


def test_layout_gemma2_alternating_layers_share_tensors_pairwise():
    windows = [4096 if i % 2 == 0 else None for i in range(26)]
    layout = KVCacheLayout(windows)
    assert layout.group_windows == (None, 4096)
    assert layout.num_pages == 13
    # Each tensor is shared by one full and one sliding layer; no group uses a tensor twice.
    for group_id in range(2):
        pages = [layout.layer_pages[i] for i in range(26) if layout.layer_groups[i] == group_id]
        assert sorted(pages) == list(range(13))


def test_layout_gemma3_five_to_one():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    layout = KVCacheLayout(windows)
    assert layout.num_pages == 4  # the 4 global layers
    assert layout.group_windows == (None,) + (512,) * 6  # 22 local layers: 5 groups of 4, one of 2
    for group_id in range(layout.num_groups):
        pages = [layout.layer_pages[i] for i in range(26) if layout.layer_groups[i] == group_id]
        assert len(pages) == len(set(pages)) <= 4


def test_one_full_group_keeps_the_plain_manager():
    manager = make_kv_cache_manager(10, BLOCK_SIZE, group_windows=(None,))
    assert type(manager) is KVCacheManager


# ------------------------------------------------------------------------------------------ allocation
def test_sliding_group_holds_only_its_window_while_the_full_group_grows():
    manager = make_manager()
    request = make_request("a", list(range(100)))
    run_prefill(manager, request, chunk=8)
    bound = (
        cdiv(WINDOW - 1, BLOCK_SIZE) + 1
    )  # the window before the next token, and the next token's block
    for _ in range(60):
        decode(manager, request, 1)
        num_full = len(held(manager, request, 0))
        assert num_full == cdiv(request.num_computed_tokens + 1, BLOCK_SIZE) or num_full == cdiv(
            request.num_computed_tokens, BLOCK_SIZE
        )
        assert len(held(manager, request, 1)) <= bound
    # Positions stay aligned: both tables are as long as the sequence needs.
    ids = manager.get_block_ids("a")
    assert len(ids[0]) == len(ids[1])
    total_used = manager.block_pool.num_usable_blocks - manager.block_pool.get_num_free_blocks()
    assert total_used < 2 * len(ids[0])  # fewer than two groups of whole-sequence tables


def test_freed_window_blocks_stay_cached_and_evictable():
    manager = make_manager()
    request = make_request("a", list(range(64)))
    run_prefill(manager, request, chunk=8)
    pool = manager.block_pool
    # Before the last chunk (56 computed) sliding blocks 0..9 fell out of the window of every token from 56 on:
    # free (in the queue) yet still findable under group 1's key.
    free_ids = {block.block_id for block in pool.free_block_queue.get_all_free_blocks()}
    for index in range(10):
        block = pool.get_cached_block(pool.group_key(request.block_hashes[index], 1))
        assert block is not None and block.ref_cnt == 0 and block.block_id in free_ids
    manager.free(request)
    assert pool.get_num_free_blocks() == pool.num_usable_blocks


def test_failed_allocation_changes_nothing_and_free_returns_everything():
    manager = make_manager(num_blocks=12)
    request = make_request("a", list(range(40)))
    assert manager.allocate_slots(request, 40) is None  # 10 blocks per group, 11 usable
    assert manager.get_block_ids("a") == ([], [])
    assert manager.allocate_slots(request, 16) is not None
    assert manager.block_pool.get_num_free_blocks() == 11 - 8
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == 11


# ------------------------------------------------------------------------------------------ prefix hits
def test_prefix_hit_past_the_window_revives_only_the_window_blocks():
    manager = make_manager()
    first = make_request("a", list(range(64)))
    run_prefill(manager, first, chunk=8)
    manager.free(first)
    second = make_request("b", list(range(40)) + [999] * 5)
    hit, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 40
    null = manager.null_block
    full_hit, sliding_hit = hit.blocks
    assert len(full_hit) == len(sliding_hit) == 10
    needed = cdiv(WINDOW - 1, BLOCK_SIZE)
    assert all(block is null for block in sliding_hit[: 10 - needed])
    assert all(block is not null for block in sliding_hit[10 - needed :])
    free_before = manager.block_pool.get_num_free_blocks()
    new_blocks = manager.allocate_slots(second, 5, num_hit_tokens, hit)
    assert new_blocks is not None
    # 10 full + 4 sliding blocks revived, 2 new per group (positions 40..44).
    assert manager.block_pool.get_num_free_blocks() == free_before - 14 - 4
    assert len(held(manager, second, 1)) == needed + 2


def test_prefix_hit_shortened_to_where_the_sliding_window_is_cached():
    manager = make_manager()
    first = make_request("a", list(range(64)))
    run_prefill(manager, first, chunk=8)
    manager.free(first)
    pool = manager.block_pool
    # Evict sliding block 8: a hit of 10 blocks lacks part of its window; from the right, blocks 4..7 cover the
    # window before 8 blocks.
    victim = pool.get_cached_block(pool.group_key(first.block_hashes[8], 1))
    pool.free_block_queue.remove(victim)
    pool._evict(victim)
    pool.free_block_queue.appendleft(victim)
    second = make_request("b", list(range(40)) + [999] * 5)
    hit, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 32
    assert [len(group) for group in hit.blocks] == [8, 8]


def test_prefix_hit_shorter_than_a_window_needs_every_block_from_the_start():
    manager = make_manager()
    first = make_request("a", list(range(12)))
    run_prefill(manager, first, chunk=12)
    manager.free(first)
    second = make_request("b", [*range(12), 7])
    hit, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 12
    assert manager.null_block not in hit.blocks[1]


def test_groups_never_hit_each_others_blocks():
    manager = make_manager()
    first = make_request("a", list(range(20)))
    run_prefill(manager, first, chunk=20)
    pool = manager.block_pool
    full_block = pool.get_cached_block(first.block_hashes[0])
    sliding_block = pool.get_cached_block(pool.group_key(first.block_hashes[0], 1))
    assert full_block is not None and sliding_block is not None and full_block is not sliding_block


def test_reset_prefix_cache_refuses_while_in_use_then_forgets_every_group():
    manager = make_manager()
    request = make_request("a", list(range(40)))
    run_prefill(manager, request, chunk=8)
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.reset_prefix_cache()
    again = make_request("b", [*range(40), 1])
    assert manager.get_computed_blocks(again)[1] == 0


def test_unsettled_tokens_keep_blocks_the_computed_count_may_move_back_to():
    margin = 6
    manager = make_manager(num_unsettled_tokens=margin)
    request = make_request("a", list(range(80)))
    run_prefill(manager, request, chunk=8)
    decode(manager, request, 1)
    # Position p = num_computed - margin still sees its whole window.
    first_key = request.num_computed_tokens - 1 - margin - WINDOW + 1
    ids = manager.get_block_ids("a")[1]
    null_id = manager.null_block.block_id
    assert all(block_id != null_id for block_id in ids[first_key // BLOCK_SIZE :])


def test_only_sliding_layers_one_group_still_frees():
    manager = make_manager(windows=(WINDOW,))
    request = make_request("a", list(range(100)))
    run_prefill(manager, request, chunk=8)
    assert len(held(manager, request, 0)) <= cdiv(WINDOW - 1, BLOCK_SIZE) + 2
