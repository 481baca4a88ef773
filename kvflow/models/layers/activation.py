"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflow import kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for the fused `[..., 2 * d]` output of a gate/up projection (gate first)."""
    fused = kernels.silu_and_mul(gate_up)  # one pass on CPU, else None
    if fused is not None:
        return fused
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :half]) * gate_up[..., half:]


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh(gate) * up` (GELU with the tanh approximation, transformers' "gelu_pytorch_tanh") for the fused
    `[..., 2 * d]` output of a gate/up projection (gate first)."""
    half = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :half], approximate="tanh") * gate_up[..., half:]
