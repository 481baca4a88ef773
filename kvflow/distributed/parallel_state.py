"""One tensor-parallel group (this rank's place in it and its two collectives) and how tensors split across it.

A model built with `TensorParallelGroup.single()` (tensor_parallel_size 1) never calls torch.distributed: the
collectives return their input, so the one-rank path is exactly the unsharded model. Ranks of a larger group are
joined by `init_tensor_parallel_group` (gloo on CPU, NCCL on CUDA; the same calls either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvflow.utils import cdiv

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's rank in a tensor-parallel group of `size` ranks.

    Invariants: `0 <= rank < size`; `process_group` is the torch.distributed group joining the ranks (None exactly
    when `size == 1`). Every rank calls the collectives in the same order with tensors of the same shape.
    """

    rank: int
    size: int
    process_group: Any = None

    @staticmethod
    def single() -> TensorParallelGroup:
        """The group of one: no communication at all."""
        return TensorParallelGroup(0, 1, None)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it (unchanged for a group of one)."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.process_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `tensor` along the last dimension, in rank order."""
        if self.size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=-1)


def init_tensor_parallel_group(
    rank: int, size: int, init_method: str, device_type: str, timeout_s: float = 600.0
) -> TensorParallelGroup:
    """Join the `size` ranks (`init_method`: `tcp://host:port` of rank 0's store) and return this rank's group.

    The backend is NCCL on CUDA and gloo on CPU. A group of one joins nothing.
    """
    if size == 1:
        return TensorParallelGroup.single()
    import datetime

    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return TensorParallelGroup(rank, size, dist.group.WORLD)


def split_evenly(total: int, size: int, rank: int, what: str) -> tuple[int, int]:
    """`(start, length)` of rank `rank`'s equal part of `total` items; ValueError naming `what` if it does not
    divide."""
    if total % size:
        raise ValueError(
            f"{what} ({total}) is not divisible by tensor_parallel_size ({size}); choose a "
            f"tensor_parallel_size that divides it"
        )
    length = total // size
    return rank * length, length


def kv_head_partition(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """`(first KV head, number of KV heads)` rank `rank` holds.

    With at least as many KV heads as ranks they are divided evenly; with fewer, each rank holds one head, shared
    by `size // num_kv_heads` consecutive ranks (the ranks whose query heads attend to it). Anything else is a
    ValueError naming the counts.
    """
    if num_kv_heads >= size:
        return split_evenly(num_kv_heads, size, rank, "num_key_value_heads")
    if size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({size}) must divide num_key_value_heads ({num_kv_heads}) or be a "
            "multiple of it"
        )
    return rank // (size // num_kv_heads), 1


def vocab_partition(vocab_size: int, size: int, rank: int) -> tuple[int, int, int]:
    """`(first token id, real rows, padded rows)` of rank `rank`'s vocabulary part.

    Every rank holds `padded rows = ceil(vocab_size / size)` rows (so gathered logits have one shape); the last
    ranks' real rows may be fewer, and their padding rows stay zero and are cut off after the gather.
    """
    padded_rows = int(cdiv(vocab_size, size))
    start = rank * padded_rows
    real_rows = max(0, min(padded_rows, vocab_size - start))
    return start, real_rows, padded_rows
