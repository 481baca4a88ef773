"""RMS normalisation with Llama numerics: statistics in float32, weight applied in the input dtype."""

from __future__ import annotations

import torch
from torch import nn

from kvflow import kernels
from kvflow.models.layers.weights import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    """`weight * (x / sqrt(mean(x**2) + eps))` over the last dimension.

    Invariants: `weight` has shape `[hidden_size]` and the module's dtype; the normalisation itself runs in float32 and
    is cast back to the input dtype before the weight multiplies it (as in transformers), so float32 results match
    the reference bit for bit and half-precision ones to its rounding. `float32_kernel` (set by the fused decode
    path of quantized float32 models, `kvflow.models.fused_decode`) sends float32 rows to the C++ kernel as well, whose
    sum runs in another order than torch's: such a model's per-op layers then equal its fused ones bit for bit.
    `forward_heads` (Qwen3's per-head q/k norm) runs bfloat16 rows on that kernel always, as the fused layer does.
    """

    float32_kernel: bool = False

    def __init__(
        self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # float32 rows skip the casts, which would return the same tensor (fewer torch calls, same values).
        is_float32 = hidden_states.dtype is torch.float32
        as_float = hidden_states if is_float32 else hidden_states.float()
        variance = as_float.pow(2).mean(-1, keepdim=True)
        normalised = as_float * torch.rsqrt(variance + self.eps)
        return self.weight * (normalised if is_float32 else normalised.to(hidden_states.dtype))

    def forward_heads(self, heads: torch.Tensor) -> torch.Tensor:
        """The per-head norm (Qwen3's q/k norm) of `[tokens, heads, head_dim]`: on the C++ kernel where it takes the
        rows (bfloat16; float32 with `float32_kernel`), the very one the fused decode layer calls per head, else
        `forward`."""
        fused = kernels.add_rms_norm(
            heads.contiguous(), None, self.weight, self.eps, float32=self.float32_kernel
        )  # CPU, else None
        return self(heads) if fused is None else fused[0]

    def forward_with_residual(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the residual stream (if any) first; returns `(normalised, new residual)`."""
        if self.float32_kernel or hidden_states.dtype is not torch.float32:
            # float32 rows without `float32_kernel` never take the kernel: no need to ask it.
            fused = kernels.add_rms_norm(
                hidden_states, residual, self.weight, self.eps, float32=self.float32_kernel
            )  # CPU, else None
            if fused is not None:
                return fused
        if residual is not None:
            hidden_states = hidden_states + residual
        return self(hidden_states), hidden_states


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: `x / sqrt(mean(x**2) + eps) * (1 + weight)`, all in float32, cast back at the end.

    Invariants: `weight` is the checkpoint's offset from 1 (initialised to zeros); unlike `RMSNorm`, the weight
    multiplies in float32 before the cast (as transformers' `Gemma2RMSNorm`), and no C++ kernel is used, so float32
    results match the reference bit for bit.
    """

    def __init__(
        self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__(hidden_size, eps, dtype=dtype, device=device)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        as_float = hidden_states.float()
        normalised = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normalised * (1.0 + self.weight.float())).type_as(hidden_states)

    def forward_heads(self, heads: torch.Tensor) -> torch.Tensor:
        return self(heads)

    def forward_with_residual(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the residual stream (if any) first; returns `(normalised, new residual)`."""
        if residual is not None:
            hidden_states = hidden_states + residual
        return self(hidden_states), hidden_states
