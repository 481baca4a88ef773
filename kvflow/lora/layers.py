"""The adapter side of one linear layer: its `max_loras` slots of stacked LoRA weights, and the step's token ->
slot map every layer of a model shares.

A layer's product is `y = base(x)`; with adapters it becomes `y[i] += B_s @ (A_s @ x[i])` for each row `i` whose
request runs with the adapter in slot `s` (the scaling is folded into B when the adapter loads). Rows of the base
model (slot -1) are never written, so they are bit-identical to a step without adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvflow.lora.punica import lora_add

if TYPE_CHECKING:
    from kvflow.models.layers.linear import Linear


class LoRAStepState:
    """The step's adapter slot per token, shared by every LoRA layer of a model (set once per forward pass).

    Invariants: `token_slots` is None (no token of the step has an adapter: every layer skips its delta) or
    `[num_tokens]` int32 with -1 for base-model tokens; `output_token_slots` is the same map for the rows that
    go past attention in the last decoder layer (`logits_indices`), whose output projection and feed-forward block
    see only those rows.
    """

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None
        self.output_token_slots: torch.Tensor | None = None

    def set_step(self, token_slots: torch.Tensor | None, logits_indices: torch.Tensor) -> None:
        self.token_slots = token_slots
        self.output_token_slots = (
            None if token_slots is None else token_slots.index_select(0, logits_indices)
        )


class LoRALayerWeights:
    """One linear layer's adapter slots.

    Invariants: `lora_a` is `[max_loras, num_parts * max_rank, in_features]` and `lora_b` `[max_loras,
    out_features, max_rank]` (this rank's rows and columns under tensor parallelism), in the layer's dtype; part
    `p` of slot `s` uses A rows `p * max_rank ...` and B rows `part_offsets[p] ... part_offsets[p + 1]`; a rank
    below `max_rank` and a part the adapter does not target are zero, so they add nothing. `reads_output_rows`:
    the layer runs on the last decoder layer's output rows only (every projection there but the QKV one).
    """

    def __init__(
        self,
        layer: Linear,
        *,
        module_name: str,
        max_loras: int,
        max_rank: int,
        state: LoRAStepState,
        reads_output_rows: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.module_name = module_name
        self.max_rank = max_rank
        self.state = state
        self.reads_output_rows = reads_output_rows
        self.part_sizes = tuple(layer.output_sizes)
        offsets = [0]
        for size in self.part_sizes:
            offsets.append(offsets[-1] + size)
        self.part_offsets = tuple(offsets)
        self.in_features = layer.input_size
        # In the activations' dtype (the model's), also beside quantized base weights.
        self.lora_a = torch.zeros(
            (max_loras, len(self.part_sizes) * max_rank, self.in_features),
            dtype=dtype,
            device=device,
        )
        self.lora_b = torch.zeros(
            (max_loras, self.part_offsets[-1], max_rank), dtype=dtype, device=device
        )

    def set_slot(
        self,
        slot: int,
        lora_a: Sequence[torch.Tensor | None],
        lora_b: Sequence[torch.Tensor | None],
    ) -> None:
        """Write one adapter's parts (this rank's slices, already cut) into slot `slot`; None parts, and the
        columns past each part's rank, become zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for part, (part_a, part_b) in enumerate(zip(lora_a, lora_b, strict=True)):
            if part_a is None or part_b is None:
                continue
            rank = part_a.shape[0]
            start = part * self.max_rank
            self.lora_a[slot, start : start + rank].copy_(part_a)
            rows = slice(self.part_offsets[part], self.part_offsets[part + 1])
            self.lora_b[slot, rows, :rank].copy_(part_b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def add_delta(self, output: torch.Tensor, hidden_states: torch.Tensor) -> None:
        """Add the step's adapter deltas to `output` (the base product of `hidden_states`) in place."""
        state = self.state
        token_slots = state.output_token_slots if self.reads_output_rows else state.token_slots
        if token_slots is None:
            return
        if token_slots.shape[0] != hidden_states.shape[0]:
            raise RuntimeError(
                f"LoRA layer {self.module_name}: {hidden_states.shape[0]} rows for a step mapping "
                f"{token_slots.shape[0]} tokens to adapters"
            )
        lora_add(
            output,
            hidden_states.contiguous(),
            self.lora_a,
            self.lora_b,
            token_slots,
            self.part_offsets,
        )
