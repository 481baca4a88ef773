"""HybridKVCacheManager: the KV cache manager for models whose layers fall into several KV cache groups (full
attention and sliding windows, see `KVCacheLayout`), or whose layers all slide.

Each group keeps its own block list per request, drawn from one pool; a sliding-window group gives back (to the
pool, hashes kept, so they stay evictable prefix-cache entries) the blocks that fall wholly before the window of every
token still to be computed, leaving the pool's null block in their place, so a long request costs its full groups'
blocks plus one window per sliding group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, _RequestBlocks
from kvflow.core.kv_cache_utils import KVCacheBlock
from kvflow.utils import cdiv

if TYPE_CHECKING:
    from kvflow.request import Request


def make_kv_cache_manager(
    num_blocks: int,
    block_size: int,
    *,
    enable_caching: bool = True,
    max_model_len: int | None = None,
    group_windows: Sequence[int | None] = (None,),
    num_unsettled_tokens: int = 0,
) -> KVCacheManager:
    """The plain manager for one full-attention group (today's behaviour and speed), else the hybrid one."""
    if tuple(group_windows) == (None,):
        return KVCacheManager(
            num_blocks, block_size, enable_caching=enable_caching, max_model_len=max_model_len
        )
    return HybridKVCacheManager(
        num_blocks,
        block_size,
        group_windows,
        enable_caching=enable_caching,
        max_model_len=max_model_len,
        num_unsettled_tokens=num_unsettled_tokens,
    )


@dataclass
class _GroupBlocks(_RequestBlocks):
    """One request's blocks in one group, in position order; in a sliding group the first `num_skipped_blocks`
    entries are the pool's null block (positions no future token attends to) or prefix-hit placeholders."""

    num_skipped_blocks: int = 0


class HybridKVCacheManager(KVCacheManager):
    """Maps requests to one block list per KV cache group (`group_windows[g]`: group g's sliding window, None for
    full attention), all drawn from one `BlockPool` whose block 0 is the null block.

    Invariants: a request's group lists all have the same length, entry i covering token positions
    `[i * block_size, (i + 1) * block_size)`; in a sliding group of window W, entries wholly before position
    `num_computed_tokens - num_unsettled_tokens - W + 1` (as of the last `allocate_slots`) are the null block, every
    other entry is a block the request holds a reference to; its first `num_cached_blocks` entries are registered in
    the prefix cache under their group's keys (or are prefix hits, or null). `num_unsettled_tokens` is how far the
    scheduler's computed count may later move back (in-flight async steps, rejected drafts): blocks inside that margin
    are kept. A failed `allocate_slots` allocates nothing (it may still give back skipped blocks: no token needs them).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        group_windows: Sequence[int | None],
        enable_caching: bool = True,
        max_model_len: int | None = None,
        num_unsettled_tokens: int = 0,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching, max_model_len)
        self.block_pool = BlockPool(num_blocks, enable_caching, reserve_null_block=True)
        assert self.block_pool.null_block is not None
        self.null_block: KVCacheBlock = self.block_pool.null_block
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.num_unsettled_tokens = num_unsettled_tokens
        self.sliding_groups = [
            (group_id, window)
            for group_id, window in enumerate(self.group_windows)
            if window is not None
        ]
        self.req_to_group_blocks: dict[str, list[_GroupBlocks]] = {}
        self.no_new_blocks = self._empty_blocks()

    def min_blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` needs at least: every full group's, and a window's per sliding group."""
        num_blocks = cdiv(num_tokens, self.block_size)
        return sum(
            num_blocks if window is None else min(num_blocks, cdiv(window - 1, self.block_size) + 1)
            for window in self.group_windows
        )

    # ------------------------------------------------------------------------------------------ prefix hits
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix every group can serve: full groups hold all its blocks, sliding groups the
        blocks covering the window before its end (null before that). Never includes the last prompt token."""
        if not self.enable_caching:
            return self._empty_blocks(), 0
        num_hit_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        hits: list[list[KVCacheBlock]] = [[] for _ in range(self.num_groups)]
        for group_id, window in enumerate(self.group_windows):
            if window is None:
                hits[group_id] = self._full_hit(request, group_id, num_hit_blocks)
                num_hit_blocks = len(hits[group_id])
        # A sliding group's hit may be shorter than the full groups'; a shorter length may then fail another
        # sliding group (its window sits elsewhere), so repeat until every sliding group serves the same length.
        changed = bool(self.sliding_groups)
        while changed:
            changed = False
            for group_id, window in self.sliding_groups:
                hits[group_id] = self._sliding_hit(request, group_id, window, num_hit_blocks)
                if len(hits[group_id]) < num_hit_blocks:
                    num_hit_blocks = len(hits[group_id])
                    changed = True
        blocks = tuple(group_hits[:num_hit_blocks] for group_hits in hits)
        return KVCacheBlocks(blocks), num_hit_blocks * self.block_size

    def _full_hit(self, request: Request, group_id: int, max_blocks: int) -> list[KVCacheBlock]:
        """Cached blocks of a full-attention group from block 0 on, up to the first miss (at most `max_blocks`)."""
        pool = self.block_pool
        hit: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = pool.get_cached_block(pool.group_key(block_hash, group_id))
            if block is None:
                break
            hit.append(block)
        return hit

    def _sliding_hit(
        self, request: Request, group_id: int, window: int, max_blocks: int
    ) -> list[KVCacheBlock]:
        """The longest hit of at most `max_blocks` blocks for a sliding group: found from the right, the first run of
        cached blocks long enough to cover the window before the hit's end (nulls before it), or, failing that, the
        run of cached blocks from block 0."""
        null_block = self.null_block
        # The token after a hit of L blocks attends keys from L * block_size - window + 1 on: the last
        # cdiv(window - 1, block_size) blocks. E.g., window 16, block_size 4: blocks L - 4 .. L - 1.
        num_needed = cdiv(window - 1, self.block_size)
        if num_needed == 0:
            return [null_block] * max_blocks
        pool = self.block_pool
        block_hashes = request.block_hashes
        hit = [null_block] * max_blocks
        run = 0
        for index in range(max_blocks - 1, -1, -1):
            block = pool.get_cached_block(pool.group_key(block_hashes[index], group_id))
            if block is None:
                run = 0
                continue
            hit[index] = block
            run += 1
            if run >= num_needed:
                return hit[: index + run]
        # The cached run from block 0 (shorter than a window: nothing before it to skip).
        return hit[:run]

    # ------------------------------------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """As `KVCacheManager.allocate_slots`, per group: every group grows by the same number of blocks, after the
        sliding groups gave back the blocks no token from the computed ones on attends to."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        groups = self.req_to_group_blocks.get(request.request_id)
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if groups is not None and self.sliding_groups:
            self._skip_out_of_window(groups, num_computed_tokens)
        if (
            groups is not None
            and new_computed_blocks is None
            and num_tokens_need_slot <= len(groups[0].blocks) * self.block_size
        ):
            num_tokens_to_cache = num_computed_tokens + num_new_tokens
            if (
                self.enable_caching
                and num_tokens_to_cache // self.block_size > groups[0].num_cached_blocks
            ):
                self.cache_blocks(request, min(num_tokens_to_cache, request.num_tokens))
            return self.no_new_blocks
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else None
        num_hit_blocks = len(hits[0]) if hits else 0
        num_existing = len(groups[0].blocks) if groups else 0
        if self.max_model_len is not None:
            num_tokens_need_slot = min(num_tokens_need_slot, self.max_model_len)
        num_blocks_per_group = max(
            0, cdiv(num_tokens_need_slot, self.block_size) - num_existing - num_hit_blocks
        )
        # Prefix-hit blocks sitting in the free queue are taken out of it (the null block never is).
        num_revived = (
            sum(1 for group_hits in hits for block in group_hits if block.ref_cnt == 0)
            if hits
            else 0
        )
        num_to_allocate = num_blocks_per_group * self.num_groups
        if num_to_allocate + num_revived > self.block_pool.get_num_free_blocks():
            return None

        if groups is None:
            groups = self.req_to_group_blocks[request.request_id] = [
                _GroupBlocks() for _ in range(self.num_groups)
            ]
        if hits and num_hit_blocks:
            assert num_existing == 0, "prefix hits apply only to a request with no blocks"
            null_block = self.null_block
            for group, group_hits in zip(groups, hits, strict=True):
                self.block_pool.touch(block for block in group_hits if block is not null_block)
                group.blocks.extend(group_hits)
                group.num_cached_blocks = num_hit_blocks
        new_blocks = self.block_pool.get_new_blocks(num_to_allocate)
        per_group: list[list[KVCacheBlock]] = []
        for group_id, group in enumerate(groups):
            group_new = new_blocks[
                group_id * num_blocks_per_group : (group_id + 1) * num_blocks_per_group
            ]
            group.blocks.extend(group_new)
            per_group.append(group_new)
        if self.enable_caching:
            self.cache_blocks(
                request, min(num_computed_tokens + num_new_tokens, request.num_tokens)
            )
        return KVCacheBlocks(tuple(per_group))

    def _skip_out_of_window(self, groups: list[_GroupBlocks], num_computed_tokens: int) -> None:
        """Give back each sliding group's blocks that lie wholly before the window of every token from
        `num_computed_tokens - num_unsettled_tokens` on; they stay cached (evictable) under their hashes."""
        settled = num_computed_tokens - self.num_unsettled_tokens
        block_size = self.block_size
        null_block = self.null_block
        skipped: list[KVCacheBlock] = []
        for group_id, window in self.sliding_groups:
            group = groups[group_id]
            # A token at position p attends keys p - window + 1 .. p. E.g., window 16, block_size 4, settled 30:
            # keys from 15 on, so blocks 0..2 (keys 0..11) are skipped and block 3 (keys 12..15) stays.
            num_skippable = min(max(0, settled - window + 1) // block_size, len(group.blocks))
            if num_skippable <= group.num_skipped_blocks:
                continue
            blocks = group.blocks
            for index in range(group.num_skipped_blocks, num_skippable):
                block = blocks[index]
                if block is not null_block:
                    skipped.append(block)
                    blocks[index] = null_block
            group.num_skipped_blocks = num_skippable
        if skipped:
            self.block_pool.free_blocks(skipped)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first `num_tokens` tokens, in every group."""
        groups = self.req_to_group_blocks.get(request.request_id)
        if (
            groups is None
            or not self.enable_caching
            or num_tokens // self.block_size <= groups[0].num_cached_blocks
        ):
            return
        num_full_blocks = min(
            num_tokens // self.block_size, len(groups[0].blocks), len(request.block_hashes)
        )
        for group_id, group in enumerate(groups):
            self.block_pool.cache_full_blocks(
                request, group.blocks, group.num_cached_blocks, num_full_blocks, group_id
            )
            group.num_cached_blocks = max(group.num_cached_blocks, num_full_blocks)

    def free(self, request: Request) -> None:
        """Release every block of the request, last position first across the groups (evicted first)."""
        groups = self.req_to_group_blocks.pop(request.request_id, None)
        if groups is None:
            return
        null_block = self.null_block
        ordered = [
            block
            for position_blocks in zip(*(reversed(group.blocks) for group in groups), strict=True)
            for block in position_blocks
            if block is not null_block
        ]
        self.block_pool.free_blocks(ordered)

    # ------------------------------------------------------------------------------------------ queries
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        groups = self.req_to_group_blocks.get(request_id)
        if groups is None:
            return self._empty_blocks()
        return KVCacheBlocks(tuple(list(group.blocks) for group in groups))

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        """Leading blocks of group 0 shared by all running requests; 0 for the other groups."""
        groups = self.req_to_group_blocks.get(request_id)
        num_common = 0
        for block in groups[0].blocks if groups else ():
            if block.ref_cnt != num_running_requests:
                break
            num_common += 1
        return [num_common] + [0] * (self.num_groups - 1)

    def _empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in range(self.num_groups)))
