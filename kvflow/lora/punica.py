"""The batched LoRA delta of a layer (punica's bgmv for decode rows and sgmv for prefill rows, in one call):
`lora_add` adds every row's adapter delta to the base layer's output in place, on the C++ CPU kernel where it
applies (`kvflow.kernels.lora_add`, csrc/lora.cpp), else on `lora_add_reference` (PyTorch: the CUDA path, the
`KVFLOW_CPU_KERNELS=0` path and what the kernel is tested against).

The operation, for every row i with slot s = token_slots[i] >= 0 and every part p of a packed layer (qkv_proj: 3
parts q, k, v; gate_up_proj: 2; o_proj and down_proj: 1), whose output rows are part_offsets[p] .. part_offsets[p+1]:

    t = lora_a[s, p * rank:(p + 1) * rank] @ x[i]                          float32 sums, t kept in float32
    y[i, part] = dtype(float(y[i, part]) + lora_b[s, part, :] @ t)         float32 sum, one rounding

Shapes: y [n, out] and x [n, in] (the model dtype, bfloat16 or float32, contiguous rows), lora_a
[num_slots, num_parts * rank, in] and lora_b [num_slots, out, rank] (that dtype, contiguous), token_slots [n] int32
(int64 is accepted and converted; -1 = no adapter), part_offsets num_parts + 1 ints from 0 to out, increasing.

Invariants:
- a row with slot -1 is never written: it stays bitwise what it was;
- the adapter's scaling is already folded into lora_b; a part the adapter does not target holds zeros, and ranks
  below `rank` are zero-padded, so padding adds exact zeros;
- on the kernel a row's result is bitwise independent of the other rows, of n and of the thread count. The
  reference's float32 matmuls may sum in an order that depends on how many rows share a slot, so it agrees with the
  kernel to float32 rounding (then one rounding to the dtype), not bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

from kvflow import kernels

__all__ = ["SlotRows", "check_lora_operands", "lora_add", "lora_add_reference", "slot_row_groups"]

# One adapter slot and its rows (int64, ascending) in a step's batch.
SlotRows = tuple[int, torch.Tensor]
_DTYPES = (torch.bfloat16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    part_offsets: Sequence[int] | torch.Tensor,
) -> None:
    """Adds each row's LoRA delta to `y` in place (the module docstring states the operation and its invariants):
    on the C++ kernel where it applies, else on `lora_add_reference`. Raises ValueError (reference) or RuntimeError
    (kernel) naming the offending argument for inconsistent shapes, dtypes or slots."""
    if not kernels.lora_add(y, x, lora_a, lora_b, token_slots, part_offsets):
        lora_add_reference(y, x, lora_a, lora_b, token_slots, part_offsets)


def slot_row_groups(token_slots: torch.Tensor) -> list[SlotRows]:
    """The slots the rows use, ascending, each with its rows (int64, ascending); rows with slot -1 are in none.

    A layer stack can compute this once per step and pass it to every `lora_add_reference` call of the step."""
    slots = token_slots.to(torch.int64)
    used = torch.unique(slots[slots >= 0])
    return [(int(slot), torch.nonzero(slots == slot).flatten()) for slot in used.tolist()]


def check_lora_operands(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    part_offsets: Sequence[int] | torch.Tensor,
) -> list[int]:
    """The part offsets as a list of ints, after checking every operand against the contract (module docstring);
    raises ValueError naming the first argument that breaks it (slot values included)."""
    if y.dtype not in _DTYPES:
        raise ValueError(f"y must be bfloat16 or float32, got {y.dtype}")
    for name, tensor in (("x", x), ("lora_a", lora_a), ("lora_b", lora_b)):
        if tensor.dtype is not y.dtype:
            raise ValueError(f"{name} must have y's dtype {y.dtype}, got {tensor.dtype}")
    if y.dim() != 2:
        raise ValueError(f"y must be 2-D [n, out], got shape {tuple(y.shape)}")
    if x.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x must be 2-D [n = {y.shape[0]}, in], got shape {tuple(x.shape)}")
    num_rows, out_features, in_features = y.shape[0], y.shape[1], x.shape[1]
    if lora_b.dim() != 3 or lora_b.shape[1] != out_features:
        raise ValueError(
            f"lora_b must be [num_slots, out = {out_features}, rank], got shape {tuple(lora_b.shape)}"
        )
    num_slots, rank = lora_b.shape[0], lora_b.shape[2]
    offsets = [int(offset) for offset in part_offsets]
    num_parts = len(offsets) - 1
    if (
        num_parts < 1
        or offsets[0] != 0
        or offsets[-1] != out_features
        or any(low >= high for low, high in pairwise(offsets))
    ):
        raise ValueError(
            f"part_offsets must increase strictly from 0 to out = {out_features}, got {offsets}"
        )
    if tuple(lora_a.shape) != (num_slots, num_parts * rank, in_features):
        raise ValueError(
            f"lora_a must be [num_slots = {num_slots}, num_parts * rank = {num_parts * rank}, "
            f"in = {in_features}], got shape {tuple(lora_a.shape)}"
        )
    if token_slots.dtype not in _SLOT_DTYPES or tuple(token_slots.shape) != (num_rows,):
        raise ValueError(
            f"token_slots must be int32 or int64 [n = {num_rows}], got {token_slots.dtype} "
            f"of shape {tuple(token_slots.shape)}"
        )
    if num_rows and (int(token_slots.min()) < -1 or int(token_slots.max()) >= num_slots):
        raise ValueError(f"token_slots must lie in [-1, num_slots = {num_slots})")
    return offsets


def lora_add_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    part_offsets: Sequence[int] | torch.Tensor,
    *,
    row_groups: list[SlotRows] | None = None,
) -> None:
    """`lora_add` in PyTorch on any device: per slot, its rows are gathered, multiplied in float32 (shrink, then
    expand per part), added to their float32 y and rounded once, and only those rows are copied back
    (`index_copy_`); rows with slot -1 are never written. `row_groups` (from `slot_row_groups`) skips the grouping.
    """
    offsets = check_lora_operands(y, x, lora_a, lora_b, token_slots, part_offsets)
    rank = lora_b.shape[2]
    for slot, rows in slot_row_groups(token_slots) if row_groups is None else row_groups:
        # [rows, num_parts * rank]
        shrunk = x.index_select(0, rows).float() @ lora_a[slot].float().T
        delta = torch.empty(rows.numel(), y.shape[1], dtype=torch.float32, device=y.device)
        for part, (low, high) in enumerate(pairwise(offsets)):
            part_t = shrunk[:, part * rank : (part + 1) * rank]
            delta[:, low:high] = part_t @ lora_b[slot, low:high].float().T
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))
