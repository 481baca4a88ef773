"""Unit tests for kvflow.core.kv_cache_utils: the free-block queue and chained block hashing."""

from __future__ import annotations

import pytest

from kvflow.core.kv_cache_utils import (
    NONE_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    RequestBlockHasher,
    hash_block_tokens,
)
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_blocks(count: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(block_id) for block_id in range(count)]


def free_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [block.block_id for block in queue.get_all_free_blocks()]


def make_request(
    prompt: list[int],
    request_id: str = "r",
    cache_salt: str | None = None,
    block_size: int = BLOCK_SIZE,
) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(),
        block_hasher=RequestBlockHasher(block_size),
        cache_salt=cache_salt,
    )


# ------------------------------------------------------------------------------------------- KVCacheBlock
def test_new_block_is_unreferenced_and_unhashed():
    block = KVCacheBlock(7)
    assert (block.block_id, block.ref_cnt, block.block_hash) == (7, 0, None)


def test_block_has_slots_and_no_dict():
    block = KVCacheBlock(0)
    with pytest.raises(AttributeError):
        block.unexpected_attribute = 1  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------ FreeKVCacheBlockQueue
def test_queue_starts_with_blocks_in_given_order():
    queue = FreeKVCacheBlockQueue(make_blocks(4))
    assert free_ids(queue) == [0, 1, 2, 3]
    assert queue.num_free_blocks == 4


def test_empty_queue_has_no_free_blocks():
    queue = FreeKVCacheBlockQueue([])
    assert queue.num_free_blocks == 0
    assert queue.get_all_free_blocks() == []


def test_popleft_returns_blocks_head_first():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    assert [queue.popleft().block_id for _ in range(3)] == [0, 1, 2]


def test_popleft_decrements_num_free_blocks():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    queue.popleft()
    assert queue.num_free_blocks == 2
    assert free_ids(queue) == [1, 2]


def test_popleft_detaches_block_links():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    block = queue.popleft()
    assert block.prev_free_block is None
    assert block.next_free_block is None


def test_popleft_on_empty_queue_raises():
    queue = FreeKVCacheBlockQueue([])
    with pytest.raises(ValueError):
        queue.popleft()


def test_popleft_after_draining_raises():
    queue = FreeKVCacheBlockQueue(make_blocks(2))
    queue.popleft()
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    assert queue.num_free_blocks == 0


def test_popleft_n_returns_head_blocks_in_order():
    queue = FreeKVCacheBlockQueue(make_blocks(5))
    assert [block.block_id for block in queue.popleft_n(3)] == [0, 1, 2]
    assert free_ids(queue) == [3, 4]


def test_remove_from_middle_relinks_neighbours():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert free_ids(queue) == [0, 1, 3, 4]
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]


def test_remove_from_head():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[0])
    assert free_ids(queue) == [1, 2]
    assert queue.popleft() is blocks[1]


def test_remove_from_tail():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert free_ids(queue) == [0, 1]
    queue.append(KVCacheBlock(9))
    assert free_ids(queue) == [0, 1, 9]


def test_remove_only_block_empties_queue():
    blocks = make_blocks(1)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[0])
    assert queue.num_free_blocks == 0
    assert queue.get_all_free_blocks() == []


def test_remove_decrements_num_free_blocks():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[1])
    queue.remove(blocks[3])
    assert queue.num_free_blocks == 2


def test_remove_detaches_block_links():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[1])
    assert blocks[1].prev_free_block is None
    assert blocks[1].next_free_block is None


def test_remove_block_never_in_queue_raises():
    queue = FreeKVCacheBlockQueue(make_blocks(2))
    with pytest.raises(RuntimeError):
        queue.remove(KVCacheBlock(99))
    assert queue.num_free_blocks == 2


def test_remove_block_twice_raises():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[1])
    with pytest.raises(RuntimeError):
        queue.remove(blocks[1])
    assert queue.num_free_blocks == 2
    assert free_ids(queue) == [0, 2]


def test_remove_popped_block_raises():
    queue = FreeKVCacheBlockQueue(make_blocks(2))
    block = queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(block)


def test_append_puts_block_at_tail():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.append(blocks[2])
    assert free_ids(queue) == [0, 1, 2]


def test_appendleft_puts_block_at_head():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.appendleft(blocks[2])
    assert free_ids(queue) == [2, 0, 1]
    assert queue.popleft() is blocks[2]


def test_append_and_appendleft_increment_num_free_blocks():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue([blocks[0]])
    queue.append(blocks[1])
    queue.appendleft(blocks[2])
    assert queue.num_free_blocks == 3


def test_append_to_empty_queue():
    queue = FreeKVCacheBlockQueue([])
    block = KVCacheBlock(5)
    queue.append(block)
    assert queue.get_all_free_blocks() == [block]
    assert queue.popleft() is block


def test_appendleft_to_empty_queue():
    queue = FreeKVCacheBlockQueue([])
    block = KVCacheBlock(5)
    queue.appendleft(block)
    assert queue.get_all_free_blocks() == [block]
    assert queue.num_free_blocks == 1


def test_removed_block_can_be_reappended():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[0])
    queue.append(blocks[0])
    assert free_ids(queue) == [1, 2, 0]
    assert queue.num_free_blocks == 3


def test_num_free_blocks_tracks_mixed_operations():
    blocks = make_blocks(6)
    queue = FreeKVCacheBlockQueue(blocks)
    popped = queue.popleft_n(2)
    queue.remove(blocks[4])
    queue.append(popped[0])
    queue.appendleft(blocks[4])
    assert queue.num_free_blocks == len(queue.get_all_free_blocks()) == 5
    assert free_ids(queue) == [4, 2, 3, 5, 0]


def test_get_all_free_blocks_is_eviction_order():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[0])
    queue.append(blocks[0])
    expected = queue.get_all_free_blocks()
    assert [queue.popleft() for _ in range(4)] == expected


# ------------------------------------------------------------------------------------------ hash_block_tokens
def test_hash_is_deterministic():
    assert hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(None, [1, 2, 3, 4])


def test_hash_is_bytes_digest():
    digest = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(digest, bytes)
    assert len(digest) == 32


def test_hash_depends_on_tokens():
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [1, 2, 3, 5])


def test_hash_depends_on_token_order():
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [4, 3, 2, 1])


def test_hash_depends_on_parent():
    parent_a = hash_block_tokens(None, [1, 1, 1, 1])
    parent_b = hash_block_tokens(None, [2, 2, 2, 2])
    assert hash_block_tokens(parent_a, [5, 6, 7, 8]) != hash_block_tokens(parent_b, [5, 6, 7, 8])


def test_none_parent_equals_root_hash_parent():
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(NONE_HASH, [1, 2])


def test_hash_depends_on_extra_keys():
    assert hash_block_tokens(None, [1, 2], ("salt",)) != hash_block_tokens(None, [1, 2])


def test_different_extra_keys_hash_differently():
    assert hash_block_tokens(None, [1, 2], ("a",)) != hash_block_tokens(None, [1, 2], ("b",))


def test_hash_accepts_any_token_iterable():
    assert hash_block_tokens(None, (1, 2, 3)) == hash_block_tokens(None, iter([1, 2, 3]))


# ----------------------------------------------------------------------------------------- RequestBlockHasher
def test_request_hashes_match_manual_chain():
    tokens = list(range(12))
    request = make_request(tokens)
    first = hash_block_tokens(None, tokens[0:4])
    second = hash_block_tokens(first, tokens[4:8])
    third = hash_block_tokens(second, tokens[8:12])
    assert request.block_hashes == [first, second, third]


def test_partial_block_is_not_hashed():
    request = make_request(list(range(7)))
    assert len(request.block_hashes) == 1


def test_prompt_shorter_than_block_has_no_hashes():
    request = make_request([1, 2, 3])
    assert request.block_hashes == []


def test_changing_first_block_changes_every_hash():
    tokens = list(range(16))
    changed = [100, *tokens[1:]]
    original = make_request(tokens).block_hashes
    altered = make_request(changed).block_hashes
    assert all(a != b for a, b in zip(original, altered, strict=True))


def test_changing_later_block_keeps_earlier_hashes():
    tokens = list(range(16))
    changed = [*tokens[:8], 100, *tokens[9:]]
    original = make_request(tokens).block_hashes
    altered = make_request(changed).block_hashes
    assert original[:2] == altered[:2]
    assert original[2] != altered[2]
    assert original[3] != altered[3]


def test_equal_prefixes_hash_equal_across_requests():
    shared = list(range(8))
    first = make_request([*shared, 50, 51, 52, 53], request_id="a")
    second = make_request([*shared, 60, 61, 62, 63], request_id="b")
    assert first.block_hashes[:2] == second.block_hashes[:2]
    assert first.block_hashes[2] != second.block_hashes[2]


def test_identical_prompts_hash_identically():
    tokens = list(range(10))
    assert make_request(tokens, "a").block_hashes == make_request(tokens, "b").block_hashes


def test_cache_salt_changes_every_hash():
    tokens = list(range(12))
    unsalted = make_request(tokens).block_hashes
    salted = make_request(tokens, cache_salt="tenant-1").block_hashes
    assert all(a != b for a, b in zip(unsalted, salted, strict=True))


def test_different_salts_hash_differently():
    tokens = list(range(4))
    assert (
        make_request(tokens, cache_salt="x").block_hashes
        != make_request(tokens, cache_salt="y").block_hashes
    )


def test_cache_salt_enters_first_block_only():
    tokens = list(range(8))
    salted = make_request(tokens, cache_salt="tenant-1").block_hashes
    assert salted[0] == hash_block_tokens(None, tokens[:4], ("tenant-1",))
    assert salted[1] == hash_block_tokens(salted[0], tokens[4:8])


def test_hasher_returns_nothing_when_no_new_full_block():
    request = make_request(list(range(6)))
    assert RequestBlockHasher(BLOCK_SIZE)(request) == []


def test_incremental_hashing_one_token_at_a_time_matches_fresh_request():
    prompt = [7, 8, 9]
    outputs = list(range(20, 34))
    request = make_request(prompt)
    for token in outputs:
        request.append_output_token_ids(token)
    assert request.block_hashes == make_request(prompt + outputs).block_hashes


def test_incremental_hashing_in_chunks_matches_fresh_request():
    prompt = list(range(5))
    request = make_request(prompt)
    request.append_output_token_ids([40, 41])
    request.append_output_token_ids([42, 43, 44, 45, 46, 47, 48])
    expected = make_request([*prompt, 40, 41, 42, 43, 44, 45, 46, 47, 48]).block_hashes
    assert request.block_hashes == expected
    assert len(request.block_hashes) == 3


def test_incremental_hashing_with_salt_matches_fresh_request():
    request = make_request([1, 2], cache_salt="s")
    request.append_output_token_ids([3, 4, 5, 6, 7, 8])
    assert (
        request.block_hashes == make_request([1, 2, 3, 4, 5, 6, 7, 8], cache_salt="s").block_hashes
    )
