"""Building blocks shared by the model implementations: norms, activations, rotary embeddings, linear layers."""

from __future__ import annotations

from kvflow.models.layers.activation import silu_and_mul
from kvflow.models.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from kvflow.models.layers.norm import RMSNorm
from kvflow.models.layers.rotary import RotaryEmbedding
from kvflow.models.layers.vocab import LMHead, VocabEmbedding

__all__ = [
    "ColumnParallelLinear",
    "LMHead",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabEmbedding",
    "silu_and_mul",
]
