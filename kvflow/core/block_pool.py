"""BlockPool: owns every KV block, their reference counts, and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvflow.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from kvflow.request import Request


class BlockPool:
    """Allocation, reference counting, and hash -> block lookup with LRU eviction.

    Invariants: every block is either in use (`ref_cnt > 0`) or in `free_block_queue`, never both;
    `cached_block_hash_to_block[h].block_hash == h`; a hashed free block stays findable (a prefix hit revives
    it) until allocation evicts it from the head of the free queue.

    With several KV cache groups a block's hash is keyed by its group (`group_key`): group g's blocks hit only
    group g's lookups. With `reserve_null_block`, block 0 is `null_block`: never free, never hashed, the placeholder
    a sliding-window group's block table holds for positions outside every future token's window.
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, reserve_null_block: bool = False
    ) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be >= {1 + reserve_null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.null_block: KVCacheBlock | None = None
        # Blocks requests can hold: all of them, less the null block.
        self.num_usable_blocks = num_blocks
        if reserve_null_block:
            self.null_block = self.free_block_queue.popleft()
            self.null_block.ref_cnt = (
                1  # never reaches 0: no free list, no double free goes unnoticed
            )
            self.num_usable_blocks -= 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    @staticmethod
    def group_key(block_hash: BlockHash, group_id: int) -> BlockHash:
        """The prefix-cache key of a block of group `group_id`: the hash itself for group 0, else the hash followed
        by the group id (a longer key, so never equal to a bare 32-byte hash)."""
        return block_hash if group_id == 0 else block_hash + group_id.to_bytes(4, "little")

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the LRU head, evicting their cached hashes; each gets ref_cnt 1."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"Cannot get {num_blocks} free blocks from the pool "
                f"({self.get_num_free_blocks()} free)"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: take a reference, reviving blocks that sat in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in eviction-priority order (first freed, first evicted).

        Blocks reaching ref_cnt 0 with a hash go to the LRU tail (reusable as prefix); unhashed ones to the head.
        """
        unhashed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    unhashed.append(block)
                else:
                    self.free_block_queue.append(block)
        # Keep eviction priority among the unhashed ones too: appendleft reverses, so feed them reversed.
        # E.g., unhashed freed as [a, b, c]: appendleft c, b, a -> the queue starts a, b, c (a evicted first).
        for block in reversed(unhashed):
            self.free_block_queue.appendleft(block)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Register blocks [num_cached_blocks, num_full_blocks) of a request under their chained hashes (keyed by
        `group_id`, see `group_key`).

        A block whose hash is already mapped (another request computed the same prefix concurrently) stays
        unhashed: it is freed to the head and reused first, while the mapped twin serves future hits. The null
        block (a sliding group's skipped position) is never registered.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        block_hashes = request.block_hashes
        assert len(block_hashes) >= num_full_blocks, "block hashes lag behind the computed tokens"
        null_block = self.null_block
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.block_hash is not None or block is null_block:
                continue  # a prefix hit (already registered) or a skipped position
            block_hash = (
                block_hashes[index]
                if group_id == 0
                else self.group_key(block_hashes[index], group_id)
            )
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refuses (returns False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
