"""Token embedding and the language-model head (which may share the embedding's weight), both vocab-parallel: with
several tensor-parallel ranks each rank holds a contiguous part of the vocabulary's rows, and each weight's
`weight_loader` copies just those rows of the checkpoint tensor."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvflow import kernels
from kvflow.distributed.parallel_state import TensorParallelGroup, vocab_partition
from kvflow.models.layers.linear import LinearMethod
from kvflow.models.layers.weights import CheckpointTensor, copy_checked, narrow, set_weight_loader


class EmbeddingMethod(Protocol):
    """How an embedding whose table is stored another way (GGUF blocks: `kvflow.models.quantization`) looks rows
    up: `lookup(ids)` is `F.embedding(ids, dequantized table)` in the model dtype."""

    name: str

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor: ...


class _VocabShard(nn.Module):
    """This rank's contiguous part of the vocabulary's rows, shared by the embedding and the LM head.

    Invariants: with one rank `weight` is `[vocab_size, hidden_size]` and the checkpoint tensor loads whole; with
    several it is `[padded rows, hidden_size]`, token ids `[vocab_start, vocab_start + num_vocab_rows)` in its first
    rows and zeros after them.
    """

    def __init__(self, vocab_size: int, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.tp = tp if tp is not None else TensorParallelGroup.single()
        self.vocab_size = vocab_size
        self.vocab_start, self.num_vocab_rows, self.padded_rows = vocab_partition(
            vocab_size, self.tp.size, self.tp.rank
        )
        # Set by a quantization method before loading (the table stored another way); None: a float table.
        self.quant_method: EmbeddingMethod | LinearMethod | None = None

    def _new_weight(
        self, hidden_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> nn.Parameter:
        data = (
            torch.zeros(self.padded_rows, hidden_size, dtype=dtype, device=device)
            if self.tp.size > 1
            else torch.empty(self.vocab_size, hidden_size, dtype=dtype, device=device)
        )
        weight = nn.Parameter(data, requires_grad=False)
        set_weight_loader(weight, self.weight_loader)
        return weight

    def checkpoint_index(self, param_name: str, shard: int | None) -> tuple[slice, ...]:
        """The checkpoint rows this rank holds (`()`: all of them, with one rank)."""
        if self.tp.size == 1:
            return ()
        return (slice(self.vocab_start, self.vocab_start + self.num_vocab_rows),)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        """Copy the checkpoint rows this rank holds into the weight's first `num_vocab_rows` rows."""
        part = narrow(loaded_weight, self.checkpoint_index("weight", shard_id))
        copy_checked(param.data[: self.num_vocab_rows], part)


class VocabEmbedding(_VocabShard):
    """Looks token ids up in a `[vocab_size, hidden_size]` table (`weight`).

    With `tp` of several ranks each rank looks up the ids it holds (zeros for the others) and one all-reduce sums
    the rows, so every rank gets every embedding.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(vocab_size, tp)
        self.weight = self._new_weight(hidden_size, dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        local_ids = input_ids - self.vocab_start
        held = (local_ids >= 0) & (local_ids < self.num_vocab_rows)
        embedded = self._lookup(local_ids.clamp(0, self.weight.shape[0] - 1))
        embedded = embedded * held.unsqueeze(-1).to(embedded.dtype)
        return self.tp.all_reduce(embedded)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.lookup(input_ids)  # type: ignore[union-attr]
        return F.embedding(input_ids, self.weight)


class LMHead(_VocabShard):
    """Projects hidden states to float32 vocabulary logits.

    Invariants: `weight` is laid out exactly as `VocabEmbedding`'s, in the model dtype; when tied it IS the
    embedding's Parameter (one tensor, loaded once). The matmul runs in the model dtype; with several ranks the
    partial logits are all-gathered (every rank's sampler sees the same logits) and the padding columns dropped;
    only then is the output upcast.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        tied_to: VocabEmbedding | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__(vocab_size, tp)
        self.weight = (
            tied_to.weight if tied_to is not None else self._new_weight(hidden_size, dtype, device)
        )

    def tie(self, embedding: VocabEmbedding) -> None:
        """Share the embedding's weight (for checkpoints that ship no `lm_head.weight`)."""
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            logits = self.quant_method.apply(hidden_states, None)  # type: ignore[union-attr]
        else:
            out = kernels.linear(hidden_states, self.weight, float_output=True)  # CPU GEMV/GEMM
            logits = out if out is not None else F.linear(hidden_states, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last_dim(logits)[..., : self.vocab_size]
        return logits if logits.dtype is torch.float32 else logits.float()
