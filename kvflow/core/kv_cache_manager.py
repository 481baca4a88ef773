"""KVCacheManager: the handful of verbs the scheduler uses to give requests KV blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.core.block_pool import BlockPool
from kvflow.core.kv_cache_utils import KVCacheBlock
from kvflow.utils import cdiv

if TYPE_CHECKING:
    from kvflow.request import Request


@dataclass
class KVCacheBlocks:
    """Blocks of one request, one list per KV cache group (kvflow has one group)."""

    blocks: tuple[list[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple(mine + theirs for mine, theirs in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.blocks)

    @property
    def is_empty(self) -> bool:
        return not any(self.blocks)


@dataclass
class _RequestBlocks:
    """One request's blocks in position order. Invariant: its first `num_cached_blocks` blocks are registered
    in the prefix cache (or were prefix hits), and `num_cached_blocks <= len(blocks)`."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_cached_blocks: int = 0


class KVCacheManager:
    """Maps requests to blocks of a `BlockPool`.

    Invariants: a request's blocks cover its first `len(blocks) * block_size` token positions; its first
    `num_cached_blocks` blocks are registered under the request's block hashes; a failed `allocate_slots`
    changes nothing; `free` releases the blocks tail-first so a request's last blocks are evicted first.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, _RequestBlocks] = {}
        # What `allocate_slots` returns when it allocates nothing (most decode steps): one shared instance, so
        # callers must not mutate it.
        self.no_new_blocks = KVCacheBlocks(([],))

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all of them, less a reserved null block (KV cache groups)."""
        return self.block_pool.num_usable_blocks

    def min_blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens needs at least."""
        return cdiv(num_tokens, self.block_size)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of full blocks, never including the last prompt token.

        At least one token must be computed to produce logits, so a fully cached prompt still recomputes its
        last block. Returns (blocks, number of computed tokens). Takes no reference: pass the blocks to
        `allocate_slots` in the same step.
        """
        if not self.enable_caching:
            return self._empty_blocks(), 0
        # The last prompt token must be computed, so the block holding it never counts as a hit.
        # E.g., block_size 16: a 32-token prompt may hit 1 block (token 31 is in block 1); a 33-token one, 2.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        return KVCacheBlocks((hit_blocks,)), len(hit_blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Give the request room for `num_new_tokens` (+ lookahead) beyond its computed and prefix-hit tokens.

        Returns the newly allocated blocks (not the prefix-hit ones; read-only, since an empty result is shared),
        or None if the pool cannot provide them, in which case nothing changed. Also registers the request's
        newly full blocks in the prefix cache.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        req_blocks = self.req_to_blocks.get(request.request_id)
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if (
            req_blocks is not None
            and new_computed_blocks is None
            and num_tokens_need_slot <= len(req_blocks.blocks) * self.block_size
        ):
            # Most decode steps: the held blocks already cover the new tokens, so nothing is allocated,
            # and unless a block just filled there is nothing to register either.
            num_tokens_to_cache = num_computed_tokens + num_new_tokens
            if (
                self.enable_caching
                and num_tokens_to_cache // self.block_size > req_blocks.num_cached_blocks
            ):
                self.cache_blocks(request, min(num_tokens_to_cache, request.num_tokens))
            return self.no_new_blocks
        computed_blocks = new_computed_blocks.blocks[0] if new_computed_blocks is not None else []
        num_existing = len(req_blocks.blocks) if req_blocks else 0
        if self.max_model_len is not None:
            num_tokens_need_slot = min(num_tokens_need_slot, self.max_model_len)
        # E.g., block_size 16, 3 blocks held, 40 computed, 10 new tokens: 50 tokens need cdiv(50, 16) = 4
        # blocks, so 1 more. Prefix-hit blocks (passed in, not yet held) count like held ones.
        num_blocks_to_allocate = max(
            0, cdiv(num_tokens_need_slot, self.block_size) - num_existing - len(computed_blocks)
        )
        # Prefix-hit blocks sitting in the free queue are taken out of it: they count against free capacity.
        num_revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_blocks_to_allocate + num_revived > self.block_pool.get_num_free_blocks():
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = _RequestBlocks()
        if computed_blocks:
            assert not req_blocks.blocks, "prefix hits apply only to a request with no blocks"
            self.block_pool.touch(computed_blocks)
            req_blocks.blocks.extend(computed_blocks)
            req_blocks.num_cached_blocks = len(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_blocks_to_allocate)
        req_blocks.blocks.extend(new_blocks)

        if self.enable_caching:
            # Only known tokens can be hashed: a position scheduled for a placeholder (async) is not yet in
            # `request.num_tokens`; its block is registered once the token arrives.
            self.cache_blocks(
                request, min(num_computed_tokens + num_new_tokens, request.num_tokens)
            )
        return KVCacheBlocks((new_blocks,))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first `num_tokens` tokens in the prefix cache."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        if (
            req_blocks is None
            or not self.enable_caching
            or num_tokens // self.block_size <= req_blocks.num_cached_blocks
        ):
            return  # e.g. a decode step that filled no block: nothing new to register
        # E.g., block_size 16, num_tokens 40: blocks 0 and 1 are full (32 tokens); block 2 holds 8 and waits.
        num_full_blocks = min(
            num_tokens // self.block_size, len(req_blocks.blocks), len(request.block_hashes)
        )
        self.block_pool.cache_full_blocks(
            request, req_blocks.blocks, req_blocks.num_cached_blocks, num_full_blocks
        )
        req_blocks.num_cached_blocks = max(req_blocks.num_cached_blocks, num_full_blocks)

    def free(self, request: Request) -> None:
        """Release every block of the request, last block first (so it is evicted first)."""
        req_blocks = self.req_to_blocks.pop(request.request_id, None)
        if req_blocks is not None:
            self.block_pool.free_blocks(reversed(req_blocks.blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; returns False (and changes nothing) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        req_blocks = self.req_to_blocks.get(request_id)
        return KVCacheBlocks((list(req_blocks.blocks) if req_blocks else [],))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        """Leading blocks of `request_id` shared by all running requests (stops at the first unshared one)."""
        req_blocks = self.req_to_blocks.get(request_id)
        num_common = 0
        for block in req_blocks.blocks if req_blocks else ():
            if block.ref_cnt != num_running_requests:
                break
            num_common += 1
        return [num_common]

    def _empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(([],))
