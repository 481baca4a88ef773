"""KV cache building blocks: blocks, the O(1) free-block queue, and chained block hashing."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflow.request import Request

BlockHash = bytes
"""sha256 digest of (parent hash, block tokens, extra keys): equal hashes mean equal token prefixes."""

NONE_HASH: BlockHash = hashlib.sha256(b"kvflow-root-block").digest()


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Iterable[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """The chained hash of one full block: its parent's hash, its tokens, and extra keys (e.g. a cache salt)."""
    tokens = tuple(token_ids)
    digest = hashlib.sha256(parent_hash if parent_hash is not None else NONE_HASH)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


class RequestBlockHasher:
    """Computes the hashes of a request's newly full blocks (those past `len(request.block_hashes)`).

    The cache salt, if any, enters the first block's hash only, so salted and unsalted prompts never share.
    """

    __slots__ = ("block_size",)

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __call__(self, request: Request) -> list[BlockHash]:
        block_size = self.block_size
        # E.g., block_size 16, 2 blocks hashed, 50 tokens: block 2 (tokens 32..47) is new; 48..49 wait.
        start_block = len(request.block_hashes)
        num_full_blocks = request.num_tokens // block_size
        if num_full_blocks <= start_block:
            return []
        tokens = request.all_token_ids
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[BlockHash] = []
        for block_index in range(start_block, num_full_blocks):
            start = block_index * block_size
            extra = (request.cache_salt,) if block_index == 0 and request.cache_salt else None
            parent = hash_block_tokens(parent, tokens[start : start + block_size], extra)
            new_hashes.append(parent)
        return new_hashes


class KVCacheBlock:
    """One physical block of the paged KV cache.

    Invariants: `ref_cnt` is the number of requests using the block; a block is in the free queue iff
    `ref_cnt == 0`; `block_hash` is set iff the block is full and registered in the pool's hash map.
    """

    __slots__ = ("block_hash", "block_id", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks threaded through the blocks themselves; every operation is O(1).

    Eviction order is LRU: `popleft` takes from the head; freed hashed blocks are appended at the tail (so a
    block that may be reused as a prefix survives longest), freed unhashed blocks go to the head.
    Sentinel head/tail nodes keep the link updates branch-free.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        previous = self._head
        for block in blocks:
            previous.next_free_block = block
            block.prev_free_block = previous
            previous = block
        previous.next_free_block = self._tail
        self._tail.prev_free_block = previous

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is None or block is self._tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, count: int) -> list[KVCacheBlock]:
        return [self.popleft() for _ in range(count)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free_block, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        following = anchor.next_free_block
        assert following is not None
        block.prev_free_block = anchor
        block.next_free_block = following
        anchor.next_free_block = block
        following.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head-to-tail order (eviction order). O(n): for tests and debugging only."""
        blocks = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks
