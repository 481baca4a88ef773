"""The dense feed-forward block decoder families share: a gated MLP with its gate and up projections fused.

A mixture-of-experts block takes this block's place in a decoder layer (`kvflow.models.layers.decoder`): same input
and output, `[num_tokens, hidden_size]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvflow.distributed.parallel_state import TensorParallelGroup, split_evenly
from kvflow.models.layers.activation import gelu_tanh_and_mul, silu_and_mul
from kvflow.models.layers.linear import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvflow.models.hf_config import TransformerConfig

# The most bytes of gate/up product one pass of `GatedMLP` materialises: a step with more rows runs the block in
# equal row chunks (of at least `MLP_CHUNK_MIN_ROWS`). A whole 2048-token step of Qwen2-0.5B's shape makes 40 MB in
# bfloat16, above glibc's largest mmap threshold (32 MB), so every layer's product was a fresh mapping whose pages
# fault on first touch, ~20 ms a layer on the Zen 4 development VM; chunks of 10 MB come back from the allocator
# already mapped, and the activation and the down product read them from cache (benchmarks/RESULTS.md, issue 45
# item 3).
MLP_CHUNK_BYTES = 12 * 2**20
MLP_CHUNK_MIN_ROWS = 256

# `hidden_act` -> the gated activation of the fused gate/up output.
_GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,  # Gemma 2
}


class GatedMLP(nn.Module):
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))` with gate and up fused in `gate_up_proj` (gate rows first).

    Invariants: the config's `hidden_act` is "silu" or "gelu_pytorch_tanh" (Gemma 2: `gelu_tanh` in silu's place;
    anything else is a ValueError at construction); `forward` gives every row the same result whether the rows run
    at once or, above `MLP_CHUNK_BYTES` of gate/up product (and without LoRA adapters, whose deltas are mapped to
    the step's rows), in row chunks (`chunk_rows`), wherever the products are row-invariant; its checkpoint
    names are `gate_proj`, `up_proj` (packed into `gate_up_proj`) and `down_proj`. Under tensor parallelism each
    rank holds a slice of the intermediate size: gate/up column-parallel, down row-parallel (one all-reduce).
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        activation = _GATED_ACTIVATIONS.get(config.hidden_act)
        if activation is None:
            raise ValueError(
                f"unsupported hidden_act {config.hidden_act!r}; implemented: "
                f"{', '.join(repr(name) for name in _GATED_ACTIVATIONS)}"
            )
        self.activation = activation
        intermediate_range = split_evenly(
            config.intermediate_size, tp.size, tp.rank, "intermediate_size"
        )
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size,
            (intermediate_range,) * 2,
            bias=config.mlp_bias,
            dtype=dtype,
            device=device,
        )
        self.down_proj = RowParallelLinear(
            intermediate_range,
            config.hidden_size,
            bias=config.mlp_bias,
            tp=tp,
            dtype=dtype,
            device=device,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        num_rows = hidden_states.shape[0]
        chunk_rows = self.chunk_rows(num_rows, hidden_states.element_size())
        if chunk_rows >= num_rows:
            return self.down_proj(self.activation(self.gate_up_proj(hidden_states)))
        return torch.cat(
            [
                self.down_proj(self.activation(self.gate_up_proj(rows)))
                for rows in hidden_states.split(chunk_rows)
            ]
        )

    def chunk_rows(self, num_rows: int, element_size: int) -> int:
        """How many of `num_rows` rows one pass of the block takes: all of them, or, where their gate/up product
        would exceed `MLP_CHUNK_BYTES`, equal chunks under it (at least `MLP_CHUNK_MIN_ROWS` each)."""
        if self.gate_up_proj.lora is not None or self.down_proj.lora is not None:
            return num_rows
        product_bytes = num_rows * sum(self.gate_up_proj.output_sizes) * element_size
        num_chunks = -(-product_bytes // MLP_CHUNK_BYTES)
        if num_chunks <= 1:
            return num_rows
        return max(MLP_CHUNK_MIN_ROWS, -(-num_rows // num_chunks))
