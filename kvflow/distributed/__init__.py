"""Tensor-parallel groups and partitioning rules shared by the model layers, the loader and the executors."""

from __future__ import annotations

from kvflow.distributed.parallel_state import (
    TensorParallelGroup,
    init_tensor_parallel_group,
    kv_head_partition,
    split_evenly,
    vocab_partition,
)

__all__ = [
    "TensorParallelGroup",
    "init_tensor_parallel_group",
    "kv_head_partition",
    "split_evenly",
    "vocab_partition",
]
