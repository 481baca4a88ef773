"""Building blocks shared by the model families: norms, activations, rotary embeddings, linear layers, the token
embedding and LM head, self-attention, the dense feed-forward block and the decoder layer / trunk.

A family module (`kvflow.models.llama`, ...) composes these; a block a second family would need goes here rather
than into a family module (a mixture-of-experts layer sits beside `mlp`, taking `GatedMLP`'s place in a decoder
layer).
"""

from __future__ import annotations

from kvflow.models.layers.activation import silu_and_mul
from kvflow.models.layers.decoder import DecoderLayerFactory, DecoderModel, PreNormDecoderLayer
from kvflow.models.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from kvflow.models.layers.mlp import GatedMLP
from kvflow.models.layers.norm import RMSNorm
from kvflow.models.layers.rotary import RotaryEmbedding
from kvflow.models.layers.self_attention import SelfAttention, tp_head_ranges
from kvflow.models.layers.vocab import LMHead, VocabEmbedding

__all__ = [
    "ColumnParallelLinear",
    "DecoderLayerFactory",
    "DecoderModel",
    "GatedMLP",
    "LMHead",
    "Linear",
    "PreNormDecoderLayer",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SelfAttention",
    "VocabEmbedding",
    "silu_and_mul",
    "tp_head_ranges",
]
