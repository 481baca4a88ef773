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

# `hidden_act` -> the gated activation of the fused gate/up output.
_GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,  # Gemma 2
}


class GatedMLP(nn.Module):
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))` with gate and up fused in `gate_up_proj` (gate rows first).

    Invariants: the config's `hidden_act` is "silu" or "gelu_pytorch_tanh" (Gemma 2: `gelu_tanh` in silu's place;
    anything else is a ValueError at construction); its checkpoint
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
        return self.down_proj(self.activation(self.gate_up_proj(hidden_states)))
