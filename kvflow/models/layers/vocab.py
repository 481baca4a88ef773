"""Token embedding and the language-model head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import kernels


class VocabEmbedding(nn.Module):
    """Looks token ids up in a `[vocab_size, hidden_size]` table (`weight`)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to float32 vocabulary logits.

    Invariants: `weight` is `[vocab_size, hidden_size]` in the model dtype; when tied it IS the embedding's
    Parameter (one tensor, loaded once). The matmul runs in the model dtype; only its output is upcast.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tied_to: VocabEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.weight = (
            tied_to.weight
            if tied_to is not None
            else nn.Parameter(
                torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                requires_grad=False,
            )
        )

    def tie(self, embedding: VocabEmbedding) -> None:
        """Share the embedding's weight (for checkpoints that ship no `lm_head.weight`)."""
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = kernels.linear(hidden_states, self.weight, float_output=True)  # decode GEMV on CPU
        return out if out is not None else F.linear(hidden_states, self.weight).float()
