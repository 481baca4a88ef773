"""Layer numerics against transformers: RoPE frequencies (default, linear, llama3), RMSNorm, rotation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvflow.models.layers import RMSNorm, RotaryEmbedding
from kvflow.models.layers.rotary import rope_inverse_frequencies

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3])
def test_inverse_frequencies_match_transformers(scaling: dict[str, Any] | None) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, rope_theta=10000.0, rope_scaling=scaling
    )
    expected = LlamaRotaryEmbedding(config).inv_freq
    torch.testing.assert_close(
        rope_inverse_frequencies(32, 10000.0, scaling), expected, atol=0, rtol=0
    )


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match=r"'yarn'.*llama3"):
        rope_inverse_frequencies(32, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_inverse_frequencies(
            32, 10000.0, {"rope_type": "default", "partial_rotary_factor": 0.5}
        )
    with pytest.raises(ValueError, match="'low_freq_factor'"):
        rope_inverse_frequencies(32, 10000.0, {"rope_type": "llama3", "factor": 8.0})


def test_rotation_matches_rotate_half_form() -> None:
    rotary = RotaryEmbedding(16, 8, 10000.0, None, device="cpu")
    positions = torch.tensor([0, 3, 7, 12])  # 12 is past the cache: it grows
    cos, sin = rotary.cos_sin(positions, torch.float32, max_position=12)
    heads = torch.randn(4, 3, 16)
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    rotate_half = torch.cat([-heads[..., 8:], heads[..., :8]], -1)
    torch.testing.assert_close(
        RotaryEmbedding.apply(heads, cos, sin), heads * full_cos + rotate_half * full_sin
    )
    torch.testing.assert_close(
        RotaryEmbedding.apply(heads[:1], cos[:1], sin[:1]), heads[:1]
    )  # position 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    reference = LlamaRMSNorm(32, eps=1e-5).to(dtype)
    ours = RMSNorm(32, 1e-5, dtype=dtype, device="cpu")
    weight = torch.randn(32).to(dtype)
    reference.weight.data.copy_(weight)
    ours.weight.data.copy_(weight)
    hidden, residual = torch.randn(5, 32).to(dtype), torch.randn(5, 32).to(dtype)
    torch.testing.assert_close(ours(hidden), reference(hidden), atol=0, rtol=0)
    normed, new_residual = ours.forward_with_residual(hidden, residual)
    torch.testing.assert_close(normed, reference(hidden + residual), atol=0, rtol=0)
    torch.testing.assert_close(new_residual, hidden + residual, atol=0, rtol=0)
