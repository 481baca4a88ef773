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

    The cache salt and the LoRA adapter, if any, enter the first block's hash only (the chain carries them into
    every later block), so salted and unsalted prompts, or prompts run with different adapters (or none), never
    share a block, while requests of the same adapter share their prefixes.
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
            extra = _first_block_keys(request) if block_index == 0 else None
            parent = hash_block_tokens(parent, tokens[start : start + block_size], extra)
            new_hashes.append(parent)
        return new_hashes


def _first_block_keys(request: Request) -> tuple[object, ...] | None:
    """The extra keys of a request's first block: its cache salt and its adapter's `LoRARequest.cache_key`
    (None when it has neither, so unsalted base-model hashes stay what they always were)."""
    lora_request = request.lora_request
    if lora_request is None:
        return (request.cache_salt,) if request.cache_salt else None
    return (request.cache_salt, *lora_request.cache_key)


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


class KVCacheLayout:
    """How a model's layers share the paged KV cache: layers grouped by attention kind, each group with its own block
    table per request, all groups drawing block ids from one pool (vLLM's hybrid allocator idea).

    Invariants: `group_windows[g]` is group g's sliding window (None: full attention); full-attention groups come
    first, so group 0 covers every position whenever any layer attends the whole sequence; every layer is in exactly
    one group (`layer_groups`) and owns one of `num_pages` per-layer KV tensors (`layer_pages`); no two layers of one
    group share a tensor, so a block id held by group g names a page that only g's layers read or write. With one
    kind of attention there is one group and layer i owns tensor i (today's layout). With several kinds, every group
    has at most `num_pages` layers (the fewest layers of any kind), so one block costs `num_pages` layers' K/V instead
    of every layer's, and a sliding group holds only its window's blocks.
    """

    __slots__ = ("group_windows", "layer_groups", "layer_pages", "num_pages")

    def __init__(self, layer_windows: Iterable[int | None]) -> None:
        windows = list(layer_windows)
        kinds: dict[int | None, list[int]] = {}
        for layer_index, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer_index)
        if len(kinds) <= 1:
            self.group_windows: tuple[int | None, ...] = (windows[0] if windows else None,)
            self.layer_groups: tuple[int, ...] = (0,) * len(windows)
            self.layer_pages: tuple[int, ...] = tuple(range(len(windows)))
            self.num_pages = len(windows)
            return
        group_size = min(len(layers) for layers in kinds.values())
        # Full attention first, then windows in increasing size (a fixed order on every rank and in the scheduler).
        ordered = sorted(kinds, key=lambda window: (window is not None, window or 0))
        group_windows: list[int | None] = []
        layer_groups = [0] * len(windows)
        layer_pages = [0] * len(windows)
        for window in ordered:
            layers = kinds[window]
            # E.g., 22 sliding layers, group_size 4: groups of 4, 4, 4, 4, 4, 2 layers.
            for start in range(0, len(layers), group_size):
                for page, layer_index in enumerate(layers[start : start + group_size]):
                    layer_groups[layer_index] = len(group_windows)
                    layer_pages[layer_index] = page
                group_windows.append(window)
        self.group_windows = tuple(group_windows)
        self.layer_groups = tuple(layer_groups)
        self.layer_pages = tuple(layer_pages)
        self.num_pages = group_size

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def blocks_per_sequence(self, num_tokens: int, block_size: int, chunk_tokens: int) -> int:
        """Blocks one sequence of `num_tokens` tokens holds at most, prefilled in chunks of `chunk_tokens`: every
        position in a full group, a window plus a chunk in a sliding group."""
        num_blocks = -(-num_tokens // block_size)
        return sum(
            num_blocks
            if window is None
            else min(num_blocks, -(-(window - 1 + chunk_tokens) // block_size) + 1)
            for window in self.group_windows
        )

    @property
    def is_hybrid(self) -> bool:
        """True when layers are split into several groups (block ids then differ per group)."""
        return len(self.group_windows) > 1

    def __repr__(self) -> str:
        return f"KVCacheLayout(group_windows={self.group_windows}, num_pages={self.num_pages})"
