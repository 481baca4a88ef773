"""Layer numerics against transformers: RoPE frequencies (default, linear, llama3), RMSNorm, rotation (whole heads
and partial rotary)."""

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
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.1 gives 3 rotary dims"):
        rope_inverse_frequencies(
            32, 10000.0, {"rope_type": "default", "partial_rotary_factor": 0.1}
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


def _hf_partial_rotary_tables(
    scaling: dict[str, Any], head_dim: int, num_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `[positions, rotary_dim]` cos/sin for a partial-rotary config (its attention scaling applied)."""
    from transformers import LlamaConfig, Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope_type = scaling["rope_type"]
    shape = {"hidden_size": 4 * head_dim, "num_attention_heads": 4, "max_position_embeddings": 64}
    parameters = {**scaling, "rope_theta": 10000.0}
    if rope_type in ("default", "longrope"):
        hf_rotary = Phi3RotaryEmbedding(Phi3Config(**shape, rope_parameters=parameters))
        inv_freq, attention_scaling = hf_rotary.inv_freq, hf_rotary.attention_scaling
    else:
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](
            LlamaConfig(**shape, rope_parameters=parameters)
        )
    freqs = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * attention_scaling, angles.sin() * attention_scaling


PARTIAL_ROTARY_SCALINGS = [
    {"rope_type": "default", "partial_rotary_factor": 0.75},
    {"rope_type": "linear", "factor": 4.0, "partial_rotary_factor": 0.5},
    {**LLAMA3, "partial_rotary_factor": 0.75},
    {
        "rope_type": "longrope",
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0],
        "long_factor": [1.0] * 12,
        "original_max_position_embeddings": 64,
        "attention_factor": 1.25,
    },
]


@pytest.mark.parametrize(
    "scaling", PARTIAL_ROTARY_SCALINGS, ids=[s["rope_type"] for s in PARTIAL_ROTARY_SCALINGS]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_matches_transformers(scaling: dict[str, Any], dtype: torch.dtype) -> None:
    """rotary_dim < head_dim, for every rope type the layer builds: the tables are transformers' for the rotated
    dims, and `apply` equals transformers' Phi-3 `apply_rotary_pos_emb` (rotate the first rotary_dim dims of each
    head, pass the rest) on strided q/k views of one qkv tensor, as the attention layer passes them."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    from kvflow.models.phi3 import LongRopeRotaryEmbedding

    head_dim = 32
    rotary_dim = int(head_dim * scaling["partial_rotary_factor"])
    if scaling["rope_type"] == "longrope":
        rotary: RotaryEmbedding = LongRopeRotaryEmbedding(
            head_dim, 64, 10000.0, scaling, 64, device="cpu"
        )
    else:
        rotary = RotaryEmbedding(head_dim, 64, 10000.0, scaling, device="cpu")
    assert rotary.rotary_dim == rotary_dim
    positions = torch.tensor([0, 1, 5, 17, 40, 63])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    assert cos.shape == (6, 1, rotary_dim // 2)
    hf_cos, hf_sin = _hf_partial_rotary_tables(scaling, head_dim, 64)
    torch.testing.assert_close(cos[:, 0], hf_cos[positions, : rotary_dim // 2], atol=0, rtol=0)
    torch.testing.assert_close(sin[:, 0], hf_sin[positions, : rotary_dim // 2], atol=0, rtol=0)

    qkv = torch.randn(6, 3 + 2 * 1, head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    query, key = qkv[:, :3], qkv[:, 3:4]
    cos, sin = rotary.cos_sin(positions, dtype)
    # transformers' layout: [batch, heads, tokens, head_dim], cos/sin [batch, tokens, rotary_dim]
    hf_query, hf_key = apply_rotary_pos_emb(
        query.transpose(0, 1)[None],
        key.transpose(0, 1)[None],
        hf_cos[positions].to(dtype)[None],
        hf_sin[positions].to(dtype)[None],
    )
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype is torch.float32 else {}
    for ours, theirs in (
        (RotaryEmbedding.apply(query, cos, sin), hf_query),
        (RotaryEmbedding.apply(key, cos, sin), hf_key),
    ):
        assert ours.is_contiguous()
        torch.testing.assert_close(ours, theirs[0].transpose(0, 1), **tolerance)
        assert torch.equal(ours[..., rotary_dim:], theirs[0].transpose(0, 1)[..., rotary_dim:])


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
