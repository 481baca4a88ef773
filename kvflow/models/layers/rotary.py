"""Rotary position embeddings (the rotate-half form used by Llama, Qwen and Mistral) with a precomputed cache.

Partial rotary (`partial_rotary_factor` < 1 in the scaling dict: Phi-4-mini, GGUF `rope.dimension_count` below the
head size): RoPE rotates the first `rotary_dim = int(head_dim * partial_rotary_factor)` dims of each head, as if they
were a whole head of that size (its frequencies, and every scaling type's, computed for `rotary_dim`, as transformers
does), and the remaining dims pass through unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvflow import kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")
# Positions cached up front; longer sequences grow the cache (by doubling) on the forward that needs them.
_INITIAL_CACHED_POSITIONS = 8192


def rotary_dimension(head_dim: int, scaling: dict[str, Any] | None) -> int:
    """How many leading dims of each head RoPE rotates: `int(head_dim * partial_rotary_factor)` (transformers'
    rounding), the whole head without the key. A ValueError unless it is even and within `1..head_dim`."""
    factor = float((scaling or {}).get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(
            f"partial_rotary_factor {factor} gives {rotary_dim} rotary dims of head_dim {head_dim}; "
            "RoPE needs an even count from 2 to head_dim"
        )
    return rotary_dim


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """The `[rotary_dimension(head_dim, scaling) // 2]` float32 inverse frequencies, scaled as
    `scaling["rope_type"]` says.

    Matches transformers' `ROPE_INIT_FUNCTIONS` for the supported types, partial rotary included (the exponents are
    over the rotary dims); any other type is a ValueError naming it. "freq_factors" divides each frequency by its
    entry of `factors` (llama.cpp's `rope_freqs` tensor, which GGUF files of Llama 3.1+ carry instead of the scaling
    parameters).
    """
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    rotary_dim = rotary_dimension(head_dim, scaling)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        return inv_freq / float(_parameter(scaling, "factor"))
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)
    if rope_type == "freq_factors":
        factors = torch.tensor(_parameter(scaling, "factors"), dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"rope freq_factors has {factors.numel()} entries for {inv_freq.numel()} frequencies"
            )
        return inv_freq / factors
    return inv_freq


def _parameter(scaling: dict[str, Any], key: str) -> Any:
    if key not in scaling:
        raise ValueError(f"rope_scaling of type {scaling['rope_type']!r} lacks {key!r}")
    return scaling[key]


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, the band between interpolated."""
    factor = float(_parameter(scaling, "factor"))
    low_freq_factor = float(_parameter(scaling, "low_freq_factor"))
    high_freq_factor = float(_parameter(scaling, "high_freq_factor"))
    old_context_len = float(_parameter(scaling, "original_max_position_embeddings"))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates query/key heads by their positions: `x1' = x1 cos - x2 sin`, `x2' = x2 cos + x1 sin` (halves of the
    first `rotary_dim` dims; any dims past them pass through).

    Invariants: `rotary_dim` is `rotary_dimension(head_dim, scaling)`; `cos_cache`/`sin_cache` are float32
    `[num_cached_positions, rotary_dim // 2]` (`position * inv_freq`, as transformers computes it), built at
    construction for min(max_position, 8192) positions and grown only when a forward reaches past them. `cos_sin` is
    called once per forward; every layer reuses its result, and `apply` reads the rotary width off it.
    `_tables[dtype]` are those caches cast to `dtype` and shaped `[num_cached_positions, 1, rotary_dim // 2]`, made
    on the first `cos_sin` in that dtype and dropped whenever the caches change (`_grow`, `Module.to`): a cast is
    elementwise, so gathering their rows equals casting the gathered float32 rows, bit for bit, in one op a table.
    """

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
        *,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dimension(head_dim, scaling)
        self.register_buffer(
            "inv_freq",
            rope_inverse_frequencies(head_dim, theta, scaling).to(device),
            persistent=False,
        )
        self.register_buffer(
            "cos_cache", torch.empty(0, self.rotary_dim // 2, device=device), persistent=False
        )
        self.register_buffer(
            "sin_cache", torch.empty(0, self.rotary_dim // 2, device=device), persistent=False
        )
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._num_cached = 0
        self._grow(max(min(max_position, _INITIAL_CACHED_POSITIONS), 1))

    def _grow(self, num_positions: int) -> None:
        positions = torch.arange(num_positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = positions[:, None] * self.inv_freq[None, :]
        self.cos_cache = freqs.cos()
        self.sin_cache = freqs.sin()
        self._num_cached = num_positions
        self._tables = {}

    def _apply(self, *args: Any, **kwargs: Any) -> RotaryEmbedding:
        # `.to(...)`, `.cuda()`, `.half()` move or cast the caches: the cast tables follow them on the next call.
        self._tables = {}
        return super()._apply(*args, **kwargs)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)` for each position as `[num_tokens, 1, rotary_dim // 2]` in `dtype`, new contiguous
        tensors.

        `max_position`, if known, is the largest entry of `positions`; the cache grows to cover it.
        """
        if max_position is not None and max_position >= self._num_cached:
            self._grow(max(max_position + 1, 2 * self._num_cached))
        tables = self._tables.get(dtype)
        if tables is None:
            tables = (
                self.cos_cache.to(dtype).unsqueeze(1).contiguous(),
                self.sin_cache.to(dtype).unsqueeze(1).contiguous(),
            )
            self._tables[dtype] = tables
        cos_table, sin_table = tables
        return cos_table.index_select(0, positions), sin_table.index_select(0, positions)

    @staticmethod
    def apply(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `[num_tokens, num_heads, head_dim]` heads (any strides) by `cos_sin`'s tables; returns a new
        contiguous tensor. The first `2 * cos.shape[-1]` dims of each head rotate, the rest are copied."""
        rotary_dim = 2 * cos.shape[-1]
        if rotary_dim == heads.shape[-1]:
            return _rotate(heads, cos, sin)
        rotated = _rotate(heads[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, heads[..., rotary_dim:]), dim=-1)


def _rotate(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every dim of `[num_tokens, num_heads, 2 * cos.shape[-1]]` heads into a new contiguous tensor."""
    fused = kernels.rotary(heads, cos, sin)  # one pass on CPU, else None
    if fused is not None:
        return fused
    half = heads.shape[-1] // 2
    first, second = heads[..., :half], heads[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
