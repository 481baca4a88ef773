"""Linear layers whose weight may stack several checkpoint projections (fused QKV, fused gate/up)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import kernels


class Linear(nn.Module):
    """`y = x @ weight.T (+ bias)`, where `weight` stacks `len(output_sizes)` shards along its rows.

    Invariants: `weight` is `[sum(output_sizes), input_size]` (and `bias`, when present, `[sum(output_sizes)]`);
    shard `i` owns rows `shard_rows(i)`, so one matmul computes every fused projection and the checkpoint's separate
    tensors load into their own row ranges.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: int | Sequence[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.output_sizes = (
            (output_sizes,) if isinstance(output_sizes, int) else tuple(output_sizes)
        )
        self.input_size = input_size
        total = sum(self.output_sizes)
        self.weight = nn.Parameter(
            torch.empty(total, input_size, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(total, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def shard_rows(self, shard: int) -> slice:
        """The rows of `weight` (and entries of `bias`) that shard `shard` occupies."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = kernels.linear(hidden_states, self.weight, self.bias)  # decode GEMV on CPU, else None
        return out if out is not None else F.linear(hidden_states, self.weight, self.bias)
